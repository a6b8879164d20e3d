"""Helpers shared by the reliability tests (reliability_test.py, reliability_inputs_test.py)."""

from __future__ import annotations

import io
import os
import re
import subprocess

import numpy as np
import reliability_models  # noqa: F401 (registers reliability_models.*)
import tensorflow as tf
import testdata_models  # noqa: F401 (registers testdata_models.*)
from conftest import launch_trainer
from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator

from lingvo_lite.training import checkpointer, options, runner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "testdata_models.TinyMlp"
NOISY = "reliability_models.TinyMlpNoisy"
CLI_NOISY = "tests.reliability_models.TinyMlpNoisy"


def _main(**kwargs) -> tuple[int, str, str]:
    """runner.main in-process; returns (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    status = runner.main(options.RunOptions(**kwargs), out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def _launch(*args: str, stderr=subprocess.PIPE, extra_env: dict | None = None
            ) -> subprocess.Popen:
    return launch_trainer(*args, stderr=stderr, env=extra_env)


def _ckpt_dir(logdir: str) -> str:
    return os.path.join(logdir, "checkpoints")


def _state_latest(logdir: str) -> str:
    return tf.train.latest_checkpoint(_ckpt_dir(logdir))


def _ckpt(logdir: str, step: int) -> str:
    return os.path.join(_ckpt_dir(logdir), f"ckpt-{step}")


def _ckpt_values(path: str) -> dict[str, np.ndarray]:
    """Every variable of a checkpoint (weights, slots, steps, counters) but the save counter."""
    return {name: tf.train.load_variable(path, name) for name, _ in tf.train.list_variables(path)
            if name.endswith("VARIABLE_VALUE") and "save_counter" not in name}


def _step_of(path: str) -> int:
    return int(tf.train.load_variable(path, checkpointer.GLOBAL_STEP_KEY))


def _assert_bit_identical(test: tf.test.TestCase, a: dict, b: dict, skip: str = "") -> None:
    keys = [k for k in a if not (skip and re.search(skip, k))]
    test.assertEqual(sorted(keys), sorted(k for k in b if not (skip and re.search(skip, k))))
    for k in keys:
        test.assertEqual(a[k].dtype, b[k].dtype, k)
        test.assertEqual(np.asarray(a[k]).tobytes(), np.asarray(b[k]).tobytes(), k)


def _scalars(event_dir: str) -> dict[str, dict[int, float]]:
    """tag -> {step: value} read with TensorBoard's own event reader."""
    acc = event_accumulator.EventAccumulator(
        event_dir, size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    return {tag: {e.step: float(tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
            for tag in acc.Tags()["tensors"]
            if acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"}


def _scalar_events(event_dir: str) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard's server loads them (restart handling included)."""
    acc = plugin_event_accumulator.EventAccumulator(
        event_dir, size_guidance={plugin_event_accumulator.TENSORS: 0})
    acc.Reload()
    return {tag: [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]
            if acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"}


def _flip_byte(path: str, offset_fraction: float = 0.5) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        i = int(len(data) * offset_fraction)
        data[i] ^= 0xFF
        f.seek(0)
        f.write(bytes(data))


def _truncate(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def _data_file(prefix: str) -> str:
    return prefix + ".data-00000-of-00001"


def _train_overrides(**values) -> str:
    return "; ".join(f"train.{k} : {v}" for k, v in values.items())


# ---------------------------------------------------------------------------------------------
# 1. Exact resume after SIGKILL (+ 3. a live trainer's logdir refuses a second one; its stale
#    lock does not block the resume).
