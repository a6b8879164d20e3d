"""Cutting a layer stack into K cells of balanced cost: `partition` (the partitioner over
FPropMeta's FLOPs or measured costs) and `layer_profile` (each layer's measured forward and
backward time, for partition_cost='measured').

>>> from lingvo_lite.pipeline import partition
>>> partition.partition_min_max([1.0, 1.0, 1.0, 1.0], 2)
[2, 2]

Imported on first use, like the names of `lingvo_lite`.
"""

from lingvo_lite.core import _lazy

_EXPORTS = {
    "Partition": "lingvo_lite.pipeline.partition.partition",
    "make_partition": "lingvo_lite.pipeline.partition.partition",
    "partition_min_max": "lingvo_lite.pipeline.partition.partition",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = _lazy.exporter(__name__, _EXPORTS, globals())
