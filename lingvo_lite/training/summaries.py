"""TensorBoard event writers, one per sub-directory of the log directory.

Training writes under `<logdir>/train`, evaluation of split S under `<logdir>/eval_S`; TensorBoard
shows them as runs `train`, `eval_dev`, ... of `tensorboard --logdir <logdir>`. Writers are created
on first use, so a directory only appears when something is written to it.

A run resumed from the checkpoint of step S retrains steps the crashed run may already have
summarised. The trainer's writers therefore start with a `SessionLog.START` event at the first
step they train (S + 1; 1 for a fresh run). TensorBoard takes every START after a run's first one
for a restart and drops the events it read before with that step or a later one, so every curve
has one point per step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

import numpy as np
import tensorflow as tf
from tensorflow.core.util import event_pb2
from tensorflow.python.ops import summary_ops_v2

__all__: list[str] = []


def as_markdown_code(text: str) -> str:
    """Indents every line by four spaces: TensorBoard's text plugin then shows it verbatim."""
    return "\n".join("    " + line for line in text.splitlines())


class SummaryWriters:
    """Lazily created `tf.summary` file writers keyed by sub-directory name."""

    def __init__(self, logdir: str, first_step: int | None = None) -> None:
        self._logdir = logdir
        self._first_step = first_step  # Marks a (re)start there (see the module docstring).
        self._writers: dict[str, tf.summary.SummaryWriter] = {}

    def writer(self, subdir: str) -> tf.summary.SummaryWriter:
        if subdir not in self._writers:
            writer = tf.summary.create_file_writer(os.path.join(self._logdir, subdir))
            if self._first_step is not None:
                restart = event_pb2.Event(
                    wall_time=time.time(), step=self._first_step,
                    session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))
                with writer.as_default():
                    summary_ops_v2.import_event(tf.constant(restart.SerializeToString()))
            self._writers[subdir] = writer
        return self._writers[subdir]

    def scalars(self, subdir: str, step: int, values: Mapping[str, float]) -> None:
        """Writes every (tag, value) as a scalar summary at `step`."""
        with self.writer(subdir).as_default(step=step):
            for tag, value in values.items():
                tf.summary.scalar(tag, float(np.asarray(value)))

    def text(self, subdir: str, step: int, tag: str, text: str) -> None:
        """Writes preformatted text (e.g. the params) as a text summary."""
        with self.writer(subdir).as_default(step=step):
            tf.summary.text(tag, as_markdown_code(text))

    def flush(self) -> None:
        for w in self._writers.values():
            w.flush()

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
        self._writers.clear()
