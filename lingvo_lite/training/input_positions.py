"""Each task's input position in a multi-client run, saved beside the chief's checkpoints.

In multi-client mode every task reads its own shard of the input, so every task has its own
`tf.data` iterator to resume. The chief's checkpoint holds the weights, optimizer slots and
global step; task i saves its iterator at the same steps into

    <logdir>/input_positions/<N>_tasks/task_<i>/checkpoints/ckpt-<step>

(N in the path: a position only fits the shard it was read from). At restore, a task takes
its position at the chief's step. When that one is missing (the chief saved at a SIGTERM the
task never saw, a task was killed between the two saves, the number of tasks changed), it
takes the newest older one, or the input's beginning, and skips the batches in between: the
input is deterministic (seeded shuffle, stateless preprocessing), so the resumed run still
sees exactly the batches of an uninterrupted one.

Example (one task of two, after its iterator was built and the weights restored at `step`):

    positions = InputPositions(logdir, num_tasks=2, task_index=1, iterator=it, max_to_keep=3)
    skip = positions.restore(step)       # batches to draw and drop before training
    ...
    positions.save(step)                 # at each checkpoint step
"""

from __future__ import annotations

import os
import re

import tensorflow as tf

__all__: list[str] = []

SUBDIR = "input_positions"
_CKPT_RE = re.compile(r"^ckpt-(\d+)\.index$")


def positions_dir(logdir: str, num_tasks: int, task_index: int) -> str:
    return os.path.join(logdir, SUBDIR, f"{num_tasks}_tasks", f"task_{task_index}")


class InputPositions:
    """Saves and restores one task's input iterator, keyed by global step."""

    def __init__(self, logdir: str, num_tasks: int, task_index: int, iterator: object,
                 max_to_keep: int = 5) -> None:
        self.directory = os.path.join(positions_dir(logdir, num_tasks, task_index),
                                      "checkpoints")
        self._checkpoint = tf.train.Checkpoint(iterator=iterator)
        self._max_to_keep = max_to_keep
        self._manager: tf.train.CheckpointManager | None = None

    def saved_steps(self) -> list[int]:
        """Steps with a complete saved position (TensorFlow writes the .index last), newest
        first."""
        if not os.path.isdir(self.directory):
            return []
        steps = [int(m.group(1)) for m in map(_CKPT_RE.match, os.listdir(self.directory)) if m]
        return sorted(steps, reverse=True)

    def restore(self, step: int) -> int:
        """Restores the newest position at or before `step`; returns the batches to skip
        (0 when the position of `step` itself was restored)."""
        for saved in self.saved_steps():
            if saved > step:
                continue
            try:
                self._checkpoint.restore(os.path.join(self.directory, f"ckpt-{saved}"))
            except (tf.errors.OpError, ValueError, AssertionError):
                continue  # A damaged position: an older one (or the beginning) will do.
            return step - saved
        return step

    def save(self, step: int) -> None:
        if self._manager is None:  # Created lazily: setup writes nothing.
            self._manager = tf.train.CheckpointManager(
                self._checkpoint, self.directory, max_to_keep=self._max_to_keep,
                checkpoint_name="ckpt")
        if step not in self.saved_steps():
            self._manager.save(checkpoint_number=step)
