"""The TPU mesh: which core of a TPU slice runs cell k of data-parallel replica r.

On TPUs a pipeline of K cells with R data-parallel replicas runs under
`tf.distribute.TPUStrategy` with a device assignment of K cores per replica: the
strategy replicates the training step R times, and inside each replica cell k
runs on the replica's logical core k (`strategy.extended.experimental_logical_device(k)`).
The K cores of a replica form one compact block of the slice: the cores of one
chip first, then neighbouring chips along x, y and z, ordered so that cell k and
cell k+1 are on the same chip or on adjacent chips.

Everything here except `create_tpu_strategy` works without a TPU, on a mock
topology. For example, a v3-8-like slice (2 x 2 chips of 2 cores, one host) with
R = 2 replicas of K = 4 cells:

>>> import numpy as np
>>> import tensorflow as tf
>>> from lingvo_lite.distributed import placement, tpu
>>> coordinates = np.array([[[x, y, 0, core] for y in range(2) for x in range(2)
...                          for core in range(2)]], dtype=np.int32)
>>> topology = tf.tpu.experimental.Topology(
...     mesh_shape=[2, 2, 1, 2], device_coordinates=coordinates)
>>> tpu.computation_shape(topology.mesh_shape, num_cells=4)
[2, 1, 1, 2]
>>> assignment = tpu.device_assignment(topology, num_replicas=2, num_cells=4)
>>> print(placement.describe_mesh(tpu.tpu_mesh(assignment, job="worker")))
... # doctest: +NORMALIZE_WHITESPACE
replica 0: cell 0 -> /job:worker/task:0/device:TPU:0, cell 1 -> /job:worker/task:0/device:TPU:1,
  cell 2 -> /job:worker/task:0/device:TPU:3, cell 3 -> /job:worker/task:0/device:TPU:2
replica 1: cell 0 -> /job:worker/task:0/device:TPU:4, cell 1 -> /job:worker/task:0/device:TPU:5,
  cell 2 -> /job:worker/task:0/device:TPU:7, cell 3 -> /job:worker/task:0/device:TPU:6

(Replica 0 holds chips (0, 0) and (1, 0): TPU:0 and TPU:1 are chip (0, 0)'s cores,
TPU:3 and TPU:2 chip (1, 0)'s, in the order that keeps the hop from cell 1 to cell 2
on one link.)
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_lite.core.colocation import (
    colocated,
    current_tpu_strategy,
    logical_core_of,
    strategy_mesh,
)

__all__ = [
    "cell_scope",
    "chain_order",
    "colocated",
    "computation_shape",
    "create_tpu_strategy",
    "current_tpu_strategy",
    "device_assignment",
    "logical_core_of",
    "logical_cores_per_replica",
    "strategy_mesh",
    "tpu_mesh",
]


def _describe_slice(mesh_shape: Sequence[int]) -> str:
    cores = int(np.prod(mesh_shape))
    chips = int(np.prod(mesh_shape[:-1]))
    return (f"a TPU slice of mesh shape {list(mesh_shape)} ({cores} cores: {chips} chips x "
            f"{mesh_shape[-1]} cores)")


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1.")


def _block_shapes(mesh_shape: Sequence[int], num_cores: int) -> list[list[int]]:
    """Every block [x, y, z, cores] of `num_cores` cores that fits in the mesh."""
    ranges = [[d for d in range(1, size + 1) if num_cores % d == 0] for size in mesh_shape]
    return [list(shape) for shape in itertools.product(*ranges)
            if int(np.prod(shape)) == num_cores]


def computation_shape(mesh_shape: Sequence[int], num_cells: int) -> list[int]:
    """The block of K = `num_cells` cores one replica uses: [x, y, z, cores_per_chip].

    Among the blocks of K cores that fit in `mesh_shape`, the one that uses the most
    cores of each chip, then spans x before y before z: a replica's cells share chips
    where they can and otherwise sit on a line of neighbouring chips.

    Raises:
      ValueError: no block of K cores fits (the message lists the K that do).
    """
    _check_positive("num_cells", num_cells)
    mesh_shape = [int(d) for d in mesh_shape]
    shapes = _block_shapes(mesh_shape, num_cells)
    if not shapes:
        fitting = [k for k in range(1, int(np.prod(mesh_shape)) + 1)
                   if _block_shapes(mesh_shape, k)]
        raise ValueError(
            f"num_cells={num_cells} cannot be laid out on {_describe_slice(mesh_shape)}: a "
            f"replica's cells need a block of x * y * z * cores = {num_cells} cores that fits "
            f"the mesh. num_cells that fit: {', '.join(map(str, fitting))}.")
    # Preference: cores of a chip (last axis) first, then x, y, z.
    return max(shapes, key=lambda s: [s[-1], *s[:-1]])


def chain_order(block: Sequence[int]) -> list[tuple[int, ...]]:
    """The offsets of the cores of a block, in pipeline order: each a neighbour of the last.

    Cores of one chip come first, then x, y and z, every pass reversing the previous one
    (a snake), so consecutive cells differ by one step along one axis.
    """
    rank = len(block)
    path = [[0] * rank]
    for axis in [rank - 1, *range(rank - 1)]:
        longer = []
        for i in range(block[axis]):
            for offsets in (path if i % 2 == 0 else path[::-1]):
                step = list(offsets)
                step[axis] = i
                longer.append(step)
        path = longer
    return [tuple(o) for o in path]


def device_assignment(topology: tf.tpu.experimental.Topology, num_replicas: int,
                      num_cells: int) -> tf.tpu.experimental.DeviceAssignment:
    """R replicas of K cores each: logical core k of replica r runs cell k.

    `DeviceAssignment.build` chooses each replica's block of cores
    (`computation_shape`); within a block the logical cores are put in
    `chain_order`, so that the activations cell k sends to cell k+1 stay on a chip
    or cross one chip-to-chip link.

    Raises:
      ValueError: naming num_replicas / num_cells, when R x K cores do not fit.
    """
    _check_positive("num_replicas", num_replicas)
    mesh_shape = [int(d) for d in topology.mesh_shape]
    shape = computation_shape(mesh_shape, num_cells)
    num_cores = int(np.prod(mesh_shape))
    if num_replicas * num_cells > num_cores:
        raise ValueError(
            f"num_replicas={num_replicas} x num_cells={num_cells} = "
            f"{num_replicas * num_cells} cores, but the TPU topology has only {num_cores} "
            f"(mesh shape {mesh_shape}); use num_replicas <= {num_cores // num_cells} or "
            "fewer cells.")
    max_replicas = int(np.prod(np.array(mesh_shape) // np.array(shape)))
    if num_replicas > max_replicas:
        raise ValueError(
            f"num_replicas={num_replicas}: only {max_replicas} blocks of num_cells={num_cells} "
            f"cores (shape {shape}) fit on {_describe_slice(mesh_shape)}; use num_replicas <= "
            f"{max_replicas} or a num_cells that tiles the mesh.")
    built = tf.tpu.experimental.DeviceAssignment.build(
        topology, computation_shape=shape, num_replicas=num_replicas)
    cores = np.asarray(built.core_assignment)
    chain = np.array(chain_order(shape), dtype=np.int32)
    ordered = []
    for replica_cores in cores:
        origin = replica_cores.min(axis=0)
        block = origin + chain
        if {tuple(c) for c in replica_cores} != {tuple(c) for c in block}:
            return built  # Not a plain block (a slice with missing chips): keep TF's order.
        ordered.append(block)
    return tf.tpu.experimental.DeviceAssignment(topology, np.array(ordered, dtype=np.int32))


def tpu_mesh(assignment: tf.tpu.experimental.DeviceAssignment,
             job: str | None = None) -> list[list[str]]:
    """`mesh[r][k]`: the TPU device running cell k of replica r (see placement.describe_mesh)."""
    return [[assignment.tpu_device(replica=r, logical_core=k, job=job)
             for k in range(assignment.num_cores_per_replica)]
            for r in range(assignment.num_replicas)]


def create_tpu_strategy(num_replicas: int, num_cells: int,
                        tpu: str = "") -> tf.distribute.TPUStrategy:
    """Connects to the TPU `tpu` and returns a TPUStrategy of R replicas of K cores.

    Call it before any variable is created; build the model under `strategy.scope()`.

    Args:
      num_replicas: R, data-parallel replicas (the strategy's num_replicas_in_sync).
      num_cells: K, the pipeline's cells: cores per replica.
      tpu: the TPU's name or grpc:// address; 'local' on a TPU VM.

    Raises:
      ValueError: one line, when there is no TPU to connect to or R x K does not fit.
    """
    _check_positive("num_replicas", num_replicas)
    _check_positive("num_cells", num_cells)
    fix = ("pass the TPU's name or grpc:// address (trainer.py --tpu=<name>), or --tpu=local "
           "on a TPU VM; without a TPU use placement 'cpu' or 'gpu'.")
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        tf.config.experimental_connect_to_cluster(resolver)
        topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, tf.errors.OpError) as e:
        reason = " ".join(str(getattr(e, "message", e)).split()).split(". ")[0].rstrip(".")
        raise ValueError(f"Cannot connect to a TPU (tpu={tpu!r}: {reason}.); {fix}") from None
    assignment = device_assignment(topology, num_replicas, num_cells)
    return tf.distribute.TPUStrategy(resolver, experimental_device_assignment=assignment)


def logical_cores_per_replica(strategy: tf.distribute.Strategy, num_cells: int) -> int:
    """Checks that the strategy gives each replica `num_cells` logical cores; returns it."""
    try:
        with strategy.extended.experimental_logical_device(num_cells - 1):
            pass
    except ValueError:
        raise ValueError(
            f"num_cells={num_cells}, but the TPUStrategy's device assignment gives each replica "
            "fewer logical cores: build it with num_cells cores per replica "
            "(tpu.create_tpu_strategy(num_replicas, num_cells)).") from None
    return num_cells


@contextlib.contextmanager
def cell_scope(strategy: tf.distribute.Strategy, cell: int) -> Iterator[None]:
    """Where cell `cell`'s variables and ops go under a TPUStrategy: its logical core.

    While variables are created (in `strategy.scope()`), they get one copy on logical
    core `cell` of every replica; inside `strategy.run` the ops run on that core.
    """
    with strategy.extended.experimental_logical_device(cell):
        yield
