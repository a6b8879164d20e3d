"""Per-call state that stateless layers read: mode, randomness, side updates.

`FProp(theta, ...)` stays a pure function of its arguments plus this context:
- `training`: batch norm uses batch statistics and dropout is active.
- `step_seed` and `example_offset`: dropout derives each example's mask from the
  step's seed and the example's position in the *whole* mini-batch, so a
  pipeline that splits the batch into micro-batches (and recomputes forwards)
  draws exactly the masks the unsplit model draws.
- `batch_dim`: the axis of the examples in the tensors layers see (0 for
  [batch, ...], 1 for time-major [time, batch, ...]); random layers index their
  draws by (example, position in the example) along it. A PipeliningLayer sets
  it to its own `batch_dim`; a layer that changes the layout of its children's
  inputs should open a context with theirs.
- `updates`: an `UpdateCollector` that layers with non-gradient state (batch
  norm's moving statistics) report to; the caller applies the pooled updates
  once per mini-batch. `None` during recomputation, so nothing is counted twice.
- `jit_compile`: the pipeline's cells are compiled with XLA. Random layers whose
  draws differ between XLA and TensorFlow's kernels then draw with XLA's, also
  in a forward the pipeline runs uncompiled, as a plain model compiled with XLA
  draws all of its values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from lingvo_lite.core import colocation

__all__ = ["applying_side_updates", "current", "fprop_context", "FPropContext",
           "UpdateCollector"]


class UpdateCollector:
    """Gathers per-call statistics from layers, keyed by layer, in call order."""

    def __init__(self) -> None:
        self._stats: dict[int, tuple[Any, list[Any]]] = {}

    def add(self, layer: Any, stats: Any) -> None:
        self._stats.setdefault(id(layer), (layer, []))[1].append(stats)

    def replace(self, layer: Any, stats_list: list[Any]) -> None:
        """Replaces what `layer` reported (e.g. by statistics pooled over processes)."""
        self._stats[id(layer)] = (layer, list(stats_list))

    def __len__(self) -> int:
        return len(self._stats)

    def items(self) -> list[tuple[Any, list[Any]]]:
        return list(self._stats.values())

    def apply(self) -> list[tf.Operation]:
        """Calls `layer.ApplyUpdates(stats_list)` for every reporting layer."""
        ops = []
        for layer, stats in self._stats.values():
            with _beside_variables_of(layer):
                ops.append(layer.ApplyUpdates(stats))
        return ops


def _beside_variables_of(layer: Any) -> contextlib.AbstractContextManager:
    variables = getattr(layer, "variables", ())
    return colocation.colocated(variables[0]) if variables else contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class FPropContext:
    training: bool = False
    step_seed: Any = 0
    example_offset: Any = 0
    batch_dim: int = 0
    updates: UpdateCollector | None = None
    jit_compile: bool = False


_local = threading.local()


def current() -> FPropContext:
    """The innermost active context (inference defaults when none is active)."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else FPropContext()


@contextlib.contextmanager
def fprop_context(**overrides: Any) -> Iterator[FPropContext]:
    """Activates a context that inherits unspecified fields from the current one."""
    ctx = dataclasses.replace(current(), **overrides)
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(ctx)
    try:
        yield ctx
    finally:
        stack.pop()


def applying_side_updates(step: Callable[[], Any]) -> Any:
    """Runs `step`; if the caller collects no side updates, pools and applies them here.

    With an `UpdateCollector` in the current fprop_context the caller applies the updates
    (BaseTask.TrainStep does, for the steps it applies); without one they would be silently
    lost, so they are applied once `step` is built.
    """
    if current().updates is not None:
        return step()
    collector = UpdateCollector()
    with fprop_context(updates=collector):
        result = step()
    collector.apply()
    return result
