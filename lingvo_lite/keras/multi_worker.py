"""`PipelinedModel.fit` in every task of a TF_CONFIG cluster, as with MultiWorkerMirroredStrategy.

Every task runs the same script: first (before any TensorFlow op, as the strategy must be
created first) `process_group.from_tf_config(num_logical_cpus=K)`, then it builds, compiles
and fits the same PipelinedModel on the same data with the same global `batch_size`. Each
task trains its part of every global batch (task i of N: examples [i*B/N, (i+1)*B/N)) on its
own K devices; the pipeline sums the gradients over the tasks with collective all-reduces and
combines the loss over the global batch, so every task applies the same update and ends
with the weights one process would reach on the whole batches. Metrics other than the loss
are computed on the task's part. Give every task the same data order (`shuffle=False`, or
the same `keras.utils.set_random_seed`), as the strategy also requires.

Example (save as train.py; run it once per task with its own TF_CONFIG):

    from lingvo_lite.distributed import process_group
    process_group.from_tf_config(num_logical_cpus=2)      # before any TF op
    import keras
    from lingvo_lite.keras import PipelinedModel
    model = PipelinedModel([keras.layers.Dense(32, activation="relu"),
                            keras.layers.Dense(10)], input_shape=(64,), num_cells=2)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False)   # the same in every task
"""

from __future__ import annotations

from typing import Any

from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.distributed import process_group
from lingvo_lite.pipeline import pipelining_layer

__all__ = ["local_part", "num_micro_batches", "pipelined_grads"]


def local_part(*tensors: Any) -> tuple[Any, ...]:
    """This task's part of each (global) batch tensor; the tensors themselves in one process."""
    group = process_group.current()
    if group is None:
        return tensors

    def part(t: Any) -> Any:
        if t is None:
            return None
        if isinstance(t, (dict, NestedMap)):
            return type(t)({k: part(v) for k, v in t.items()})
        size = t.shape[0]
        if size is None or size % group.num_processes:
            raise ValueError(
                f"PipelinedModel.fit in a cluster of {group.num_processes} tasks: a batch of "
                f"{size} examples does not split over the tasks; use a batch_size that is a "
                f"multiple of {group.num_processes} (and drop_remainder=True for a dataset).")
        local = size // group.num_processes
        return t[group.index * local:(group.index + 1) * local]

    return tuple(part(t) for t in tensors)


def num_micro_batches(pipe: pipelining_layer.PipeliningLayer, batch_size: int) -> float:
    """The micro-batches of the whole global batch (a 'sum' loss scales by it), given this
    task's part of `batch_size` examples."""
    group = process_group.current()
    tasks = 1 if group is None else group.num_processes
    return float(pipe.num_micro_batches_for(batch_size) * tasks)


def pipelined_grads(pipe: pipelining_layer.PipeliningLayer, inputs: NestedMap,
                    return_input_grads: bool) -> tuple[Any, ...]:
    """`FPropAndGrads`, or across a cluster `FPropAndReplicaGrads` (gradients summed over the
    tasks); a leading Embedding's input gradient cannot be summed there and is refused."""
    if process_group.current() is None:
        return pipe.FPropAndGrads(pipe.theta, inputs, return_input_grads=return_input_grads)
    if return_input_grads:
        raise ValueError(
            "PipelinedModel in a cluster of several tasks: a leading trainable Embedding runs "
            "before the pipeline and its gradient is not summed across tasks; make it "
            "trainable=False, or train in one process.")
    out, grads = pipe.FPropAndReplicaGrads([pipe.theta], inputs)
    return out, grads[0]
