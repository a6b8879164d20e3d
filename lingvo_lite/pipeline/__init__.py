"""GPipe for lingvo-lite layers: partition, placement, micro-batches, schedules, recomputation.

The runtime: what a training step needs. `PipeliningLayer` is the entry point (see its
docstring for a complete example); schedules are data (`make_schedule`, `CustomSchedule`,
`parse_orders`) and own the cell-to-device mapping. Prediction and observation (the
simulator, the memory model, trace analysis, charts, advice) live in `lingvo_lite.analysis`,
which this package never imports.

>>> from lingvo_lite import pipeline
>>> print(pipeline.make_schedule("gpipe", 2, 3).format_orders())
device 0: F0 F1 F2 B2 B1 B0
device 1: F0 F1 F2 B2 B1 B0

Imported on first use, like the names of `lingvo_lite`.
"""

from lingvo_lite.core import _lazy

_EXPORTS = {
    "PipeliningLayer": "lingvo_lite.pipeline.pipelining_layer",
    "Schedule": "lingvo_lite.pipeline.schedules.schedule",
    "SCHEDULES": "lingvo_lite.pipeline.schedules.schedule",
    "make_schedule": "lingvo_lite.pipeline.schedules.schedule",
    "CustomSchedule": "lingvo_lite.pipeline.schedules.custom_schedule",
    "parse_orders": "lingvo_lite.pipeline.schedules.custom_schedule",
    "Partition": "lingvo_lite.pipeline.partition.partition",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = _lazy.exporter(__name__, _EXPORTS, globals())
