"""Pipeline equivalence check: one batch through the pipelined model and the plain model.

GPipe's promise is that pipelining changes nothing but speed: K cells and T micro-batches give the
gradients of the same model run on one device. `check_equivalence` tests that promise on one real
batch of a task:

- pipelined: the task's own training computation (`ComputeReplicaLossAndGrads`: micro-batches,
  re-materialisation, schedule, replicas as configured);
- reference: the task's `FProp` under one plain `tf.GradientTape` on one device, with every
  PipeliningLayer replaced by a plain chain of its layers (`composite.chain_fprop`). No pipeline
  code runs. If a pipeline holds a layer with batch statistics (one that reports side updates,
  e.g. batch norm), the reference cuts the batch into the same R x T micro-batches and averages
  their losses, because GPipe normalises over each micro-batch; otherwise the reference runs the
  whole batch at once, so randomness or statistics that depend on the micro-batch show up.

It reports, per trainable variable, `max|g_pipe - g_ref| / max(max|g_ref|, tiny)` and the relative
loss difference, worst first, with a verdict against a tolerance. Neither side applies gradients
or batch-norm updates: nothing is written.

A layer is batch-statistical if it says so (`uses_batch_statistics`, as `KerasLayer` does for a
Keras layer holding a trained BatchNormalization), else if it reports side updates
(`ApplyUpdates`). On a failure the check locates the layer: once a layer's output differs, the
gradients of every layer before it (through the backward) and after it (through their inputs)
differ too, so the worst gradient may belong to any of them. Instead each layer of the pipeline
is run on the activations the pipeline's micro-batches give it, once per micro-batch and once
on their concatenation; the first layer (not batch-statistical) whose two outputs differ by more
than the tolerance is the one the verdict names.

Example (from the repository root):

    from lingvo_lite.core.nested_map import NestedMap
    from lingvo_lite.analysis import equivalence
    from tests import testdata_models
    task_p = testdata_models.TinyMlp().Task()
    task = task_p.Instantiate()
    batch = NestedMap(next(iter(testdata_models.TinyMlp().Train().Instantiate().dataset())))
    report = equivalence.check_equivalence(task, batch)
    print(report.format())  # ... "PASS: ..."

or `python trainer.py --mode=check_equivalence --model=image.AmoebaNetDigits`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_lite.core import base_layer, fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import composite
from lingvo_lite.pipeline import micro_batch, pipelining_layer
from lingvo_lite.tasks import base_task

__all__: list[str] = []

# float32 gradients of the same model summed in another order (per micro-batch, per cell) differ
# in the last bits: on every registered model (shrunk, K=2/T=2 and K=4/T=4) the largest measured
# difference was 2e-6, except 7.2e-5 where batch norm normalises 2-example micro-batches of 2x2
# maps (tiny variances amplify rounding). A real bug (a mask that depends on the micro-batch)
# gave 0.65. 1e-3 sits well between the two.
DEFAULT_TOLERANCE = 1e-3
# A variable's gradient is compared at no finer scale than this fraction of the largest gradient
# element of the model: gradients that are analytically zero (attention key biases, which softmax
# ignores) come out as ~1e-10 of rounding noise, which no finer scale can tell from a bug.
SCALE_FLOOR = 1e-3
TINY = 1e-30
_WEIGHT_KEYS = ("loss_weight", "num_examples")
LIKELY_CAUSES = (
    "randomness not keyed on the example's position (draw masks from fprop_context's step_seed "
    "and example_offset, not from a stateful RNG or the micro-batch's shape); batch statistics "
    "or other reductions across the batch dimension that a micro-batch cannot see; state "
    "mutated in FProp (variables assigned, Python attributes changed), which the pipeline's "
    "re-materialisation runs twice")


def relative_difference(pipelined: Any, reference: Any, floor: float = 0.0) -> float:
    """max|a - b| / max(max|b|, floor, TINY): the worst element's error at the variable's scale.

    Normalising by the largest reference magnitude (rather than element-wise) keeps rounding
    noise on near-zero elements from looking like a bug; `floor` does the same for a variable
    whose whole gradient is near zero.
    """
    a = np.asarray(pipelined, dtype=np.float64)
    b = np.asarray(reference, dtype=np.float64)
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), floor, TINY))


@dataclasses.dataclass(frozen=True)
class PipelineSetup:
    """What was checked for one PipeliningLayer, and what its reference was."""

    path: str
    num_cells: int
    num_micro_batches: int
    num_replicas: int
    remat: str
    schedule: str
    reference: str


@dataclasses.dataclass(frozen=True)
class VariableDiff:
    """One trainable variable's gradient difference."""

    name: str
    where: str  # 'pipeline <path>, cell k, layer i (name)', or '' outside any pipeline.
    max_abs_diff: float
    reference_max_abs: float
    max_rel_diff: float


@dataclasses.dataclass
class EquivalenceReport:
    """Differences between the pipelined and the reference step, worst variable first."""

    pipelines: list[PipelineSetup]
    loss: float
    reference_loss: float
    variables: list[VariableDiff]
    tolerance: float
    batch_size: int
    gradient_floor: float = 0.0  # SCALE_FLOOR x the largest reference gradient element.
    # The first layer whose output on the micro-batches differs from its output on their
    # concatenation ('pipeline <path>, cell k, layer i (name)'), and by how much; set on a failure.
    suspect: str = ""
    suspect_rel_diff: float = 0.0

    @property
    def loss_rel_diff(self) -> float:
        return relative_difference(self.loss, self.reference_loss)

    @property
    def max_rel_diff(self) -> float:
        return max([self.loss_rel_diff] + [v.max_rel_diff for v in self.variables])

    @property
    def passed(self) -> bool:
        # `not >` so that a NaN difference fails.
        return not (self.max_rel_diff > self.tolerance) and np.isfinite(self.max_rel_diff)

    @property
    def worst(self) -> VariableDiff | None:
        return self.variables[0] if self.variables else None

    def verdict(self) -> str:
        """One line: PASS, or FAIL naming the worst variable and the likely causes."""
        if self.passed:
            return (f"PASS: largest relative difference {self.max_rel_diff:.2e} <= tolerance "
                    f"{self.tolerance:.0e}.")
        worst = self.worst
        if worst is not None and worst.max_rel_diff >= self.loss_rel_diff:
            what = (f"gradient of {worst.name}" + (f" ({worst.where})" if worst.where else "")
                    + f" differs by {worst.max_rel_diff:.2e} relative")
        else:
            what = f"loss differs by {self.loss_rel_diff:.2e} relative"
        if self.suspect:
            return (f"FAIL: the pipelined model is not equivalent to the unpipelined one: {what} "
                    f"(tolerance {self.tolerance:.0e}). The first layer whose output on the "
                    "micro-batches differs from its output on the whole batch is "
                    f"{self.suspect} (relative difference {self.suspect_rel_diff:.2e}); likely "
                    f"causes in it: {LIKELY_CAUSES}.")
        return (f"FAIL: the pipelined model is not equivalent to the unpipelined one: {what} "
                f"(tolerance {self.tolerance:.0e}). Likely causes in that layer or the ones "
                f"before it: {LIKELY_CAUSES}.")

    def format(self, max_rows: int = 20) -> str:
        """The readable report: setup, loss, per-variable table (worst first), verdict."""
        lines = [f"Equivalence check on one batch of {self.batch_size} examples."]
        for s in self.pipelines:
            lines.append(
                f"Pipeline {s.path}: K={s.num_cells} cells, T={s.num_micro_batches} "
                f"micro-batches, R={s.num_replicas} replica(s), remat={s.remat}, "
                f"schedule={s.schedule}.")
            lines.append(f"  Reference: {s.reference}.")
        lines.append(
            "Relative difference = max|pipelined - reference| / max(max|reference|, floor) per "
            f"variable, floor = {SCALE_FLOOR:.0e} x the largest gradient = "
            f"{self.gradient_floor:.2e}; tolerance {self.tolerance:.0e}.")
        lines.append(f"Loss: pipelined {self.loss:.8g}, reference {self.reference_loss:.8g}, "
                     f"relative difference {self.loss_rel_diff:.2e}.")
        header = ("rel diff", "abs diff", "max|ref|", "variable", "where")
        rows = [(f"{v.max_rel_diff:.2e}", f"{v.max_abs_diff:.2e}", f"{v.reference_max_abs:.2e}",
                 v.name, v.where) for v in self.variables[:max_rows]]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
        for r in [header, *rows]:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
        if len(self.variables) > max_rows:
            lines.append(f"... {len(self.variables) - max_rows} more variable(s), all within "
                         f"{self.variables[max_rows - 1].max_rel_diff:.2e}.")
        lines.append(self.verdict())
        return "\n".join(lines) + "\n"


def find_pipelines(layer: base_layer.BaseLayer) -> list[pipelining_layer.PipeliningLayer]:
    """Every PipeliningLayer in the layer tree under `layer` (itself included), in tree order."""
    if isinstance(layer, pipelining_layer.PipeliningLayer):
        return [layer]
    found = []
    for child in layer.children.values():
        for c in child if isinstance(child, list) else [child]:
            found.extend(find_pipelines(c))
    return found


def _uses_batch_statistics(layer: base_layer.BaseLayer) -> bool:
    """Whether a layer in the tree normalises with batch statistics: its own
    `uses_batch_statistics` answer when it has one, else whether it reports side updates."""
    declared = getattr(layer, "uses_batch_statistics", None)
    if isinstance(declared, bool):
        return declared
    if type(layer).ApplyUpdates is not base_layer.BaseLayer.ApplyUpdates:
        return True
    return any(_uses_batch_statistics(c) for child in layer.children.values()
               for c in (child if isinstance(child, list) else [child]))


def _merge_groups(outputs: list[Any], batch_dim: int) -> Any:
    """Outputs of the reference's micro-batches as one: scalars averaged (weighted by a
    `loss_weight` / `num_examples` output; weights summed), tensors concatenated."""
    if len(outputs) == 1:
        return outputs[0]
    if not isinstance(outputs[0], NestedMap):
        return tf.concat(outputs, batch_dim)
    weight_key = next((k for k in _WEIGHT_KEYS if outputs[0].get(k) is not None), None)
    if weight_key is None:
        weights = [tf.constant(1.0)] * len(outputs)
    else:
        weights = [tf.cast(o[weight_key], tf.float32) for o in outputs]
    total = tf.add_n(weights)
    merged = NestedMap()
    for key, value in outputs[0].FlattenItems():
        parts = [o.GetItem(key) for o in outputs]
        if value is None:
            merged.Set(key, None)
        elif key in _WEIGHT_KEYS:
            merged.Set(key, tf.add_n(parts))
        elif value.shape.rank == 0 and value.dtype.is_floating:
            merged.Set(key, tf.add_n([p * tf.cast(w / total, p.dtype)
                                      for p, w in zip(parts, weights)]))
        elif value.shape.rank == 0:
            merged.Set(key, tf.add_n(parts))
        else:
            merged.Set(key, tf.concat(parts, batch_dim))
    return merged


def _reference_fprop(pipe: pipelining_layer.PipeliningLayer, seen: dict[str, tuple[int, int, int]]
                     ) -> Any:
    """FProp of `pipe`'s layers as a plain chain of its layers, on example groups.

    One group (the whole batch) unless the layers use batch statistics: then the R x T groups of
    the pipeline's micro-batches. Records (batch size, T, groups) in `seen[pipe.path]`.
    """
    batch_dim = pipe.params.batch_dim
    stats = any(_uses_batch_statistics(layer) for layer in pipe.layers)

    def fprop(theta: NestedMap, inputs: Any) -> Any:
        batch_size = micro_batch.batch_size_of(inputs, batch_dim)
        num_micro = pipe.num_micro_batches_for(batch_size // pipe.num_replicas)
        num_groups = pipe.num_replicas * num_micro if stats else 1
        seen[pipe.path] = (batch_size, num_micro, num_groups)
        size = batch_size // num_groups
        base_offset = fprop_context.current().example_offset
        outputs = []
        for g in range(num_groups):
            def part(x: Any, g: int = g) -> Any:
                if x is None or x.shape.rank == 0:
                    return x
                index = [slice(None)] * x.shape.rank
                index[batch_dim] = slice(g * size, (g + 1) * size)
                return x[tuple(index)]

            group = inputs.Transform(part) if isinstance(inputs, NestedMap) else part(inputs)
            with fprop_context.fprop_context(example_offset=base_offset + g * size,
                                             batch_dim=batch_dim):
                outputs.append(composite.chain_fprop(pipe.layers, theta.layers, group))
        return _merge_groups(outputs, batch_dim)

    return fprop


@contextlib.contextmanager
def _unpipelined(pipes: list[pipelining_layer.PipeliningLayer],
                 seen: dict[str, tuple[int, int, int]]) -> Iterator[None]:
    """Inside, each pipeline's FProp is the plain chain of its layers (an instance override)."""
    for pipe in pipes:
        pipe.__dict__["FProp"] = _reference_fprop(pipe, seen)
    try:
        yield
    finally:
        for pipe in pipes:
            pipe.__dict__.pop("FProp", None)


def _describe_layer(pipe: pipelining_layer.PipeliningLayer, i: int) -> str:
    return (f"pipeline {pipe.path}, cell {pipe.partition.cell_of_layer(i)}, "
            f"layer {i} ({pipe.params.layers[i].name or type(pipe.layers[i]).__name__})")


def _describe_variables(task: base_task.BaseTask, pipes: list[pipelining_layer.PipeliningLayer]
                        ) -> dict[Any, str]:
    """variable ref -> 'pipeline <path>, cell k, layer i (name)'."""
    where = {}
    for pipe in pipes:
        for i, layer in enumerate(pipe.layers):
            text = _describe_layer(pipe, i)
            for v in layer.vars.Flatten():
                where[v.ref()] = text
    return where


def _batch_leaves(x: Any) -> list[Any]:
    """The float tensors of a layer's output that have a batch dimension."""
    leaves = x.Flatten() if isinstance(x, NestedMap) else [x]
    return [leaf for leaf in leaves if tf.is_tensor(leaf) and leaf.dtype.is_floating
            and leaf.shape.rank]


def _first_coupled_layer(pipe: pipelining_layer.PipeliningLayer, theta: NestedMap,
                         inputs: Any, base_offset: Any, tolerance: float
                         ) -> tuple[str, float] | None:
    """The first layer of `pipe` whose output on the pipeline's micro-batches differs from its
    output on their concatenation (fed the same activations), with the relative difference.

    Batch-statistical layers are expected to differ and are skipped. Runs eagerly.
    """
    batch_dim = pipe.params.batch_dim
    batch_size = micro_batch.batch_size_of(inputs, batch_dim)
    num_groups = pipe.num_replicas * pipe.num_micro_batches_for(batch_size // pipe.num_replicas)
    size = batch_size // num_groups

    def part(x: Any, g: int) -> Any:
        if x is None or x.shape.rank == 0:
            return x
        index = [slice(None)] * x.shape.rank
        index[batch_dim] = slice(g * size, (g + 1) * size)
        return x[tuple(index)]

    x = inputs
    for i, layer in enumerate(pipe.layers):
        outputs = []
        for g in range(num_groups):
            if isinstance(x, NestedMap):
                group = x.Transform(lambda v, g=g: part(v, g))
            else:
                group = part(x, g)
            with fprop_context.fprop_context(example_offset=base_offset + g * size,
                                             batch_dim=batch_dim):
                outputs.append(layer.FProp(theta.layers[i], group))
        split = _merge_groups(outputs, batch_dim)
        if not _uses_batch_statistics(layer):
            with fprop_context.fprop_context(example_offset=base_offset, batch_dim=batch_dim):
                whole = layer.FProp(theta.layers[i], x)
            # The floor keeps rounding noise on an all-but-zero output from looking like a bug.
            diffs = [relative_difference(a, b, floor=1e-6)
                     for a, b in zip(_batch_leaves(split), _batch_leaves(whole))]
            worst = max(diffs, default=0.0)
            if not worst <= tolerance:
                return _describe_layer(pipe, i), worst
        x = split
    return None


def _locate(task: base_task.BaseTask, batch: NestedMap,
            pipes: list[pipelining_layer.PipeliningLayer], step_seed: int, tolerance: float
            ) -> tuple[str, float] | None:
    """The first batch-coupled layer of the first pipeline that has one (see the module doc)."""
    captured: dict[str, tuple[Any, Any, Any]] = {}

    def capturing(pipe: pipelining_layer.PipeliningLayer) -> Any:
        reference = _reference_fprop(pipe, {})

        def fprop(theta: NestedMap, inputs: Any) -> Any:
            captured[pipe.path] = (theta, inputs, fprop_context.current().example_offset)
            return reference(theta, inputs)

        return fprop

    for pipe in pipes:
        pipe.__dict__["FProp"] = capturing(pipe)
    try:
        with tf.device("/device:CPU:0"), fprop_context.fprop_context(
                training=True, step_seed=step_seed, example_offset=0, updates=None):
            task.FProp(task.theta, batch)
            for pipe in pipes:
                if pipe.path in captured:
                    found = _first_coupled_layer(pipe, *captured[pipe.path], tolerance)
                    if found is not None:
                        return found
    finally:
        for pipe in pipes:
            pipe.__dict__.pop("FProp", None)
    return None


def _dense(g: Any) -> Any:
    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def check_equivalence(task: base_task.BaseTask, batch: NestedMap,
                      tolerance: float = DEFAULT_TOLERANCE, step_seed: int = 1,
                      use_tf_function: bool = True) -> EquivalenceReport:
    """Compares the pipelined training step of `task` on `batch` with the plain model.

    Args:
      task: an instantiated task with at least one PipeliningLayer.
      batch: one input batch, as the train input yields it.
      tolerance: the largest accepted relative difference (loss or any gradient).
      step_seed: the step seed of both computations (dropout masks).
      use_tf_function: trace both computations as training does (True) or run them eagerly
        (faster for small models; the values agree up to float rounding).

    Raises:
      ValueError: the task has no PipeliningLayer.
    """
    pipes = find_pipelines(task)
    if not pipes:
        raise ValueError(
            f"{task.path} has no PipeliningLayer, so there is no pipeline to check; "
            "--mode=check_equivalence compares a PipeliningLayer with its layers run unpipelined.")
    seen: dict[str, tuple[int, int, int]] = {}
    flat_theta = task.theta.FlattenItems()
    trainable = [(name, v) for name, v in flat_theta
                 if isinstance(v, tf.Variable) and v.trainable and v.dtype.is_floating]

    def pipelined() -> tuple[tf.Tensor, list[Any]]:
        # Side updates go to a collector that is never applied: the check writes nothing.
        with fprop_context.fprop_context(training=True, step_seed=step_seed, example_offset=0,
                                         updates=fprop_context.UpdateCollector()):
            out, replica_grads = task.ComputeReplicaLossAndGrads(task.replica_thetas(), batch)
        grads = dict(replica_grads[0].FlattenItems())
        return out.loss, [_dense(grads[name]) for name, _ in trainable]

    def reference() -> tuple[tf.Tensor, list[Any]]:
        with tf.device("/device:CPU:0"), _unpipelined(pipes, seen), \
                fprop_context.fprop_context(training=True, step_seed=step_seed,
                                            example_offset=0, updates=None):
            with tf.GradientTape() as tape:
                loss = task.FProp(task.theta, batch).loss
            grads = tape.gradient(loss, [v for _, v in trainable],
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return loss, [_dense(g) for g in grads]

    run_pipelined, run_reference = pipelined, reference
    if use_tf_function:
        run_pipelined = tf.function(pipelined, autograph=False)
        run_reference = tf.function(reference, autograph=False)
    loss, grads = run_pipelined()
    ref_loss, ref_grads = run_reference()

    setups = []
    for pipe in pipes:
        if pipe.path not in seen:
            raise ValueError(f"{task.path}.FProp did not call {pipe.path}; the check compares "
                             "the pipelines that the task's FProp runs.")
        batch_size, num_micro, num_groups = seen[pipe.path]
        if num_groups == 1:
            how = "on the whole batch at once"
        else:
            how = (f"over {num_groups} groups of {batch_size // num_groups} examples, the "
                   "pipeline's micro-batches (its layers use batch statistics, which GPipe "
                   "computes per micro-batch), losses averaged")
        setups.append(PipelineSetup(
            pipe.path, pipe.num_cells, num_micro, pipe.num_replicas, pipe.params.remat,
            pipe.params.schedule,
            f"the same layers and weights chained on one device (CPU:0) under one plain "
            f"GradientTape, {how}"))
    where = _describe_variables(task, pipes)
    ref_grads = [np.asarray(r, np.float64) for r in ref_grads]
    floor = SCALE_FLOOR * max([float(np.max(np.abs(r))) for r in ref_grads if r.size] + [0.0])
    diffs = []
    for (name, var), g, r in zip(trainable, grads, ref_grads):
        g = np.asarray(g, np.float64)
        diffs.append(VariableDiff(
            name=name, where=where.get(var.ref(), ""),
            max_abs_diff=float(np.max(np.abs(g - r))) if r.size else 0.0,
            reference_max_abs=float(np.max(np.abs(r))) if r.size else 0.0,
            max_rel_diff=relative_difference(g, r, floor)))
    # NaN sorts first: a NaN gradient is the worst.
    diffs.sort(key=lambda d: -np.inf if np.isnan(d.max_rel_diff) else -d.max_rel_diff)
    report = EquivalenceReport(pipelines=setups, loss=float(loss), reference_loss=float(ref_loss),
                               variables=diffs, tolerance=tolerance,
                               batch_size=micro_batch.batch_size_of(batch, 0), gradient_floor=floor)
    if not report.passed:
        found = _locate(task, batch, pipes, step_seed, tolerance)
        if found is not None:
            report.suspect, report.suspect_rel_diff = found
    return report
