"""Test-session setup that must run before TensorFlow executes any op, and shared helpers.

The tests come in two tiers: `tests/unit/` mirrors the packages (`core/`, `layers/`,
`pipeline/`, ...; plain `pytest` runs it), `tests/e2e/` holds everything that starts a process
or trains a registered model (marked `e2e` here, by folder). Modules beside this file are
shared helpers (test models and makers), importable from every test file.

Logical CPU devices and thread pools can only be configured before the runtime
initialises, so this runs at import time of the test session. Eight logical
devices let the pipeline tests place up to K=8 cells on distinct devices.

Tests that start processes (`from conftest import launch_trainer, stop_processes`) stop only
what they started, by PID.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from lingvo_lite.core import devices  # noqa: E402

devices.configure_logical_cpus(8)

from lingvo_lite.tasks import model_registry  # noqa: E402

# As trainer.py does: the repository's registered models live in model_params/.
model_registry.add_model_package("model_params")

import tensorflow as tf  # noqa: E402

# tf.test.TestCase carries TF1's `test_session` context helper, which pytest would
# collect as a test and report as skipped.
tf.test.TestCase.test_session = None

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Files that compare pipelined numbers with plain TensorFlow or Keras at float tolerances. They
# carry the `numerics` marker: the README's test command runs them a second time with oneDNN
# off (TF_ENABLE_ONEDNN_OPTS=0), so both kernel families are exercised on whatever CPU runs
# the suite (oneDNN's default and its kernels depend on the CPU).
NUMERICS_FILES = frozenset({
    "amoebanet_consistency_test.py", "batch_norm_test.py", "dropout_test.py",
    "keras_buckets_test.py", "keras_functional_losses_test.py", "keras_functional_test.py",
    "keras_hub_families_test.py", "keras_hub_models_test.py", "keras_hub_test.py",
    "keras_hub_vision_test.py",
    "keras_layer_test.py", "keras_own_layers_test.py", "keras_settings_test.py",
    "loop_executor_test.py", "mesh_test.py", "pipeline_api_test.py", "pipeline_test.py",
    "pipelined_model_test.py", "zbv_schedule_test.py"})


def pytest_collection_modifyitems(items: list) -> None:
    """Files with a `slow` test first, each file's tests in their order.

    The README's command runs each file on one of three workers (`--dist loadfile`, files in
    this order: pyproject.toml turns off xdist's reordering by test count, which would start
    the one-test end-to-end files last). Long files first, so the short ones fill the workers'
    ends instead of one long file running alone at the end.
    """
    for item in items:
        if item.path.name in NUMERICS_FILES:
            item.add_marker(pytest.mark.numerics)
        if "e2e" in item.path.relative_to(REPO).parts:
            item.add_marker(pytest.mark.e2e)
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


def launch_trainer(*args: str, stderr: int = subprocess.PIPE,
                   env: Mapping[str, str | None] | None = None,
                   preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen:
    """Starts `python trainer.py *args` in the repository root, with text stdout (a pipe).

    The child gets this process's environment with the repository on PYTHONPATH and
    TensorFlow's C++ INFO/WARNING lines hidden, updated by `env` (a None value unsets the
    variable). `stderr` is a pipe unless given (e.g. `subprocess.STDOUT`).
    """
    child_env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    for name, value in (env or {}).items():
        if value is None:
            child_env.pop(name, None)
        else:
            child_env[name] = value
    return subprocess.Popen([sys.executable, os.path.join(REPO, "trainer.py"), *args],
                            cwd=REPO, env=child_env, stdout=subprocess.PIPE, stderr=stderr,
                            text=True, preexec_fn=preexec_fn)


def stop_processes(procs: Iterable[subprocess.Popen]) -> None:
    """Kills each process still running, then reaps it (and drains its pipes)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def hash_tree(directory: str) -> dict[str, str]:
    """relative path -> SHA-256 of every file under `directory`."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


def tanh_stack_with_loss(num_layers: int, width: int, num_classes: int,
                         prefix: str = "p") -> list:
    """Params of `num_layers` tanh dense layers on field x (named prefix0, prefix1, ...) and a
    softmax cross-entropy on (x, labels): the small pipeline several tests run."""
    from lingvo_lite.layers import dense, losses, structural

    layers = [structural.FieldLayer.Params().Set(
        name=f"{prefix}{i}", field="x", sub=dense.ProjectionLayer.Params().Set(
            name="proj", input_dim=width, output_dim=width, activation="TANH"))
        for i in range(num_layers)]
    layers.append(structural.FieldsLayer.Params().Set(
        name="loss", fields=["x", "labels"], sub=losses.SoftmaxCrossEntropyLayer.Params().Set(
            name="xent", input_dim=width, num_classes=num_classes)))
    return layers


def random_xy_batch(batch: int, width: int, num_classes: int):
    """A NestedMap(x, labels) of normal floats and uniform labels, seeded (same every call)."""
    import numpy as np

    from lingvo_lite.core.nested_map import NestedMap

    rng = np.random.default_rng(0)
    return NestedMap(x=tf.constant(rng.normal(size=(batch, width)), tf.float32),
                     labels=tf.constant(rng.integers(0, num_classes, size=batch), tf.int32))


def twin(model):
    """A copy of a plain Keras model with its own variables (values and seed states).

    `PipelinedModel(model)` trains `model`'s own variables, so a reference that trains or
    draws random numbers beside the pipeline must be another model: pipeline `twin(model)`
    and keep `model` as the plain reference.
    """
    import keras

    copy = keras.models.clone_model(model)
    for a, b in zip(copy.variables, model.variables, strict=True):
        a.assign(b)
    return copy


def refusal(build) -> str:
    """The message of the ValueError `build()` raises, asserted to be one line."""
    with pytest.raises(ValueError) as raised:
        build()
    message = str(raised.value)
    assert "\n" not in message, message
    return message
