"""PipelinedTask: a task whose whole network is one PipeliningLayer.

The network's last layer computes the loss per micro-batch, so training hands
the mini-batch to `PipeliningLayer.FPropAndGrads` (micro-batching,
recomputation, per-cell backward on each cell's device) instead of a plain
GradientTape. Eval runs the same cells forward only.
"""

from __future__ import annotations

from lingvo_lite.core import hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.pipeline import pipelining_layer
from lingvo_lite.tasks import base_task

__all__ = ["PipelinedTask"]


class PipelinedTask(base_task.BaseTask):
    """A BaseTask with `p.network`, a PipeliningLayer that ends with a loss layer."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("network", pipelining_layer.PipeliningLayer.Params(),
                 "The pipelined network; its last layer returns NestedMap(loss, metrics...).")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        self.CreateChild("network", self.params.network)

    def NetworkInputs(self, input_batch: NestedMap) -> NestedMap:
        """The NestedMap fed to the first cell; override to select or rename fields."""
        return input_batch

    def FProp(self, theta: NestedMap, input_batch: NestedMap) -> NestedMap:
        out = self.network.FProp(theta.network, self.NetworkInputs(input_batch))
        return base_task.scalar_outputs(out)

    def ComputeLossAndGrads(
        self, theta: NestedMap, input_batch: NestedMap
    ) -> tuple[NestedMap, NestedMap]:
        out, grads = self.network.FPropAndGrads(theta.network, self.NetworkInputs(input_batch))
        return base_task.scalar_outputs(out), NestedMap(network=grads)

    def replica_thetas(self) -> list[NestedMap]:
        return [NestedMap(network=t) for t in self.network.replica_thetas(self.theta.network)]

    def replica_variable_pairs(self) -> list:
        return self.network.replica_variable_pairs()

    def ComputeReplicaLossAndGrads(
        self, thetas: list[NestedMap], input_batch: NestedMap
    ) -> tuple[NestedMap, list[NestedMap]]:
        out, grads = self.network.FPropAndReplicaGrads(
            [t.network for t in thetas], self.NetworkInputs(input_batch))
        return base_task.scalar_outputs(out), [NestedMap(network=g) for g in grads]
