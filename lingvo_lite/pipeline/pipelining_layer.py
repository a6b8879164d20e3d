"""PipeliningLayer: GPipe's micro-batch pipeline parallelism for a sequence of layers.

The layers are partitioned into K contiguous cells by estimated cost; cell k's
variables live on device k. A mini-batch of N examples is split into T
micro-batches which flow through the cells following an explicit `Schedule`
(GPipe's fill-drain by default). Training (`FPropAndGrads`) emits, per action of
the schedule, either a forward or a backward of one cell on one micro-batch:

- forward F(k, t): run on device k. Unless cell k keeps its activations (see
  `remat`), it runs without a tape, so its intermediate activations are freed
  as soon as they are consumed; only the boundary output is kept.
- backward B(k, t): on device k, re-run the forward under a tape (the
  recomputation), then differentiate with the gradient arriving from cell k+1.
  The recomputation is made to wait for that gradient through control
  dependencies, so it happens at backward time and is not merged with the
  forward by graph optimisation.

Per-micro-batch weight gradients are summed on the cell's device; the caller
applies the total once per mini-batch. Each cell's actions are chained by
control dependencies in the schedule's per-cell order, so the schedule object is
what actually runs, and independent cells overlap through the runtime's
inter-op thread pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, ContextManager

import tensorflow as tf

from lingvo_lite.core import base_layer, fprop_context, hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.distributed import (
    collectives,
    cross_process,
    placement,
    process_group,
    replica_means,
    tpu,
)
from lingvo_lite.layers import composite
from lingvo_lite.pipeline import buckets, executor, loop_executor, micro_batch, remat, step_layout
from lingvo_lite.pipeline.cell_functions import CellFunctions, flatten, is_trainable, pack
from lingvo_lite.pipeline.partition import partition
from lingvo_lite.pipeline.schedules import schedule

__all__ = ["PARTITION_COSTS", "PipeliningLayer", "iter_pipelining_params"]

REMAT_MODES = remat.REMAT_MODES
PARTITION_COSTS = ("flops", "param_bytes", "activation_bytes", "measured")
WEIGHT_GRADIENTS = ("per_micro_batch", "batched")


class PipeliningLayer(base_layer.BaseLayer):
    """Trains a sequence of layers as a GPipe pipeline of K cells and T micro-batches.

    For layer authors: values crossing a cell boundary must be tensors (or None), in
    one tensor or one NestedMap. The last layer's scalar outputs are per-micro-batch
    means that the pipeline combines into mini-batch means; a scalar output named
    `loss_weight` (or, if absent, `num_examples`) is not a metric but the micro-batch's
    weight in that mean (e.g. its real token count) and is summed across micro-batches.
    Those two names are reserved: they must be scalars >= 0.

    Example (docs/tour.md): three projections and a loss, 2 cells on 2 logical CPU
    devices standing in for accelerators, 4 micro-batches.

    >>> import tensorflow as tf
    >>> from lingvo_lite.core import devices
    >>> _ = devices.configure_logical_cpus(2)   # before any TF op
    >>> from lingvo_lite.core import fprop_context
    >>> from lingvo_lite.layers import dense, losses, structural
    >>> from lingvo_lite.core.nested_map import NestedMap
    >>> from lingvo_lite.pipeline import pipelining_layer
    >>> def proj(name, i, o):                   # a tensor layer applied to the boundary map's 'x'
    ...     return structural.FieldLayer.Params().Set(
    ...         name=name, field='x',
    ...         sub=dense.ProjectionLayer.Params().Set(name='proj', input_dim=i, output_dim=o,
    ...                                                activation='RELU'))
    >>> loss = structural.FieldsLayer.Params().Set(
    ...     name='loss', fields=['x', 'labels'],
    ...     sub=losses.SoftmaxCrossEntropyLayer.Params().Set(name='xent', input_dim=64,
    ...                                                      num_classes=10))
    >>> p = pipelining_layer.PipeliningLayer.Params().Set(
    ...     name='pipe', layers=[proj('l0', 32, 64), proj('l1', 64, 64), proj('l2', 64, 64), loss],
    ...     num_cells=2, num_micro_batches=4, remat='always',
    ...     input_shapes=NestedMap(x=tf.TensorShape([16, 32]), labels=tf.TensorShape([16])))
    >>> print(pipelining_layer.PipeliningLayer.ComputePartition(p).report())  # no weights yet
    Partition of 4 layers into 2 cells by flops
     cell  layers                   #layers  flops   share
    ------------------------------------------------------
        0  layers 0-1 (l0 .. l1)          2   201k   56.4%
        1  layers 2-3 (l2 .. loss)        2   155k   43.6%
    ------------------------------------------------------
    total                                 4   356k  100.0%
    imbalance (max/mean): 1.13
    objective: min_max (minimise the largest cell cost; ties: smaller sum of squares)
    >>> pipe = p.Instantiate()
    >>> batch = NestedMap(x=tf.random.normal([16, 32]), labels=tf.zeros([16], tf.int32))
    >>> with fprop_context.fprop_context(training=True):
    ...     out, grads = pipe.FPropAndGrads(pipe.theta, batch)   # grads shaped like pipe.theta
    ...     # With layers outside the pipeline (an embedding before it): d(loss)/d(batch) too,
    ...     # computed by the pipeline's own schedule and recomputation.
    ...     out, grads, dbatch = pipe.FPropAndGrads(pipe.theta, batch, return_input_grads=True)
    >>> out.loss.shape, dbatch.x.shape
    (TensorShape([]), TensorShape([16, 32]))
    >>> all(g.shape == w.shape for g, w in zip(grads.Flatten(), pipe.theta.Flatten()))
    True
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("layers", [], "Layer params, in order. Each layer's output feeds the next.")
        p.Define("num_cells", 1,
                 "K: number of pipeline cells, one device each (with virtual_stages=v: "
                 "K / v devices, v cells each).")
        p.Define(
            "partition_method", "min_max",
            "How layers are split into cells: 'min_max' (exactly minimise the largest "
            "cell cost), 'min_variance' (GPipe's objective), 'uniform' (equal layer "
            "counts) or 'explicit' (use split_points).",
        )
        p.Define("partition_cost", "flops",
                 f"Cost the partitioner balances, one of {PARTITION_COSTS}. 'measured': "
                 "each layer's forward and backward time on the cells' device "
                 "(layer_profile.py), cached in partition_profile_path.")
        p.Define("partition_profile_path", None,
                 "JSON file caching the layer times of partition_cost='measured' (None: "
                 "measure in every process). The trainer sets <logdir>/layer_profile.json.")
        p.Define("split_points", None,
                 "For partition_method='explicit': index of the first layer of cells 1..K-1.")
        p.Define(
            "input_shapes", None,
            "Shape of one mini-batch of input (tf.TensorShape, or a NestedMap of them), "
            "used by FPropMeta to estimate layer costs. Required unless partitioning "
            "is 'uniform' or 'explicit'.",
        )
        p.Define("input_buckets", None,
                 "Training batches of varying shape (e.g. sequence-length buckets): a list of "
                 "mini-batch shapes, each like input_shapes. A training step's batch must have "
                 "one of them (refused otherwise, naming them); each cell's functions are "
                 "traced once per bucket. The partition is chosen for input_shapes, or the "
                 "largest bucket when input_shapes is None. None: one shape per run.")
        p.Define("input_bucket_weights", None,
                 "How often each of input_buckets occurs (any positive numbers), for planning "
                 "only: --mode=plan and inspect_model weigh each bucket's step time by it. "
                 "None: the training input's bucket_distribution() when it has one, else "
                 "equal.")
        p.Define(
            "num_replicas", 1,
            "R: data-parallel replicas of the whole pipeline (R x K devices). The mini-batch "
            "is split into R equal shards, each pipelined over its replica's K cells; cell k's "
            "gradients are summed over the replicas with a collective all-reduce on the cells' "
            "devices. Train with FPropAndReplicaGrads.")
        p.Define("num_micro_batches", None,
                 "T: micro-batches per mini-batch of each replica (>= 1). None: unset, i.e. 1 "
                 "unless micro_batch_size is set.")
        p.Define("micro_batch_size", None,
                 "Alternative to num_micro_batches: examples per micro-batch. Setting both "
                 "is an error unless they agree with the mini-batch size.")
        p.Define("batch_dim", 0,
                 "The batch dimension of every input tensor. The layers see it as "
                 "fprop_context.current().batch_dim: dropout and drop-path draw each "
                 "example's mask from its position along it, whatever T is.")
        p.Define(
            "remat", "except_last",
            "Re-materialisation: 'always' recompute every cell's forward in its backward "
            "(only boundary activations are kept); 'except_last' recompute all but the "
            "micro-batch whose backward directly follows its forward on the cell's device "
            "(in GPipe's fill-drain order: the last micro-batch on every cell; recomputing "
            "it would be pure waste); 'never'.",
        )
        p.Define("schedule", "gpipe",
                 "Pipeline schedule, a name or a Schedule object. Names: 'gpipe' "
                 "(fill-drain), '1f1b' (PipeDream-flush), 'interleaved' (Megatron's "
                 "interleaved 1F1B; see virtual_stages), 'zero_bubble' (ZB-H1: each backward "
                 "split into the input gradient B and the weight gradient W, which fills the "
                 "bubbles; B records the inputs and output gradients of the ops that apply "
                 "weights (layers.weight_ops: matmuls, einsums, convolutions) and W computes "
                 "their weight gradients from those, until then held in memory; other weights "
                 "get theirs in B) or 'zbv' (ZB-V: two cells per device in a V, device d "
                 "holding cells d and 2D-1-d). A Schedule object (e.g. a CustomSchedule "
                 "parsed from text) must have num_cells cells and the step's number of "
                 "micro-batches. The schedule places the cells: cell k's weights and ops go "
                 "to its device_of_cell(k).")
        p.Define("virtual_stages", 1,
                 "For schedule='interleaved': cells per device, v. The layers are partitioned "
                 "into num_cells cells that run on num_cells / v devices, device d holding "
                 "cells d, d + num_cells / v, ...: the bubble shrinks v-fold. The number of "
                 "micro-batches must be a multiple of the number of devices.")
        p.Define(
            "weight_gradients", "per_micro_batch",
            "'per_micro_batch': every backward adds its micro-batch's weight gradient to the "
            "cell's sums (T weight-sized gradients per cell and step). 'batched': backwards "
            "record the inputs and output gradients of the ops that apply weights "
            "(layers.weight_ops) instead; after a cell's last backward, one call computes "
            "each such weight's gradient for all micro-batches at once (one matmul over all "
            "their rows): one weight-sized gradient per weight, a win for weight-heavy "
            "layers with small micro-batches, for holding every micro-batch's records until "
            "then. Other weights (biases, normalisation) get theirs per micro-batch. Refused "
            "with zero_bubble, which already defers weight gradients to its W actions.")
        p.Define(
            "micro_batch_loop", False,
            "Run the micro-batches in a tf.while_loop (loop_executor.py): each cell is called "
            "from one loop body instead of once per micro-batch, so the step's graph and its "
            "start-up time no longer grow with T, while the loop's iterations still overlap "
            "across devices. For schedule='gpipe' with remat='always' (GPipe's own setting).")
        p.Define(
            "jit_compile", False,
            "Compile each cell's traced forward and backward functions with XLA for its "
            "device (tf.function(jit_compile=True) per cell; the step around them, which "
            "places the cells on their devices, is not compiled, nor a forward run inline "
            "under the backward's tape: remat='never', except_last's last micro-batch). "
            "Every op of the layers must have an XLA kernel on the device. Ignored under "
            "TPUStrategy, which compiles the whole step.")
        p.Define(
            "serial_devices", False,
            "Run every forward and backward of a cell as one function on TensorFlow's "
            "single-threaded executor, so each device runs one op at a time (like an "
            "accelerator's compute stream) while different devices still overlap. Use it to "
            "emulate K accelerators with logical CPU devices (intra-op threads 1, inter-op "
            "threads >= K): without it the shared inter-op pool lets one cell use every core "
            "while the others idle, which hides the pipeline's bubble. Gradients are the same.",
        )
        p.Define(
            "placement", "auto",
            "Devices of the cells: 'auto', 'cpu', 'gpu', 'tpu', 'cluster[:job]' or a "
            "list of K device names. Built inside a tf.distribute.TPUStrategy ('tpu' or "
            "'auto'), cell k goes on the strategy's logical core k of every replica "
            "(placement.choose_path).",
        )
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        p = self.params
        if not p.layers:
            raise ValueError(f"{self.path}: p.layers is empty; give the layer params to pipeline.")
        if p.remat not in REMAT_MODES:
            raise ValueError(f"{self.path}: remat={p.remat!r}; use one of {REMAT_MODES}.")
        if p.weight_gradients not in WEIGHT_GRADIENTS:
            raise ValueError(f"{self.path}: weight_gradients={p.weight_gradients!r}; use one of "
                             f"{WEIGHT_GRADIENTS}.")
        try:
            micro_batch.check_micro_batch_params(p.num_micro_batches, p.micro_batch_size)
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from None
        if isinstance(p.num_replicas, bool) or not isinstance(p.num_replicas, int) \
                or p.num_replicas < 1:
            raise ValueError(f"{self.path}: num_replicas={p.num_replicas!r} must be an int >= 1.")
        if p.micro_batch_loop:
            try:
                loop_executor.check_loop_supported(p.schedule, p.remat, p.weight_gradients)
            except ValueError as e:
                raise ValueError(f"{self.path}: {e}") from None
        try:
            self._buckets = (None if p.input_buckets is None
                             else buckets.normalize(p.input_buckets))
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from None
        self._partition = self.ComputePartition(p)
        num_cells = self._partition.num_cells
        try:  # The schedule, checked before any device is chosen: it places the cells.
            probe = step_layout.placement_schedule(p, num_cells)
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from None
        self._num_devices = probe.num_devices
        self._cell_devices = probe.cell_devices
        strategy = tpu.current_tpu_strategy()
        path = placement.choose_path(p.placement, p.num_replicas, self._num_devices,
                                     placement.visible_device_counts(), strategy is not None)
        # Under a TPUStrategy the strategy replicates and places: device d on logical core d.
        self._tpu_strategy = strategy if path == placement.TPU_STRATEGY_PATH else None
        if self._tpu_strategy is not None:
            tpu.logical_cores_per_replica(self._tpu_strategy, self._num_devices)
            self._mesh = tpu.strategy_mesh(self._tpu_strategy, self._num_devices)
        else:
            self._mesh = placement.resolve_mesh(p.placement, p.num_replicas, self._num_devices)
        if p.micro_batch_loop and self._tpu_strategy is not None:
            raise ValueError(
                f"{self.path}: micro_batch_loop=True under a TPUStrategy: XLA runs a loop's "
                "iterations one after another, so the cells would not overlap; set "
                "micro_batch_loop=False.")
        self._active_replica: int | None = None  # Set while FPropAndReplicaGrads runs one.
        self._executors: dict[int, executor.Executor] = {}
        self.CreateChildren(
            "layers", list(p.layers),
            scopes=[lambda k=self._partition.cell_of_layer(i): self._cell_scope(k)
                    for i in range(len(p.layers))])
        # Replicas 1..R-1 hold copies of the trainable weights on their own devices
        # (non-trainable state, e.g. batch-norm moving statistics, is kept once).
        self._replica_vars = [self._copy_trainable_vars(r) for r in range(1, p.num_replicas)]
        # Multi-client (process_group): these R replicas are this process's share of
        # R x num_processes; cell k's group spans the replicas of every process, and a small
        # `side` group combines scalar outputs and batch-norm moments (cross_process.py).
        self._processes = None if self._tpu_strategy is not None else process_group.current()
        num_processes = 1 if self._processes is None else self._processes.num_processes
        self._gradient_all_reduce = []
        self._side_all_reduce = None
        if p.num_replicas * num_processes > 1:
            self._gradient_all_reduce = [
                collectives.AllReduce([row[self._device_of_cell(k)] for row in self._mesh],
                                      group_size=p.num_replicas * num_processes)
                for k in range(self.num_cells)
            ]
        if num_processes > 1:
            self._side_all_reduce = collectives.AllReduce(
                [self._mesh[0][self._device_of_cell(self.num_cells - 1)]],
                group_size=num_processes)

    # -- static analysis -----------------------------------------------------

    @classmethod
    def LayerMetas(cls, p: hyperparams.Params) -> list[NestedMap]:
        """FPropMeta of every layer, chained from `p.input_shapes`.

        Raises a ValueError naming the layer (and its cell boundary) whose input
        does not fit the previous layer's output.
        """
        shapes = buckets.planning_shapes(p)
        if shapes is None:
            raise ValueError(
                "PipeliningLayer needs p.input_shapes (the shape of one mini-batch) to "
                "estimate layer costs; set it, or use partition_method='uniform'/'explicit'."
            )
        return composite.chain_meta(p.layers, base_layer.to_shape(shapes),
                                    input_name="p.input_shapes")

    @classmethod
    def ComputePartition(cls, p: hyperparams.Params,
                         metas: Sequence[NestedMap] | None = None) -> partition.Partition:
        """The cells for `p`, computed from FPropMeta costs without creating variables.

        `metas`: `LayerMetas(p)` when the caller already has them (the planner partitions the
        same layers into many cell counts).
        """
        names = [lp.name or f"{lp.cls.__name__}_{i}" for i, lp in enumerate(p.layers)]
        if p.partition_method in ("uniform", "explicit") and buckets.planning_shapes(p) is None:
            costs = [1.0] * len(p.layers)
            cost_name = "layers"
        else:
            if p.partition_cost not in PARTITION_COSTS:
                raise ValueError(
                    f"partition_cost={p.partition_cost!r}; use one of {PARTITION_COSTS}."
                )
            if metas is None:
                metas = cls.LayerMetas(p)
            cost_name = p.partition_cost
            if cost_name == "measured":
                from lingvo_lite.pipeline.partition import layer_profile  # Imports this module.

                costs = layer_profile.measured_costs(p)
                cost_name = "measured seconds"
            elif cost_name == "flops":
                costs = [m.flops for m in metas]
            elif cost_name == "param_bytes":
                costs = [m.num_params * tf.as_dtype(p.dtype).size for m in metas]
            else:
                costs = [float(m.out_bytes) for m in metas]
        return partition.make_partition(
            names, costs, p.num_cells, method=p.partition_method,
            split_points=p.split_points, cost_name=cost_name,
        )

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, *input_shapes: Any) -> NestedMap:
        metas = composite.chain_meta(list(p.layers), *input_shapes)
        return composite.sum_meta(metas, input_shapes, p.fprop_dtype or p.dtype)

    @property
    def partition(self) -> partition.Partition:
        return self._partition

    @property
    def devices(self) -> list[str]:
        """Device of each cell (of replica 0)."""
        return [self._mesh[0][self._device_of_cell(k)] for k in range(self.num_cells)]

    @property
    def num_devices(self) -> int:
        """Devices per replica: num_cells, or num_cells / virtual_stages when interleaved."""
        return self._num_devices

    def _device_of_cell(self, k: int) -> int:
        return self._cell_devices[k]

    @property
    def cell_devices(self) -> tuple[int, ...]:
        """`cell_devices[k]`: the index (within a replica) of cell k's device, as the schedule
        places it; `devices[k]` names it."""
        return self._cell_devices

    @property
    def num_cells(self) -> int:
        return self._partition.num_cells

    @property
    def num_replicas(self) -> int:
        return self.params.num_replicas

    @property
    def mesh(self) -> list[list[str]]:
        """`mesh[r][k]`: the device of cell k of replica r (of the TPUStrategy, if any)."""
        return [[row[self._device_of_cell(k)] for k in range(self.num_cells)]
                for row in self._mesh]

    @property
    def tpu_strategy(self) -> tf.distribute.Strategy | None:
        """The TPUStrategy that replicates and places this pipeline, or None."""
        return self._tpu_strategy

    def _cell_scope(self, k: int, replica: int = 0) -> ContextManager[Any]:
        """Where cell k of `replica` creates its variables and runs its ops."""
        if self._tpu_strategy is not None:
            return tpu.cell_scope(self._tpu_strategy, self._device_of_cell(k))
        return tf.device(self._mesh[replica][self._device_of_cell(k)])

    def _copy_trainable_vars(self, replica: int) -> NestedMap:
        """Replica `replica`'s theta: copies of the trainable weights on its cells' devices."""
        layers = []
        for i, layer_vars in enumerate(self.vars.layers):
            device = self._mesh[replica][self._device_of_cell(self._partition.cell_of_layer(i))]

            def copy(v: tf.Variable, device: str = device) -> tf.Variable:
                if not v.trainable:
                    return v
                with tf.device(device):
                    return tf.Variable(v.read_value(), trainable=True,
                                       name=f"replica_{replica}/{v.name.split(':')[0]}")

            layers.append(layer_vars.Transform(copy))
        return NestedMap(layers=layers)

    def replica_thetas(self, theta: NestedMap) -> list[NestedMap]:
        """The theta of every replica: `theta` itself for replica 0, then the copies."""
        return [theta] + list(self._replica_vars)

    def replica_variable_pairs(self) -> list[tuple[tf.Variable, tf.Variable]]:
        """(replica 0 variable, copy) for every copied variable of every other replica."""
        primary = self.vars.Flatten()
        return [(v, c) for copies in self._replica_vars
                for v, c in zip(primary, copies.Flatten()) if c is not v]

    def cell_layers(self, k: int) -> range:
        start, stop = self._partition.cell_layer_ranges[k]
        return range(start, stop)

    def cell_variables(self, k: int) -> list[tf.Variable]:
        """Every variable of cell k (all of them live on `devices[k]`)."""
        return [v for i in self.cell_layers(k) for v in self.layers[i].vars.Flatten()]

    def make_schedule(self, num_micro_batches: int) -> schedule.Schedule:
        try:
            sched = schedule.schedule_for(self.params.schedule, self.num_cells,
                                          num_micro_batches, self.params.virtual_stages)
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from None
        if sched.cell_devices != self._cell_devices:
            raise ValueError(
                f"{self.path}: the schedule for T={num_micro_batches} places cells on devices "
                f"{list(sched.cell_devices)}, but the weights were placed by "
                f"{list(self._cell_devices)}; a schedule must place cells the same way for "
                "every T.")
        return sched

    def _check_bucket(self, inputs: Any) -> None:
        """A training batch must have one of the declared input_buckets' shapes."""
        if self._buckets is None or buckets.matching(self._buckets, inputs) is not None:
            return
        declared = ", ".join(buckets.describe(b) for b in self._buckets)
        raise ValueError(
            f"{self.path}: a training batch of shape {buckets.describe(buckets.shapes_of(inputs))}"
            f" is not one of the declared input_buckets ({declared}); batch the input into "
            "these shapes (e.g. ParallelTextInput's bucket_lengths) or declare the shape.")

    @property
    def input_buckets(self) -> list[Any] | None:
        """The declared training batch shapes (TensorShapes or NestedMaps of them), or None."""
        return self._buckets

    def num_micro_batches_for(self, batch_size: int) -> int:
        """T for one replica's shard of `batch_size` examples (`step_layout`)."""
        return step_layout.num_micro_batches(self.params, batch_size)

    # -- execution -----------------------------------------------------------

    @property
    def jit_compile(self) -> bool:
        """Whether each cell's functions are compiled with XLA (p.jit_compile, or
        `set_jit_compile`)."""
        return getattr(self, "_jit_compile", self.params.jit_compile)

    def set_jit_compile(self, jit_compile: bool) -> None:
        """Compiles the cells' functions with XLA (or not) from the next step on (Keras'
        `compile(jit_compile=...)`); they are traced anew."""
        if bool(jit_compile) != self.jit_compile:
            self._jit_compile = bool(jit_compile)
            self._executors.clear()

    def _executor(self, replica: int) -> executor.Executor:
        """The executor of `replica`'s cells; their functions are traced on first use."""
        if replica not in self._executors:
            cells = [CellFunctions(k, lambda theta, x, k=k: self._chain_cell(theta, k, x),
                                   replica=replica if self.num_replicas > 1 else None,
                                   traced=self._tpu_strategy is None,
                                   serial=self.params.serial_devices,
                                   jit_compile=self.jit_compile)
                     for k in range(self.num_cells)]
            make = (loop_executor.LoopExecutor if self.params.micro_batch_loop
                    else executor.Executor)
            self._executors[replica] = make(
                cells, lambda k: self._cell_scope(k, replica), serial=self.params.serial_devices)
        return self._executors[replica]

    def _cell_thetas(self, theta: NestedMap) -> list[NestedMap]:
        """Each cell's part of `theta`: NestedMap(layers=[theta of its layers])."""
        return [NestedMap(layers=[theta.layers[i] for i in self.cell_layers(k)])
                for k in range(self.num_cells)]

    def _chain_cell(self, cell_theta: NestedMap, k: int, x: Any) -> Any:
        layers = [self.layers[i] for i in self.cell_layers(k)]
        out = composite.chain_fprop(layers, cell_theta.layers, x)
        if isinstance(out, tuple):
            raise ValueError(
                f"Cell {k} returns a tuple; a pipeline boundary carries one value. Return a "
                "NestedMap to carry several tensors between cells."
            )
        micro_batch.check_tensor_leaves(out, f"The output of cell {k}")
        return out

    def _split(self, inputs: Any) -> tuple[list[Any], int, int]:
        p = self.params
        micro_batch.check_tensor_leaves(inputs, "The pipeline input")
        batch_size = micro_batch.batch_size_of(inputs, p.batch_dim)
        num_micro = self.num_micro_batches_for(batch_size)
        return micro_batch.split(inputs, num_micro, p.batch_dim), num_micro, batch_size // num_micro

    def FProp(self, theta: NestedMap, inputs: Any) -> Any:
        """Forward only (eval and inference), pipelined over the same cells and devices."""
        xs, num_micro, micro_size = self._split(inputs)
        with fprop_context.fprop_context(batch_dim=self.params.batch_dim):
            ordered = self._executor(0).forward(self.make_schedule(num_micro),
                                                self._cell_thetas(theta), xs, micro_size)
        return micro_batch.merge(ordered, self.params.batch_dim, micro_batch.loss_weights(ordered))

    def FPropAndGrads(
        self, theta: NestedMap, inputs: Any, *, return_input_grads: bool = False
    ) -> tuple[Any, NestedMap] | tuple[Any, NestedMap, Any]:
        """Pipelined forward and backward of one mini-batch (training only).

        Must run inside `fprop_context.fprop_context(training=True, ...)`; outside
        it this raises instead of silently training in eval mode.

        The last layer must return a NestedMap with a scalar `loss` (the mean over
        its micro-batch). The mini-batch loss is the mean over micro-batches, or,
        when the last layer also returns a scalar `loss_weight` (else `num_examples`),
        the mean weighted by it: these two output names are reserved for that
        weight, which must be a scalar >= 0 (checked at run time).

        Side updates (batch-norm moving statistics): if the current fprop_context
        has an `UpdateCollector`, they are reported to it and the caller applies
        them (as `BaseTask.TrainStep` does, only for steps it applies). Without one,
        FPropAndGrads applies the pooled updates itself once the backward is built,
        so they cannot be forgotten.

        Args:
          theta: the pipeline's theta (e.g. `self.theta`).
          inputs: the mini-batch (a tensor or a NestedMap of tensors).
          return_input_grads: (keyword only, a bool) also return d(loss)/d(inputs),
            computed by the pipeline's own schedule (cell 0's backward, with its
            recomputation).

        Returns:
          (outputs, grads), or (outputs, grads, input_grads) with
          `return_input_grads`: the merged outputs of the last cell; a NestedMap
          shaped like `theta` with the gradient of the mini-batch loss for every
          trainable leaf (None for non-trainable ones), summed over micro-batches on
          each cell's device; and a structure like `inputs` with the gradient for
          every float leaf (None for the others).
        """
        if not isinstance(return_input_grads, bool):
            raise TypeError(
                f"{self.path}.FPropAndGrads(theta, inputs, return_input_grads=...): "
                f"return_input_grads must be True or False, got "
                f"{type(return_input_grads).__name__}; pass the whole mini-batch as one "
                "`inputs` (a tensor or a NestedMap).")
        if self._active_replica is None:
            self._check_bucket(inputs)
        if self._gradient_all_reduce and self._active_replica is None:
            where = ("" if self._processes is None else
                     f" in each of {self._processes.num_processes} processes")
            raise ValueError(
                f"{self.path} has num_replicas={self.num_replicas}{where}: train it with "
                "FPropAndReplicaGrads(replica_thetas(theta), inputs), which updates every "
                "replica's weights, or set num_replicas=1.")
        split = self._split(inputs)
        ctx = fprop_context.current()
        if not ctx.training:
            raise ValueError(
                "FPropAndGrads trains: call it inside fprop_context.fprop_context("
                "training=True, ...); for evaluation use FProp.")
        result = fprop_context.applying_side_updates(
            lambda: self._FPropAndGrads(theta, split, return_input_grads))
        return result if return_input_grads else result[:2]

    def _FPropAndGrads(
        self, theta: NestedMap, split: tuple[list[Any], int, int], return_input_grads: bool
    ) -> tuple[Any, NestedMap, Any]:
        xs, num_micro, micro_size = split
        replica = self._active_replica or 0
        sched = self.make_schedule(num_micro)
        weight_of: dict[int, Any] = {}

        def loss_gradient(y: Any) -> Any:
            # d(mini-batch loss)/d(loss_t). With weighted micro-batches the raw weight is
            # used here and the total divides the sums at the end, so no backward has to
            # wait for every micro-batch's forward.
            self._check_loss_output(y)
            weight = weight_of.setdefault(id(y), micro_batch.micro_batch_weight(y))
            upstream = y.Transform(lambda v: None)
            upstream.loss = tf.cast(1.0 / num_micro if weight is None else weight, y.loss.dtype)
            return upstream

        with fprop_context.fprop_context(batch_dim=self.params.batch_dim):
            result = self._executor(replica).train(
                sched, self._cell_thetas(theta), xs, micro_size,
                keep=remat.remat_plan(sched, self.params.remat), loss_gradient=loss_gradient,
                need_input_grads=return_input_grads,
                batched_weight_grads=self.params.weight_gradients == "batched")
        ordered = result.outputs
        grads = self._theta_grads(theta, result.grad_sums)
        weights = [weight_of[id(o)] for o in ordered]
        total = None if weights[0] is None else micro_batch.total_weight(ordered, weights)
        if total is not None:
            # Each gradient is divided on its cell's device: an op without a device would be
            # placed on the default one, and every cell's weight gradients would cross to it
            # and back (across hosts, in a cluster).
            cell_of_leaf = self._cell_of_theta_leaves()
            for i, g in enumerate(grads):
                if g is not None:
                    with self._cell_scope(cell_of_leaf[i], replica):
                        grads[i] = g / tf.cast(total, g.dtype)
        merged = micro_batch.merge(ordered, self.params.batch_dim,
                                   micro_batch.loss_weights(ordered, weights, total))
        dinputs = None
        if return_input_grads:
            dinputs = pack(xs[0], self._merge_input_grads(xs[0], result.input_grads, total))
        return merged, theta.Pack(grads), dinputs

    def _merge_input_grads(self, like: Any, per_micro: list[list[Any]],
                           total: Any) -> list[Any]:
        """Concatenates per-micro-batch input gradients; a shared scalar input's are summed."""
        merged = []
        for i, leaf in enumerate(flatten(like)):
            parts = [g[i] for g in per_micro]
            if parts[0] is None:
                merged.append(None)
                continue
            if leaf.shape.rank == 0:
                g = tf.add_n(parts)
            else:
                g = parts[0] if len(parts) == 1 else tf.concat(parts, self.params.batch_dim)
            merged.append(g if total is None else g / tf.cast(total, g.dtype))
        return merged

    def FPropAndReplicaGrads(
        self, thetas: list[NestedMap], inputs: Any
    ) -> tuple[Any, list[NestedMap]]:
        """Data-parallel training step: R replicas of the pipeline on R shards of the batch.

        The mini-batch is split along `batch_dim` into R equal shards; replica r runs
        `FPropAndGrads` on shard r with `thetas[r]` on its own devices (`mesh[r]`), its
        examples numbered from its shard's start in the whole mini-batch (dropout masks do
        not depend on R). Cell k's gradients are then summed over the replicas by one
        collective all-reduce per cell on the cells' devices, and weighted so that the
        result is the gradient of the whole mini-batch's loss.

        Args:
          thetas: `replica_thetas(theta)`, one theta per replica.
          inputs: the mini-batch (its size divisible by R x T).

        Returns:
          (outputs, grads): the merged outputs of all replicas (scalars are the
          mini-batch means) and, per replica, the mini-batch gradient shaped like its
          theta and placed on its devices (equal values): apply grads[r] to thetas[r].
        """
        p = self.params
        if len(thetas) != self.num_replicas:
            raise ValueError(f"{self.path}: FPropAndReplicaGrads got {len(thetas)} thetas for "
                             f"num_replicas={self.num_replicas}; pass replica_thetas(theta).")
        self._check_bucket(inputs)
        batch_size = micro_batch.batch_size_of(inputs, p.batch_dim)
        if batch_size % self.num_replicas:
            raise ValueError(
                f"The mini-batch of {batch_size} examples does not split into "
                f"num_replicas={self.num_replicas} equal shards; make input.batch_size a "
                f"multiple of {self.num_replicas}.")
        shard_size = batch_size // self.num_replicas
        # Side updates of every replica pool into one collector, applied once.
        return fprop_context.applying_side_updates(
            lambda: self._replica_steps(thetas, inputs, shard_size))

    def _replica_steps(self, thetas: list[NestedMap], inputs: Any,
                       shard_size: int) -> tuple[Any, list[NestedMap]]:
        p = self.params
        if self._tpu_strategy is not None:
            return self._strategy_replica_step(thetas[0], inputs, shard_size)
        base_offset = fprop_context.current().example_offset
        if self._processes is not None:  # This process's examples follow the earlier ones'.
            base_offset = base_offset + self._processes.index * self.num_replicas * shard_size
        collector = fprop_context.current().updates
        reported_before = {id(layer) for layer, _ in collector.items()}
        outputs, grads = [], []
        for r, shard in enumerate(micro_batch.split(inputs, self.num_replicas, p.batch_dim)):
            self._active_replica = r
            try:
                scope = (tf.name_scope(f"replica_{r}") if self.num_replicas > 1
                         else contextlib.nullcontext())
                with scope, fprop_context.fprop_context(
                        example_offset=base_offset + r * shard_size):
                    out, g = self.FPropAndGrads(thetas[r], shard)
            finally:
                self._active_replica = None
            outputs.append(out)
            grads.append(g)
        if not self._gradient_all_reduce:
            return outputs[0], grads
        weights = [micro_batch.micro_batch_weight(o) for o in outputs]
        if weights[0] is None:
            weights = [tf.constant(1.0)] * self.num_replicas
        merged = micro_batch.merge(outputs, p.batch_dim, micro_batch.loss_weights(outputs))
        grads = replica_means.weighted_mean_grads(grads, weights, self._gradient_all_reduce,
                                                  self._cell_of_theta_leaves())
        if self._side_all_reduce is not None:
            merged = cross_process.global_scalars(self._side_all_reduce, merged,
                                                  tf.add_n(weights))
            cross_process.pool_moments_globally(
                self._side_all_reduce, collector,
                {id(layer) for layer, _ in collector.items()} - reported_before,
                self._processes.num_processes, self._processes.index)
        return merged, grads

    def _strategy_replica_step(self, theta: NestedMap, inputs: Any,
                               batch_size: int) -> tuple[Any, list[NestedMap]]:
        """One replica of a TPUStrategy step (inside `strategy.run`) on its own batch.

        The strategy gave each replica `batch_size` examples of the global batch, replica
        r's starting at r x batch_size (its examples are numbered from there, as in the
        in-process mesh). Gradients and scalar outputs are then combined over the
        replicas by the replica context's all-reduce, once per cell on the cell's core,
        weighted like `_replica_steps`: sum_r w_r g_r / sum_r w_r. Non-scalar outputs
        stay this replica's.
        """
        context = tf.distribute.get_replica_context()
        offset = (fprop_context.current().example_offset
                  + context.replica_id_in_sync_group * batch_size)
        with fprop_context.fprop_context(example_offset=offset):
            out, grads = self.FPropAndGrads(theta, inputs)
        weight = micro_batch.micro_batch_weight(out)
        weight = tf.constant(1.0) if weight is None else tf.cast(weight, tf.float32)
        flat = grads.Flatten()
        cell_of_leaf = self._cell_of_theta_leaves()
        sum_ = tf.distribute.ReduceOp.SUM
        for k in range(self.num_cells):
            idx = [i for i, g in enumerate(flat) if g is not None and cell_of_leaf[i] == k]
            if not idx:
                continue
            with self._cell_scope(k):
                *summed, total = context.all_reduce(
                    sum_, [flat[i] * tf.cast(weight, flat[i].dtype) for i in idx] + [weight])
                total = tf.maximum(total, 1e-8)
                for i, g in zip(idx, summed):
                    flat[i] = g / tf.cast(total, g.dtype)
        if isinstance(out, NestedMap):
            with self._cell_scope(self.num_cells - 1):
                out = replica_means.weighted_mean_scalars(context, out, weight)
        return out, [grads.Pack(flat)]

    def _cell_of_theta_leaves(self) -> list[int]:
        """The cell of each leaf of theta, in `theta.Flatten()` order."""
        return [self._partition.cell_of_layer(i)
                for i, layer_vars in enumerate(self.vars.layers) for _ in layer_vars.Flatten()]

    def _theta_grads(self, theta: NestedMap, grad_sums: list[list[Any]]) -> list[Any]:
        """The cells' summed gradients as a list in `theta.Flatten()` order (None: not trained)."""
        grads: list[Any] = []
        for k in range(self.num_cells):
            sums = iter(grad_sums[k])
            for i in self.cell_layers(k):
                grads.extend(next(sums) if is_trainable(leaf) else None
                             for leaf in theta.layers[i].Flatten())
        return grads

    @staticmethod
    def _check_loss_output(y: Any) -> None:
        if not (isinstance(y, NestedMap) and "loss" in y and y.loss.shape.rank == 0):
            raise ValueError(
                "FPropAndGrads needs the last layer to return a NestedMap with a scalar 'loss' "
                "(the mean loss of its micro-batch); end p.layers with a loss layer."
            )


def iter_pipelining_params(p: Any, path: str = "") -> Iterator[tuple[str, hyperparams.Params]]:
    """Yields (dotted path, params) of every PipeliningLayer params in the tree under `p`.

    Walks nested Params and the lists, tuples and dicts that hold them (e.g. `network.layers[3]`).
    """
    if isinstance(p, hyperparams.Params):
        cls = p.cls if "cls" in p else None
        if isinstance(cls, type) and issubclass(cls, PipeliningLayer):
            yield path, p
        for name, value in p.IterParams():
            yield from iter_pipelining_params(value, f"{path}.{name}" if path else name)
    elif isinstance(p, (list, tuple)):
        for i, value in enumerate(p):
            yield from iter_pipelining_params(value, f"{path}[{i}]")
    elif isinstance(p, dict):
        for key, value in p.items():
            yield from iter_pipelining_params(value, f"{path}[{key}]")
