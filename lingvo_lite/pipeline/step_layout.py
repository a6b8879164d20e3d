"""One step's layout from PipeliningLayer params: replicas, micro-batches and the schedule.

The one resolver of T, devices and the per-replica batch: the pipeline itself
(`PipeliningLayer.num_micro_batches_for`), the model analysis, the planner, the layer
profiler and the step profiler all read a step through it, so they cannot disagree.

- The mini-batch (`global_batch_size`, what `input_shapes` describes) splits into
  `num_replicas` equal shards, one per data-parallel replica (`replica_batch_size`).
- Each replica's shard splits into T micro-batches (`num_micro_batches`, from
  `num_micro_batches` and/or `micro_batch_size`, `micro_batch.resolve_num_micro_batches`).
- The schedule (`p.schedule`, a name or a Schedule object) places the cells on the devices of
  a replica (`cell_devices`, `num_devices`) and orders their work.

>>> from lingvo_lite.pipeline.pipelining_layer import PipeliningLayer
>>> p = PipeliningLayer.Params().Set(num_cells=4, num_replicas=2, micro_batch_size=4,
...                                  schedule="zbv")
>>> layout = resolve(p, global_batch_size=16)
>>> layout.replica_batch_size, layout.num_micro_batches, layout.micro_batch_size
(8, 2, 4)
>>> layout.cell_devices, layout.num_devices
((0, 1, 1, 0), 2)
"""

from __future__ import annotations

import dataclasses

from lingvo_lite.core import base_layer, hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.pipeline import micro_batch
from lingvo_lite.pipeline.schedules import schedule as schedule_lib

__all__ = ["StepLayout", "global_batch_size", "num_micro_batches", "placement_schedule",
           "replica_batch_size", "resolve"]


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """How one training step of a PipeliningLayer runs (see the module docstring)."""

    num_replicas: int  # R: data-parallel replicas of the pipeline.
    replica_batch_size: int  # Examples of one replica per step.
    num_micro_batches: int  # T: micro-batches of one replica.
    schedule: schedule_lib.Schedule  # Built for the cells and T; places the cells.

    @property
    def micro_batch_size(self) -> int:
        return self.replica_batch_size // self.num_micro_batches

    @property
    def global_batch_size(self) -> int:
        return self.num_replicas * self.replica_batch_size

    @property
    def num_cells(self) -> int:
        return self.schedule.num_cells

    @property
    def cell_devices(self) -> tuple[int, ...]:
        """`cell_devices[k]`: the device (within a replica) of cell k."""
        return self.schedule.cell_devices

    @property
    def num_devices(self) -> int:
        """Devices of one replica."""
        return self.schedule.num_devices

    @property
    def total_devices(self) -> int:
        """Devices of all replicas."""
        return self.num_replicas * self.num_devices


def replica_batch_size(global_batch: int, num_replicas: int) -> int:
    """The examples each of `num_replicas` replicas gets from a mini-batch of `global_batch`.

    >>> replica_batch_size(16, 2)
    8
    """
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas!r} must be an int >= 1.")
    if global_batch % num_replicas:
        raise ValueError(f"The mini-batch of {global_batch} examples does not split into "
                         f"num_replicas={num_replicas} equal shards; make the batch size a "
                         "multiple of it.")
    return global_batch // num_replicas


def num_micro_batches(p: hyperparams.Params, replica_batch: int) -> int:
    """T for one replica's shard of `replica_batch` examples (`p.num_micro_batches` and/or
    `p.micro_batch_size`)."""
    return micro_batch.resolve_num_micro_batches(replica_batch, p.num_micro_batches,
                                                 p.micro_batch_size)


def placement_schedule(p: hyperparams.Params,
                       num_cells: int | None = None) -> schedule_lib.Schedule:
    """A schedule of `p.schedule` for `num_cells` cells (default `p.num_cells`) at any T: what
    places the cells (`cell_devices`, `num_devices`) before the batch is known. A schedule
    must place cells the same way for every T."""
    num_cells = p.num_cells if num_cells is None else num_cells
    spec = p.schedule
    return schedule_lib.schedule_for(spec, num_cells,
                                     getattr(spec, "num_micro_batches", num_cells),
                                     p.virtual_stages)


def global_batch_size(p: hyperparams.Params) -> int | None:
    """The mini-batch size `p.input_shapes` describes (batch dimension `p.batch_dim` of its
    first batched leaf); None when it is not known."""
    shapes = p.input_shapes
    if shapes is None:
        return None
    shapes = base_layer.to_shape(shapes)
    for shape in shapes.Flatten() if isinstance(shapes, NestedMap) else [shapes]:
        if shape.rank is not None and shape.rank > p.batch_dim \
                and shape[p.batch_dim] is not None:
            return int(shape[p.batch_dim])
    return None


def resolve(p: hyperparams.Params, global_batch_size: int,
            num_cells: int | None = None) -> StepLayout:
    """The layout of a step of PipeliningLayer params `p` on a mini-batch of
    `global_batch_size` examples; `num_cells`: the cells the partition made (default
    `p.num_cells`). Raises ValueError when the batch does not split so."""
    replica_batch = replica_batch_size(global_batch_size, p.num_replicas)
    t = num_micro_batches(p, replica_batch)
    cells = p.num_cells if num_cells is None else num_cells
    sched = schedule_lib.schedule_for(p.schedule, cells, t, p.virtual_stages)
    return StepLayout(num_replicas=p.num_replicas, replica_batch_size=replica_batch,
                      num_micro_batches=t, schedule=sched)
