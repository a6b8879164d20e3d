"""Which device runs pipeline cell k: the `placement` param of a PipeliningLayer, resolved.

Model code never names devices. A placement (a string such as 'cpu' or
'cluster:worker', or a list of device names) maps cell indices to devices of one
backend: logical CPU devices (what tests and this machine use), GPUs, TPU cores, or
the hosts of a TF cluster; `resolve_mesh` extends it to R data-parallel replicas.
The pipeline creates cell k's variables on `devices[k]` and runs its forward,
recomputation and backward there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import tensorflow as tf

__all__ = [
    "choose_path",
    "cluster_devices",
    "describe_mesh",
    "DEVICES_PATH",
    "resolve_devices",
    "resolve_mesh",
    "TPU_STRATEGY_PATH",
    "visible_device_counts",
]

PLACEMENTS = ("auto", "cpu", "gpu", "tpu", "cluster")
# How a PipeliningLayer places its cells (see choose_path).
DEVICES_PATH = "devices"
TPU_STRATEGY_PATH = "tpu_strategy"


def choose_path(placement: str | Sequence[str], num_replicas: int, num_cells: int,
                device_counts: Mapping[str, int], tpu_strategy_active: bool) -> str:
    """How a pipeline of R replicas of K cells is placed: DEVICES_PATH or TPU_STRATEGY_PATH.

    DEVICES_PATH: the layer itself places cell k of replica r on device `mesh[r][k]`
    (`resolve_mesh`) and sums the replicas' gradients with collective all-reduces; it
    covers CPUs, GPUs, TF clusters and TPU cores visible to this process.
    TPU_STRATEGY_PATH: inside a `tf.distribute.TPUStrategy`, the strategy replicates
    (the layer has one replica per strategy replica) and cell k goes on the strategy's
    logical core k of every replica.

    Args:
      placement: the layer's `placement` param.
      num_replicas: the layer's `num_replicas` param (R).
      num_cells: K.
      device_counts: visible logical devices per type, e.g. {'CPU': 8, 'TPU': 0}.
      tpu_strategy_active: whether the layer is built inside a TPUStrategy.

    Raises:
      ValueError: a placement that contradicts the active strategy, R > 1 inside a
        TPUStrategy, or placement 'tpu' with neither a TPUStrategy nor enough TPU cores.
    """
    kind = placement.partition(":")[0] if isinstance(placement, str) else None
    if tpu_strategy_active:
        if kind not in ("tpu", "auto"):
            shown = placement if kind else "a list of devices"
            raise ValueError(
                f"placement={shown!r} inside a TPUStrategy: the strategy places the cells on "
                "its TPU cores; use placement='tpu' (or 'auto'), or build the model outside "
                "strategy.scope().")
        if num_replicas != 1:
            raise ValueError(
                f"num_replicas={num_replicas} inside a TPUStrategy: the strategy replicates the "
                "pipeline (its num_replicas_in_sync); set num_replicas=1 in the layer and give "
                "the replicas to the strategy (tpu.create_tpu_strategy(num_replicas, "
                "num_cells)).")
        return TPU_STRATEGY_PATH
    if kind == "tpu" and device_counts.get("TPU", 0) < num_replicas * num_cells:
        raise ValueError(
            f"placement='tpu': the pipeline needs num_replicas x num_cells = "
            f"{num_replicas * num_cells} TPU cores but {device_counts.get('TPU', 0)} are "
            "visible and no TPUStrategy is active. Build the model under the scope of "
            "lingvo_lite.distributed.tpu.create_tpu_strategy(num_replicas, num_cells, tpu=<name>) "
            "(trainer.py --tpu=<name>), or use placement 'cpu' or 'gpu'.")
    return DEVICES_PATH


def visible_device_counts() -> dict[str, int]:
    """Logical devices of this process (and connected cluster) per type."""
    counts: dict[str, int] = {}
    for d in tf.config.list_logical_devices():
        counts[d.device_type] = counts.get(d.device_type, 0) + 1
    return counts


def _local_devices(device_type: str) -> list[str]:
    return [d.name for d in tf.config.list_logical_devices(device_type)]


def _require(devices: list[str], num_cells: int, kind: str, fix: str,
             what: str = "cells") -> list[str]:
    if len(devices) < num_cells:
        raise ValueError(
            f"placement={kind!r}: the pipeline needs {num_cells} {what} but only "
            f"{len(devices)} {kind} device(s) exist. {fix}"
        )
    return devices[:num_cells]


def cluster_devices(num_devices: int, job: str = "worker") -> list[str]:
    """The first `num_devices` devices of a connected TF cluster job, task by task.

    Each task's accelerators when it has any, else its (logical) CPUs, in (task, index) order;
    so with D devices per task, device i is device i % D of task i // D.
    """
    found: dict[str, list[tf.DeviceSpec]] = {"GPU": [], "TPU": [], "CPU": []}
    for d in tf.config.list_logical_devices():
        spec = tf.DeviceSpec.from_string(d.name)
        if spec.job == job and spec.device_type in found:
            found[spec.device_type].append(spec)
    tasks = sorted({s.task for specs in found.values() for s in specs})
    devices = []
    for task in tasks:
        for device_type in ("GPU", "TPU", "CPU"):
            mine = sorted((s for s in found[device_type] if s.task == task),
                          key=lambda s: s.device_index)
            if mine:
                devices += [s.to_string() for s in mine]
                break
    if len(devices) < num_devices:
        raise ValueError(
            f"placement='cluster:{job}' needs {num_devices} devices but the connected cluster "
            f"offers {len(devices)} in job '{job}'. Connect first (trainer.py does it from "
            "TF_CONFIG; tf.config.experimental_connect_to_cluster otherwise) and give the tasks "
            "enough devices.")
    return devices[:num_devices]


def resolve_mesh(placement: str | Sequence[str], num_replicas: int,
                 devices_per_replica: int) -> list[list[str]]:
    """Device d of replica r, as `mesh[r][d]`: R x D distinct devices.

    D is the pipeline's device count, `num_cells / virtual_stages` (K without interleaving).
    Replica-major: with local devices 0..R*D-1, replica r holds devices r*D .. r*D+D-1, so
    each replica's cells are neighbours (on GPUs, the boundary copies stay within a group of
    adjacent cards; in a cluster, replica r's cells on consecutive tasks).
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas}; a mesh needs at least one replica.")
    flat = resolve_devices(placement, num_replicas * devices_per_replica,
                           what="devices (num_replicas x num_cells / virtual_stages)")
    return [flat[r * devices_per_replica:(r + 1) * devices_per_replica]
            for r in range(num_replicas)]


def describe_mesh(mesh: Sequence[Sequence[str]]) -> str:
    """One line per replica: `replica r: cell 0 -> device, cell 1 -> device, ...`."""
    return "\n".join(
        f"replica {r}: " + ", ".join(f"cell {k} -> {d}" for k, d in enumerate(row))
        for r, row in enumerate(mesh))


def resolve_devices(placement: str | Sequence[str], num_cells: int,
                    what: str = "cells") -> list[str]:
    """The device of each cell.

    Args:
      placement: 'auto' (GPUs if there are enough, else TPU cores, else logical
        CPUs), 'cpu', 'gpu', 'tpu', 'cluster' or 'cluster:<job>' (task k of the
        job, connect to the cluster first), or an explicit list of device names.
      num_cells: K, the number of devices wanted.
      what: how the devices are named in errors.
    """
    if not isinstance(placement, str):
        devices = list(placement)
        if len(devices) != num_cells:
            raise ValueError(
                f"placement lists {len(devices)} devices for {num_cells} {what}; "
                "give exactly one device per cell of each replica."
            )
        return devices
    kind, _, job = placement.partition(":")
    cpu_fix = (
        "Create logical CPU devices before TensorFlow starts: "
        "lingvo_lite.core.devices.configure_logical_cpus(R x K), or trainer.py "
        "--num_logical_cpus=R x K."
    )
    if kind == "auto":
        for device_type in ("GPU", "TPU"):
            devices = _local_devices(device_type)
            if len(devices) >= num_cells and devices:
                return devices[:num_cells]
        return _require(_local_devices("CPU"), num_cells, "cpu", cpu_fix, what)
    if kind == "cpu":
        return _require(_local_devices("CPU"), num_cells, "cpu", cpu_fix, what)
    if kind == "gpu":
        return _require(_local_devices("GPU"), num_cells, "gpu",
                        "Use fewer cells (num_cells) or replicas (num_replicas), or "
                        "placement='cpu'.", what)
    if kind == "tpu":
        return _require(_local_devices("TPU"), num_cells, "tpu",
                        "Connect to the TPU (tf.distribute.TPUStrategy) or use fewer cells.",
                        what)
    if kind == "cluster":
        return cluster_devices(num_cells, job=job or "worker")
    raise ValueError(
        f"Unknown placement {placement!r}; use one of {PLACEMENTS} or a list of device names."
    )
