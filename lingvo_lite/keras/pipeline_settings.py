"""How a Keras model is pipelined: the one record of the settings `PipelinedModel` (layer stacks
and functional models alike) and `pipeline_params` take, passed as keyword arguments.

>>> PipelineSettings.of({"num_cells": 2, "num_micro_batches": 4}).num_cells
2
>>> PipelineSettings.of({"num_cell": 2})
Traceback (most recent call last):
...
ValueError: unknown pipeline setting num_cell=2 (did you mean num_cells?); the settings are: \
num_cells, num_micro_batches, micro_batch_size, remat, schedule, placement, partition_method, \
split_points, serial_devices
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["PipelineSettings"]


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    """The `PipeliningLayer.Params()` fields a Keras model's pipeline is built with.

    num_cells: K, the cells the layers are partitioned into (one device each, by default).
    num_micro_batches: T, the micro-batches a mini-batch is split into (None: as
      micro_batch_size gives, else 1).
    micro_batch_size: the examples per micro-batch, instead of num_micro_batches.
    remat: which forwards the backward re-computes ('always', 'except_last', 'never').
    schedule: a schedule name (`lingvo_lite.pipeline.schedules`) or a Schedule object.
    placement: 'auto', or the devices of the cells.
    partition_method: how the layers are cut by cost ('min_max', 'min_variance', ...).
    split_points: the layer indices to cut at, instead of the cost-based partition.
    serial_devices: each device runs one op at a time, like an accelerator.
    """

    num_cells: int = 1
    num_micro_batches: int | None = None
    micro_batch_size: int | None = None
    remat: str = "except_last"
    schedule: Any = "gpipe"
    placement: Any = "auto"
    partition_method: str = "min_max"
    split_points: Sequence[int] | None = None
    serial_devices: bool = False

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> PipelineSettings:
        """The record of keyword arguments `settings`; an unknown name refused in one line."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key, value in settings.items():
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ValueError(f"unknown pipeline setting {key}={value!r}{hint}; the settings "
                                 f"are: {', '.join(names)}")
        return cls(**settings)

    def as_dict(self) -> dict[str, Any]:
        """The settings by name, as `PipeliningLayer.Params().Set(**...)` takes them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
