"""Where an op goes to sit beside a variable: its device, or under a TPUStrategy its core.

The optimizers, the task's weight updates and the layers' statistic updates need this, and they
sit below the pipeline package, so it lives here rather than in `distributed/tpu.py` (which
re-exports it).

Example:
    >>> import tensorflow as tf
    >>> v = tf.Variable(1.0)
    >>> with colocated(v):
    ...     w = v * 2.0
    >>> float(w)
    2.0
"""

from __future__ import annotations

from typing import Any, ContextManager

import tensorflow as tf

__all__ = ["colocated", "current_tpu_strategy", "logical_core_of", "strategy_mesh"]


def current_tpu_strategy() -> tf.distribute.Strategy | None:
    """The TPUStrategy whose scope (or replica function) we are in, else None."""
    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    tpu_strategies = (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy)
    return strategy if isinstance(strategy, tpu_strategies) else None


def strategy_mesh(strategy: tf.distribute.Strategy, num_cells: int) -> list[list[str]]:
    """`mesh[r][k]`: the device of logical core k of the strategy's replica r."""
    columns = []
    for k in range(num_cells):
        with strategy.extended.experimental_logical_device(k):
            columns.append(list(strategy.extended.worker_devices))
    return [list(row) for row in zip(*columns)]


def _num_logical_cores(strategy: tf.distribute.Strategy) -> int:
    count = 0
    while True:
        try:
            with strategy.extended.experimental_logical_device(count):
                pass
        except ValueError:
            return count
        count += 1


def logical_core_of(strategy: tf.distribute.Strategy, var: tf.Variable) -> int:
    """The logical core of every replica that holds `var` (0 when it is not on a core)."""
    components = getattr(var, "values", None) or (var,)
    device = tf.DeviceSpec.from_string(components[0].device)
    first_replica = strategy_mesh(strategy, _num_logical_cores(strategy))[0]
    for k, name in enumerate(first_replica):
        if _same_device(tf.DeviceSpec.from_string(name), device):
            return k
    return 0


def _same_device(a: tf.DeviceSpec, b: tf.DeviceSpec) -> bool:
    """Whether the fields given in both names agree ('/device:TPU:1' is '/job:w/.../TPU:1')."""
    fields = ("job", "replica", "task", "device_type", "device_index")
    return all(getattr(a, f) is None or getattr(b, f) is None or getattr(a, f) == getattr(b, f)
               for f in fields)


def colocated(var: tf.Variable) -> ContextManager[Any]:
    """Ops (and slot variables) beside `var`: its device, or under a TPUStrategy its core."""
    strategy = current_tpu_strategy()
    if strategy is None:
        return tf.device(var.device)
    return strategy.extended.experimental_logical_device(logical_core_of(strategy, var))
