"""Model analysis from params alone: per-layer costs and pipeline partitions, no weights.

`describe_model` is what `trainer.py --mode=inspect_model` prints and what training writes to
`<logdir>/model_analysis.txt`. It only calls the layers' `FPropMeta` cost models and the
partitioner, so it takes seconds even for models far too large to allocate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_lite import base_layer, hyperparams
from lingvo_lite.analysis import simulator
from lingvo_lite.nested_map import NestedMap
from lingvo_lite.pipeline import micro_batch, partition, pipelining_layer
from lingvo_lite.training import model_config

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
                      extra_num_cells: Sequence[int] = ()) -> tuple[str, dict[str, int]]:
    """Per-layer table and partition report(s) of one PipeliningLayer params.

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
    num_micro = _num_micro_batches(p)
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
        if profile is not None and num_micro is not None:
            forward = [t.forward_s * num_micro for t in profile.layers]
            ratio = (sum(t.backward_s for t in profile.layers)
                     / max(sum(t.forward_s for t in profile.layers), 1e-12))
            prediction = simulator.predict(part, forward, num_micro, p.schedule, p.remat,
                                           backward_ratio=ratio,
                                           virtual_stages=p.virtual_stages)
            lines += [f"Predicted step (schedule simulator; time = measured forward seconds, "
                      f"backward = {ratio:.2f} x forward, transfers free):",
                      "  " + prediction.summary()]
        elif metas is not None and num_micro is not None:
            prediction = simulator.predict(part, [m.flops for m in metas], num_micro,
                                           p.schedule, p.remat, virtual_stages=p.virtual_stages)
            lines += ["Predicted step (schedule simulator; time = forward FLOPs, backward = "
                      "2 x forward, transfers free):", "  " + prediction.summary()]
    if p.num_replicas > 1:
        lines += ["", _describe_mesh(p)]
    return "\n".join(lines), counts


def _measured_profile(p: hyperparams.Params, lines: list[str]) -> Any:
    """partition_cost='measured': appends the layers' measured times to `lines`; the profile
    (None, with the reason in `lines`, when the layers cannot be timed)."""
    from lingvo_lite.pipeline import layer_profile

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


def _num_micro_batches(p: hyperparams.Params) -> int | None:
    """T of a PipeliningLayer's params, when it can be known without a batch."""
    if p.micro_batch_size is None:
        return p.num_micro_batches or 1
    if p.input_shapes is None:
        return None
    shapes = base_layer.to_shape(p.input_shapes)
    leaf = shapes.Flatten()[0] if isinstance(shapes, NestedMap) else shapes
    try:
        return micro_batch.resolve_num_micro_batches(
            int(leaf[p.batch_dim]), p.num_micro_batches, p.micro_batch_size)
    except (ValueError, TypeError):
        return None


def _describe_mesh(p: hyperparams.Params) -> str:
    """Which device holds which replica's cell, for a local placement (see resolve_mesh)."""
    num_cells, num_replicas = p.num_cells, p.num_replicas
    per_device = max(1, getattr(p, "virtual_stages", 1))
    num_devices = num_cells // per_device
    shape = (f"{num_cells} cells" if per_device == 1
             else f"{num_devices} devices of {per_device} cells each (interleaved)")
    lines = [f"Mesh: {num_replicas} data-parallel replicas x {shape} = "
             f"{num_replicas * num_devices} devices (placement={p.placement!r}); cell k's "
             "gradients are all-reduced over the replicas on the cells' devices."]
    explicit = None if isinstance(p.placement, str) else list(p.placement)
    for r in range(num_replicas):
        cells = ", ".join(
            f"cell {k} -> " + (explicit[r * num_devices + k % num_devices] if explicit
                               else f"device {r * num_devices + k % num_devices}")
            for k in range(num_cells))
        lines.append(f"  replica {r}: {cells}")
    return "\n".join(lines)


def describe_model(name: str, task_params: hyperparams.Params,
                   extra_num_cells: Sequence[int] = ()) -> str:
    """The inspect_model text: every PipeliningLayer's layers, costs and partitions.

    Args:
      name: the model name, for the heading.
      task_params: the (overridden) task params; nothing is instantiated.
      extra_num_cells: further K values to report partitions for (--inspect_num_cells).
    """
    pipelines = list(model_config.iter_pipelining_params(task_params))
    lines = [f"Model {name} (task {task_params.cls.__name__}): "
             f"{len(pipelines)} PipeliningLayer(s)"]
    if not pipelines:
        lines.append("No PipeliningLayer in the task params: there are no layer costs to show.")
        return "\n".join(lines) + "\n"
    total = {"num_params": 0, "non_trainable_params": 0, "training_only_params": 0}
    for path, p in pipelines:
        text, counts = describe_pipeline(path, p, extra_num_cells)
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


def describe_params(config: model_config.ModelConfig, splits: Sequence[str] = ()) -> str:
    """The inspect_params text: task params (train input under `input.*`) and eval inputs."""
    parts = [f"# Task params of {config.name} (train input params under input.*)\n",
             config.task_params.ToText()]
    for split in splits:
        try:
            p = config.eval_input_params(split)
        except ValueError:
            continue
        parts += [f"\n# Input params of split {split!r}\n", p.ToText()]
    return "".join(parts)

