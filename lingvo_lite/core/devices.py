"""Device set-up: logical CPU devices that stand in for accelerators.

TensorFlow only lets the device list and the thread pools be configured before
the runtime starts, so these helpers must run before any op executes (a test
`conftest.py`, or the first lines of `trainer.py`).
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["configure_logical_cpus"]


def configure_logical_cpus(
    num_devices: int,
    intra_op_threads: int | None = None,
    inter_op_threads: int | None = None,
) -> list[str]:
    """Splits the physical CPU into `num_devices` logical devices.

    Logical devices share one inter-op thread pool; to see pipelining behave as
    on real accelerators set `intra_op_threads=1` and `inter_op_threads` to the
    number of cores. Calling it again with a number of devices that is already
    configured is a no-op, so library code may call it defensively.

    Returns:
      The device names, e.g. ['/device:CPU:0', '/device:CPU:1'].

    Raises:
      ValueError: `num_devices` < 1.
      RuntimeError: the runtime already started with fewer devices.
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}.")
    cpus = tf.config.list_physical_devices("CPU")
    current = tf.config.get_logical_device_configuration(cpus[0]) or []
    if len(current) < num_devices:
        try:
            tf.config.set_logical_device_configuration(
                cpus[0], [tf.config.LogicalDeviceConfiguration()] * num_devices
            )
        except RuntimeError as e:
            have = len(tf.config.list_logical_devices("CPU"))
            raise RuntimeError(
                f"Cannot create {num_devices} logical CPU devices: TensorFlow already started "
                f"with {have}. Configure devices before any TensorFlow op runs (e.g. call "
                "lingvo_lite.core.devices.configure_logical_cpus first, or pass "
                "--num_logical_cpus to trainer.py)."
            ) from e
    _set_threads(intra_op_threads, inter_op_threads)
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def _set_threads(intra_op_threads: int | None, inter_op_threads: int | None) -> None:
    """Sets thread-pool sizes, tolerating a repeat call with the same values."""
    for value, getter, setter in (
        (
            intra_op_threads,
            tf.config.threading.get_intra_op_parallelism_threads,
            tf.config.threading.set_intra_op_parallelism_threads,
        ),
        (
            inter_op_threads,
            tf.config.threading.get_inter_op_parallelism_threads,
            tf.config.threading.set_inter_op_parallelism_threads,
        ),
    ):
        if value is None or getter() == value:
            continue
        try:
            setter(value)
        except RuntimeError as e:
            raise RuntimeError(
                "Thread pools can only be sized before TensorFlow starts; "
                f"requested {value}, runtime has {getter()}."
            ) from e
