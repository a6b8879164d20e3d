"""Initialising a model from another run's checkpoint (transfer learning).

GPipe's transfer experiments start every layer from an ImageNet checkpoint
except a new softmax layer sized for the target classes. `warm_start` copies
every model variable whose key exists in the checkpoint, except keys matching
an exclude pattern; a variable whose shape differs is an error that says which
pattern would exclude it, so a partly-mismatched model is never loaded silently.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import tensorflow as tf
from absl import logging

__all__: list[str] = []


def checkpoint_key(name: str) -> str:
    """The key under which `tf.train.Checkpoint(model={name: var})` stores a variable."""
    escaped = name.replace(".", "..").replace("/", ".S")
    return f"model/{escaped}/.ATTRIBUTES/VARIABLE_VALUE"


def warm_start(variables: dict[str, tf.Variable], checkpoint_path: str,
               exclude: Sequence[str] = ()) -> dict[str, list[str]]:
    """Assigns checkpoint values to `variables` (keyed as in BaseTask.checkpoint_variables).

    Only model weights ('model/...') are considered: the optimizer state and the
    step start fresh. Returns {'loaded': [...], 'excluded': [...], 'missing': [...]}.

    Raises:
      FileNotFoundError: no checkpoint at `checkpoint_path`.
      ValueError: a variable's shape differs from the checkpoint's.
    """
    try:
        reader = tf.train.load_checkpoint(checkpoint_path)
    except (tf.errors.NotFoundError, ValueError) as e:
        raise FileNotFoundError(
            f"train.init_from_checkpoint={checkpoint_path!r}: no checkpoint there; give a path "
            "like <logdir>/checkpoints/ckpt-<step>."
        ) from e
    shapes = reader.get_variable_to_shape_map()
    patterns = [re.compile(p) for p in exclude]
    report: dict[str, list[str]] = {"loaded": [], "excluded": [], "missing": []}
    for name, var in sorted(variables.items()):
        if not name.startswith("model/"):
            continue
        if any(p.search(name) for p in patterns):
            report["excluded"].append(name)
            continue
        key = checkpoint_key(name)
        if key not in shapes:
            report["missing"].append(name)
            continue
        if list(shapes[key]) != var.shape.as_list():
            raise ValueError(
                f"train.init_from_checkpoint: '{name}' has shape {var.shape.as_list()} in the "
                f"model but {shapes[key]} in {checkpoint_path}. Exclude it (e.g. the softmax of "
                f"a new class count) with train.init_exclude, e.g. ['{re.escape(name)}']."
            )
        var.assign(reader.get_tensor(key))
        report["loaded"].append(name)
    logging.info("Warm start from %s: %d variables loaded, %d excluded, %d not in checkpoint.",
                 checkpoint_path, len(report["loaded"]), len(report["excluded"]),
                 len(report["missing"]))
    return report
