"""Image classification with a pipelined AmoebaNet."""

from __future__ import annotations

from lingvo_lite import hyperparams, pipelined_task
from lingvo_lite.nested_map import NestedMap
from tasks.image import amoebanet

__all__ = ["amoebanet_task_params", "ImageClassifierTask"]


class ImageClassifierTask(pipelined_task.PipelinedTask):
    """Classifies `image` into `label`: the AmoebaNet layers, partitioned into cells."""

    def NetworkInputs(self, input_batch: NestedMap) -> NestedMap:
        return NestedMap(image=input_batch.image, label=input_batch.label)


def amoebanet_task_params(
    net: hyperparams.Params,
    batch_size: int,
    num_cells: int = 2,
    num_micro_batches: int = 1,
    name: str = "amoebanet",
) -> hyperparams.InstantiableParams:
    """Task params whose pipeline holds the AmoebaNet described by `net` (AmoebaNetParams)."""
    p = ImageClassifierTask.Params().Set(name=name)
    p.network.Set(
        layers=amoebanet.amoebanet_layers(net),
        input_shapes=amoebanet.input_shapes(net, batch_size),
        num_cells=num_cells,
        num_micro_batches=num_micro_batches,
    )
    return p
