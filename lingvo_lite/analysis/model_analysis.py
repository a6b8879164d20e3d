"""Model analysis from params alone: per-layer costs and pipeline partitions, no weights.

`describe_model` is what `trainer.py --mode=inspect_model` prints and what training writes to
`<logdir>/model_analysis.txt`. It only calls the layers' `FPropMeta` cost models and the
partitioner, so it takes seconds even for models far too large to allocate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_lite.analysis import simulator
from lingvo_lite.core import base_layer, hyperparams
from lingvo_lite.pipeline import buckets, pipelining_layer, step_layout
from lingvo_lite.pipeline.partition import partition

__all__: list[str] = []


def format_shapes(shapes: Any) -> str:
    """Readable shapes: `[16, 8]`, `{x: [16, 8], labels: [16]}`, tuples as `(a, b)`."""
    if isinstance(shapes, tuple) and not isinstance(shapes, tf.TensorShape):
        if len(shapes) == 1:
            return format_shapes(shapes[0])
        return "(" + ", ".join(format_shapes(s) for s in shapes) + ")"
    if isinstance(shapes, dict):
        return "{" + ", ".join(f"{k}: {format_shapes(v)}" for k, v in shapes.items()) + "}"
    if shapes is None:
        return "None"
    shape = tf.TensorShape(shapes)
    if shape.rank is None:
        return "<unknown>"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape.as_list()) + "]"


def format_count(n: int) -> str:
    """`1,234,567 (1.23M)`; small numbers without the SI form."""
    if n < 10_000:
        return f"{n:,}"
    return f"{n:,} ({partition.format_si(n)})"


def _table(header: Sequence[str], rows: list[Sequence[str]], right: Sequence[bool]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(r: Sequence[str]) -> str:
        cells = [f"{c:>{w}}" if ra else f"{c:<{w}}" for c, w, ra in zip(r, widths, right)]
        return "  ".join(cells).rstrip()

    rule = "-" * len(fmt(header))
    return [fmt(header), rule, *(fmt(r) for r in rows[:-1]), rule, fmt(rows[-1])]


def _layer_name(lp: hyperparams.Params, i: int) -> str:
    return lp.name or f"{lp.cls.__name__}_{i}"


def describe_pipeline(path: str, p: hyperparams.Params,
                      extra_num_cells: Sequence[int] = (),
                      input_params: hyperparams.Params | None = None
                      ) -> tuple[str, dict[str, int]]:
    """Per-layer table and partition report(s) of one PipeliningLayer params; with
    input_buckets, each bucket's predicted step and their mix, weighted by
    `input_bucket_weights` or else `input_params`' bucket distribution (bucket_plan.py).

    Returns:
      (text, counts): counts of weight elements (all zero when the costs cannot be
      estimated): `num_params` (all), `non_trainable_params` (e.g. batch-norm moving
      statistics) and `training_only_params` (e.g. auxiliary heads).
    """
    lines = [
        f"PipeliningLayer '{path}': {len(p.layers)} layers, num_cells={p.num_cells}, "
        f"num_micro_batches={p.num_micro_batches}, micro_batch_size={p.micro_batch_size}, "
        f"partition={p.partition_method} by {p.partition_cost}, remat={p.remat}, "
        f"schedule={p.schedule}"
        + (" (micro-batches in a tf.while_loop)" if p.micro_batch_loop else ""),
        f"input_shapes: {format_shapes(p.input_shapes) if p.input_shapes is not None else None}",
    ]
    counts = {"num_params": 0, "non_trainable_params": 0, "training_only_params": 0}
    try:
        metas = pipelining_layer.PipeliningLayer.LayerMetas(p)
    except ValueError as e:
        lines.append(f"(no per-layer costs: {e})")
        metas = None
    if metas is not None:
        rows = []
        for i, (lp, meta) in enumerate(zip(p.layers, metas)):
            rows.append((str(i), _layer_name(lp, i), lp.cls.__name__,
                         format_shapes(meta.out_shapes), format_count(meta.num_params),
                         partition.format_si(meta.flops), partition.format_si(meta.out_bytes)))
        counts = {"num_params": sum(m.num_params for m in metas),
                  **base_layer.extra_param_counts(metas)}
        rows.append(("", "total", "", "", format_count(counts["num_params"]),
                     partition.format_si(sum(m.flops for m in metas)), ""))
        header = ("#", "layer", "class", "output shape", "params", "fwd flops", "out bytes")
        lines += _table(header, rows, (True, False, False, False, True, True, True))
    profile = _measured_profile(p, lines) if p.partition_cost == "measured" else None
    ks = [p.num_cells] + [k for k in extra_num_cells if k != p.num_cells]
    for k in ks:
        q = p.Copy()
        q.num_cells = k
        lines.append("")
        try:
            part = pipelining_layer.PipeliningLayer.ComputePartition(q)
        except ValueError as e:
            lines.append(f"K={k}: cannot partition: {e}")
            continue
        lines.append(part.report())
        layout = _layout(q, part.num_cells)
        if layout is None:
            continue
        # Each replica runs its shard of the mini-batch in T micro-batches; the layer costs
        # are of the whole mini-batch, and only their ratios matter to the prediction.
        num_micro = layout.num_micro_batches
        if profile is not None:
            forward = [t.forward_s * num_micro for t in profile.layers]
            ratio = (sum(t.backward_s for t in profile.layers)
                     / max(sum(t.forward_s for t in profile.layers), 1e-12))
            prediction = simulator.predict(part, forward, num_micro, layout.schedule, p.remat,
                                           backward_ratio=ratio)
            lines += [f"Predicted step (schedule simulator; time = measured forward seconds, "
                      f"backward = {ratio:.2f} x forward, transfers free):",
                      "  " + prediction.summary()]
        elif metas is not None:
            prediction = simulator.predict(part, [m.flops for m in metas], num_micro,
                                           layout.schedule, p.remat)
            lines += ["Predicted step (schedule simulator; time = forward FLOPs, backward = "
                      f"{simulator.BACKWARD_RATIO:g} x forward, transfers free):",
                      "  " + prediction.summary()]
    if p.input_buckets and metas is not None:
        from lingvo_lite.analysis import bucket_plan

        weights, source = bucket_plan.bucket_weights(p, input_params)
        try:
            steps = bucket_plan.bucket_steps(p, weights)
        except ValueError as e:
            lines += ["", f"(no bucket mix: {e})"]
        else:
            lines += ["", *bucket_plan.mix_lines(steps, f"{source}; K={p.num_cells}, "
                                                 f"{p.schedule}, remat={p.remat}; memory with "
                                                 "one optimizer slot per weight",
                                                 planned=buckets.planning_shapes(p))]
    if p.num_replicas > 1:
        lines += ["", _describe_mesh(p)]
    return "\n".join(lines), counts


def _measured_profile(p: hyperparams.Params, lines: list[str]) -> Any:
    """partition_cost='measured': appends the layers' measured times to `lines`; the profile
    (None, with the reason in `lines`, when the layers cannot be timed)."""
    from lingvo_lite.pipeline.partition import layer_profile

    try:
        profile = layer_profile.load_or_measure(p)
    except ValueError as e:
        lines.append(f"(no measured layer times: {e})")
        return None
    key = profile.key
    where = p.partition_profile_path or "not cached: partition_profile_path is None"
    lines += ["", f"Measured layer times (partition_cost='measured'): one micro-batch "
              f"{key['input_shapes']} on {key['device_kind']}"
              f"{', serial executor' if key['serial_devices'] else ''}, TF {key['tf_version']} "
              f"({where}):"]
    lines += layer_profile.format_profile(profile)
    return profile


def _layout(p: hyperparams.Params, num_cells: int) -> step_layout.StepLayout | None:
    """The step layout of a PipeliningLayer's params for its `input_shapes` mini-batch (None
    when the batch is unknown or does not split so)."""
    batch = step_layout.global_batch_size(p)
    if batch is None:
        return None
    try:
        return step_layout.resolve(p, batch, num_cells)
    except (ValueError, TypeError):
        return None


def _describe_mesh(p: hyperparams.Params) -> str:
    """Which device holds which replica's cell, for a local placement (see resolve_mesh): the
    schedule places the cells (`cell_devices`)."""
    num_cells, num_replicas = p.num_cells, p.num_replicas
    try:
        sched = step_layout.placement_schedule(p)
    except ValueError as e:
        return f"Mesh: {num_replicas} data-parallel replicas ({e})"
    num_devices, cell_devices = sched.num_devices, sched.cell_devices
    shape = (f"{num_cells} cells" if num_devices == num_cells
             else f"{num_devices} devices of {num_cells // num_devices} cells each "
             f"(schedule {sched.name})")
    lines = [f"Mesh: {num_replicas} data-parallel replicas x {shape} = "
             f"{num_replicas * num_devices} devices (placement={p.placement!r}); cell k's "
             "gradients are all-reduced over the replicas on the cells' devices."]
    explicit = None if isinstance(p.placement, str) else list(p.placement)
    for r in range(num_replicas):
        cells = ", ".join(
            f"cell {k} -> " + (explicit[r * num_devices + cell_devices[k]] if explicit
                               else f"device {r * num_devices + cell_devices[k]}")
            for k in range(num_cells))
        lines.append(f"  replica {r}: {cells}")
    return "\n".join(lines)


def describe_model(name: str, task_params: hyperparams.Params,
                   extra_num_cells: Sequence[int] = (), read_input: bool = False) -> str:
    """The inspect_model text: every PipeliningLayer's layers, costs and partitions.

    Args:
      name: the model name, for the heading.
      task_params: the (overridden) task params; nothing is instantiated.
      extra_num_cells: further K values to report partitions for (--inspect_num_cells).
      read_input: weigh length buckets by the training input's bucket distribution (reads
        its data) when the pipeline does not set input_bucket_weights.
    """
    pipelines = list(pipelining_layer.iter_pipelining_params(task_params))
    lines = [f"Model {name} (task {task_params.cls.__name__}): "
             f"{len(pipelines)} PipeliningLayer(s)"]
    if not pipelines:
        lines.append("No PipeliningLayer in the task params: there are no layer costs to show.")
        return "\n".join(lines) + "\n"
    total = {"num_params": 0, "non_trainable_params": 0, "training_only_params": 0}
    for path, p in pipelines:
        text, counts = describe_pipeline(
            path, p, extra_num_cells,
            task_params.input if read_input and "input" in task_params else None)
        lines += ["", text]
        for key in total:
            total[key] += counts[key]
    non_trainable = total["non_trainable_params"]
    trainable = total["num_params"] - non_trainable
    lines += ["", f"Total parameters in PipeliningLayers: {format_count(total['num_params'])}",
              f"  trainable: {format_count(trainable)}",
              f"  non-trainable (e.g. batch-norm moving statistics): "
              f"{format_count(non_trainable)}"]
    if total["training_only_params"]:
        aux = total["training_only_params"]
        lines.append(f"  trainable, used only in training (auxiliary heads): {format_count(aux)}; "
                     f"trainable without them: {format_count(trainable - aux)}")
    return "\n".join(lines) + "\n"
