"""`--mode=export`: a checkpoint as a SavedModel with the task's serving signatures.

The task is built unpipelined: every PipeliningLayer gets one cell, one micro-batch and one
replica, placed locally, whatever K, R, T and schedule trained the checkpoint (its variable
keys do not depend on the partition, `BaseTask.checkpoint_variables`). The latest intact
checkpoint of the logdir (or `--export_checkpoint`, a step or a checkpoint path) is restored
into it with the trainer's own `Checkpointer`, then `task.Inference()` (an
`inference.InferenceGraph`) gives the signatures. The SavedModel is written to
`<logdir>/export/<step>/` (a temporary directory renamed into place; a previous export of the
same step is replaced) and holds:
  - the model's variables as plain `tf.Variable`s (no optimizer slots, no global step);
  - the signatures, traced once each, with the resources they use (lookup tables, a
    tokenizer, assets such as a sentencepiece model under `assets/`).
Loading it needs TensorFlow only, and tensorflow-text for a translation model (its
sentencepiece ops): `tf.saved_model.load(path).signatures['serving_default'](...)`, or
`saved_model_cli show --all --dir <path>` to list the signatures (docs/export.md).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any, TextIO

from lingvo_lite.training import model_config
from lingvo_lite.training.options import UsageError

__all__ = ["check_inference_defined", "describe_signatures", "export_dir", "export_saved_model",
           "prepare_export", "resolve_checkpoint", "unpipelined_task_params"]

Job = Callable[[], int]

EXPORT_SUBDIR = "export"


def export_dir(logdir: str, step: int) -> str:
    """Where the export of the checkpoint of global step `step` goes."""
    return os.path.join(logdir, EXPORT_SUBDIR, str(step))


def unpipelined_task_params(task_params: Any) -> Any:
    """A copy of the task params with every pipeline on one local cell (K = T = R = 1)."""
    p = task_params.Copy()
    model_config.set_pipeline_fields(p, num_cells=1, num_micro_batches=1, num_replicas=1)
    for _, pp in model_config.iter_pipelining_params(p):
        pp.placement = "auto"  # Where the export runs, not the devices that trained it.
        pp.micro_batch_size = None
    if "shard_optimizer_state" in p.train:
        p.train.shard_optimizer_state = False
    p.train.init_from_checkpoint = None  # The restored checkpoint sets every weight.
    return p


def resolve_checkpoint(logdir: str, requested: str | None) -> str | None:
    """The checkpoint prefix `--export_checkpoint` names, or None for the latest.

    `requested` is a global step (`400`: `<logdir>/checkpoints/ckpt-400`) or a checkpoint path
    (`.../ckpt-400`, with or without `.index`). UsageError when it names no checkpoint.
    """
    from lingvo_lite.training import checkpointer

    if requested is None or not str(requested).strip():
        return None
    text = str(requested).strip()
    if text.isdigit():
        path = os.path.join(checkpointer.checkpoint_dir(logdir), f"ckpt-{int(text)}")
    else:
        path = os.path.abspath(os.path.expanduser(text))
        if path.endswith(checkpointer.INDEX_SUFFIX):
            path = path[: -len(checkpointer.INDEX_SUFFIX)]
    if not os.path.exists(path + checkpointer.INDEX_SUFFIX):
        have = [os.path.basename(c) for c in checkpointer.candidate_checkpoints(logdir)]
        listed = f"checkpoints in {logdir}: {', '.join(have)}" if have else \
            f"no checkpoint in {checkpointer.checkpoint_dir(logdir)}"
        raise UsageError(f"--export_checkpoint={requested}: {path} is not a checkpoint "
                         f"(no {os.path.basename(path)}{checkpointer.INDEX_SUFFIX}); {listed}.")
    return path


def _restore(task: Any, logdir: str, path: str | None, err: TextIO) -> str:
    """Restores `path` (None: the newest intact checkpoint) into `task`; returns its path."""
    from lingvo_lite.training import checkpointer

    def warn(msg: str) -> None:
        print(f"trainer.py: warning: {msg}", file=err, flush=True)

    ckpt = checkpointer.Checkpointer(logdir, task.checkpoint_variables(), warn=warn)
    if path is None:
        return ckpt.restore_latest()
    damage = checkpointer.find_damage(path)
    if damage is not None:
        raise ValueError(f"--export_checkpoint: checkpoint {path} is damaged ({damage}); export "
                         "another step.")
    ckpt.restore(path)
    return path


def _model_variables(task: Any) -> list[Any]:
    """The variables the signatures read: every variable of the model, once each."""
    seen, out = set(), []
    for v in task.vars.Flatten():
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def export_saved_model(task: Any, graph: Any, path: str) -> None:
    """Writes `graph` (the task's `InferenceGraph`) as a SavedModel at `path` (replaced).

    The SavedModel's root holds the model's variables, the graph's resources and one function
    per signature; it is written under a temporary name, then renamed into place.
    """
    import tensorflow as tf

    if not graph.signatures:
        raise ValueError(f"{type(task).__name__}.Inference() returned no signatures.")
    root = tf.Module()
    root.model_variables = _model_variables(task)
    for name, resource in graph.resources.items():
        setattr(root, name, resource)
    concrete = {}
    for name, fn in graph.signatures.items():
        if getattr(fn, "input_signature", None) is None:
            raise ValueError(f"{type(task).__name__}.Inference(): signature {name!r} needs a "
                             "tf.function with an input_signature.")
        concrete[name] = fn.get_concrete_function()
    root.signature_functions = dict(graph.signatures)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tf.saved_model.save(root, tmp, signatures=concrete)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def describe_signatures(graph: Any) -> str:
    """One line per signature: its name, inputs and outputs with dtypes and shapes."""
    import tensorflow as tf

    def spec(name: str, value: Any) -> str:
        dims = ",".join("?" if d is None else str(d) for d in value.shape.as_list())
        return f"{name} {value.dtype.name}[{dims}]"

    lines = []
    for name, fn in graph.signatures.items():
        concrete = fn.get_concrete_function()
        inputs = [spec(s.name, s) for s in tf.nest.flatten(concrete.structured_input_signature)]
        outputs = [spec(k, v) for k, v in concrete.structured_outputs.items()]
        lines.append(f"  {name}: ({', '.join(inputs)}) -> ({', '.join(outputs)})")
    return "\n".join(lines)


def check_inference_defined(config: model_config.ModelConfig) -> None:
    """InferenceNotDefinedError (one line naming `Inference()`) for a task class that keeps
    `BaseTask.Inference`, before any checkpoint is read or weight allocated."""
    from lingvo_lite.tasks import base_task, inference

    cls = config.task_params.cls
    if getattr(cls, "Inference", None) is base_task.BaseTask.Inference:
        raise inference.InferenceNotDefinedError(
            f"--mode=export: the task of model {config.name} ({cls.__name__}) defines no "
            "serving signatures; add a method Inference(self) to it returning "
            "lingvo_lite.tasks.inference.InferenceGraph(signatures={'serving_default': "
            "<tf.function with an input_signature>}) (docs/export.md).")


def prepare_export(config: model_config.ModelConfig, logdir: str, requested: str | None,
                   out: TextIO, err: TextIO) -> Job:
    """Setup of --mode=export: the unpipelined task, the checkpoint restored, its signatures."""
    from lingvo_lite.training import checkpointer

    check_inference_defined(config)
    if not checkpointer.candidate_checkpoints(logdir):
        raise FileNotFoundError(
            f"no checkpoint in {checkpointer.checkpoint_dir(logdir)} to export, train first "
            f"(--mode=train with the same --logdir).")
    path = resolve_checkpoint(logdir, requested)
    task = unpipelined_task_params(config.task_params).Instantiate()
    restored = _restore(task, logdir, path, err)
    step = checkpointer.checkpoint_step(restored)
    graph = task.Inference()
    target = export_dir(logdir, step)

    def job() -> int:
        print(f"Exporting {restored} (global step {step}) of {config.name}, unpipelined, to "
              f"{target} ...", file=out, flush=True)
        export_saved_model(task, graph, target)
        print(f"Exported {target} with signatures:\n{describe_signatures(graph)}", file=out,
              flush=True)
        return 0

    return job
