"""Renders BENCHMARKS.md from the results `run_all.py` collected (pure Python, no TensorFlow).

Verdicts (met / missed) are computed from the numbers; the explanations of misses are the
findings of profiling this code on this machine (see NOTES), kept next to the renderer so that
a re-run rewrites the file without losing them.
"""

from __future__ import annotations

import datetime
import glob
import os
import re
import statistics

MIB = 2.0**20
K = 2

# Findings that explain the numbers; written from profiles of the recorded run.
NOTES = {
    "speedup": """\
Why the shared-pool numbers above fall short of 2T/(T+1) (measured on an idle machine,
2026-11-22; figure 1a shows the same pipeline on serial devices):
- **The naive baseline is not sequential here.** Logical CPU devices share one inter-op
  pool, so while naive model parallelism (K=2, T=1) runs one cell, that cell's independent
  ops (Q/K/V projections, the input- and weight-gradient matmuls of the backward) use the
  other core too. Figure 1a measures it: the naive baseline runs about 1.5x faster on the
  shared pool than on serial devices, i.e. it already uses ~1.5 of the 2 cores, which caps
  any pipeline at ~2/1.5 = 1.3x over it. An accelerator runs one op at a time, so GPipe's
  baseline has no such head start.
- **Kernels do not slow down when both devices run.** Profiled side by side on an idle
  machine, matmul and einsum kernels took 1.02-1.03x longer with both cores busy than with
  one (an earlier version of this file blamed shared caches; that run was disturbed by other
  processes on the 2 cores).
- **Recomputation is extra work the baseline does not do.** With remat='except_last' every
  cell recomputes all micro-batches but the last, while the naive baseline (T=1) has a single
  micro-batch and recomputes nothing. Figure 1a compares like with like (the same remat policy
  on both sides), which is what 2T/(T+1) assumes.
- **Micro-batching itself is free**: at K=1 (no parallelism) T=8 runs as fast as T=1 (table
  below), so neither the split nor per-micro-batch gradient accumulation is the limit.
- **AmoebaNet**: the FLOPs cost misses that batch norm, pooling and small convolutions at
  high resolution (cell 0) cost more time per FLOP (figure 7: measured busy-time imbalance
  1.3x for a FLOPs imbalance of 1.06x), and its small micro-batches make per-op overhead
  dominate as T grows.
- **Weight-heavy** (4 x 2048x2048 dense, batch 64): per micro-batch, the weight-gradient
  matmul reads and writes a full 16 MiB weight-sized gradient whatever the micro-batch size,
  and the T gradients are summed: the work grows with T, so pipelining loses.
What would close the remaining gaps: for AmoebaNet, partition costs calibrated from a profiled
step instead of FLOPs; for weight-heavy layers, accumulating a cell's weight gradient once
from the saved micro-batch inputs instead of T weight-sized gradients.""",
    "speedup_serial": """\
`PipeliningLayer.serial_devices=True` runs every forward and backward of a cell as one
function on TensorFlow's single-threaded executor: each logical device then executes one op
at a time, like an accelerator's compute stream, while the two devices still overlap
(tests/e2e/serial_devices_test.py checks both behaviours). Gradients are unchanged. Each remat
policy is compared with naive model parallelism (K=2, T=1) under the same policy, so the
work per example is the same on both sides and GPipe's ideal 2T/(T+1) applies; GPipe itself
always re-materialises (`always`). `except_last` at T=1 recomputes nothing while at T>1 it
recomputes T-1 of T micro-batches, so its ratio also pays for the memory it saves. The
profiler cannot see inside the serial cell calls, so the last column infers the devices' mean
idle fraction from step times: one serial device (K=1) running the same T micro-batches
without recomputation does the total work W(T) that the K devices share, so their mean idle
fraction is 1 - W(T) / (K x step time). W(T) is not constant (column "work"): where
micro-batches of moderate size run faster per example than the whole batch, a ratio against
T=1 can exceed 2T/(T+1). Figure 6 measures idle time per device from op traces, on the
shared pool.""",
    "overhead": """\
The pipeline at K=1, T=1 without remat emits the same forward ops as the plain step, one
GradientTape per cell with explicit output gradients, and a `tf.identity`/control-dependency
chain; any extra time is that bookkeeping.""",
    "remat": """\
At K=1, T=1 the only micro-batch's backward directly follows its forward, so `except_last`
recomputes nothing by construction and the target is met trivially; the real cost of
recomputation is `always` vs `never` (one extra forward per layer, about +1/3 of F+B, i.e. an
expected ratio near 0.75-0.8, the paper's 0.80). At K=2, T=4, `except_last` recomputes 3 of
the 4 micro-batches on each cell. To reach >= 0.85 while recomputing, recompute only what is
expensive to keep and cheap to redo (layer norms, activations, attention softmax) and keep
matmul outputs -- selective recomputation, which the executor does not offer (it recomputes
whole cells).""",
    "memory": """\
Method: BFC allocator (`TF_CPU_ALLOCATOR_USE_BFC=true`), all logical devices share one
allocator so the numbers are totals over the K=2 devices. Weights and optimizer state exist
before the step; the step's peak above that baseline holds the summed gradients (one per
weight, = weight bytes) plus activations; activations = peak - gradient bytes. Model: 16 dense
tanh layers of width 64 on N=2048 examples (activations dominate, as in the paper's large-batch
regime); a = N x 64 x 4 bytes is one layer's output. GPipe's O(N + L/K x N/T) per device sums
over K devices to K x N + L x N/T, i.e. K + L/T units of a (times the number of tensors a layer
keeps, fitted from `never` at T=1). Peaks still vary between runs (up to ~15% at T=1): within
a cell, the executor may run the chain of input gradients ahead of the weight gradients, which
keeps those layers' inputs and output gradients alive a little longer.

Across cells that effect was larger and is now prevented: B(k-1, t) waits for the whole of
B(k, t), weight gradients included (tests/unit/pipeline/pipeline_test.py,
BackwardOrderTest). Before, cell k-1 could start recomputing while cell k's weight gradients
were still pending, so both cells' activations were alive at once: four repeated T=1
measurements (2026-11-23) gave `always` 6.3-15.2 MiB and `never` 8.3-13.2 MiB of activations;
with the wait, 5.7-6.4 and 8.4-9.6.

`except_last` keeps the activations only of the micro-batch whose backward directly follows
its forward on the cell's device (with the `gpipe` schedule: the last micro-batch of each
cell) and recomputes the other T-1, so from T=2 on its activations track `always` (one
micro-batch more per cell at most) while it saves that micro-batch's recomputation; at T=1 it
recomputes nothing and holds what `never` holds.

The ratio depends on how many ops run at once. This figure runs with inter-op 2, so two ops of
one logical device can run together, which an accelerator's stream does not do: measured
2026-11-24 with `bench/remat_memory.py --num_layers=16 --num_cells=2 --num_micro_batches=8`,
`never` / `always` was 8.4 / 2.5 MiB (3.3x) at inter-op 2 and 8.5 / 1.7 MiB (5.0x) with
`--inter_op_threads=1` (two runs each), as section 9 measures per device. Recorded runs before
the cells became traced-once functions gave 4.96x at inter-op 2.""",
    "fits": """\
Method (measured, not modelled): a K=1 pipeline with remat='always' and T micro-batches holds
exactly what one device of a balanced K-cell GPipe pipeline holds (its weights, gradients,
momentum slots, its input boundary for all T micro-batches, and one micro-batch's activations
while it recomputes and back-propagates). Its BFC peak (process total = one device) is
measured at increasing depths; "fits" = peak <= budget. The pipeline's K devices then hold K
such cells. Not counted: the copy of a boundary tensor received from the previous device
(N/T x S x D floats per micro-batch in flight), small next to the budget. Naive = plain
training without micro-batches or recomputation on one device.""",
    "bubble": """\
Measured with the TF profiler (op start/end times) on one profiled step per T, mapped to
cells through the executor's name scopes. Device idle = fraction of the pipelined phase (first
to last cell op) in which no op of that cell runs; it includes load imbalance and time lost to
other processes on the shared cores, which GPipe's (K-1)/(T+K-1) does not model. `bubble` is
the part the busiest device also waits (pipeline fill/drain and dependency waits).

Why T=16 misses (boxes of the second profiled transformer step at T=16 of the 2026-11-23
13:03 run, 694 ms): device 0 finishes its 16 forwards at 115 ms, but device 1's forwards (the
loss, and the taped last micro-batch) end at 151 ms and its first backward at 173 ms, so
device 0 waits 58 ms before its first backward. In the drain, a micro-batch's recompute +
backward takes device 1 30.5 ms and device 0 28.7 ms (busy time / 16), so device 0 waits a
little on each: its idle fraction of the pipelined phase is 0.178, device 1's 0.115. GPipe's
(K-1)/(T+K-1) = 0.059 assumes every cell's forward and backward take equal time; here the
differences are paid per micro-batch, so their share does not shrink with T while the
theoretical bubble does. Added to that, on the shared pool a lone cell's ops spread over both
cores during fill and drain (figure 1 notes), so the busy fractions here are not those of
one-op-at-a-time devices. Closing it needs phase-balanced cells (equal forward and equal
backward time per cell), e.g. partition costs measured from a profiled step rather than
FLOPs.""",
    "partition": """\
Cost-model imbalance = max/mean of FPropMeta FLOPs per cell for the partition the
PipeliningLayer would compute (min_max objective, exact DP). Measured imbalance = max/mean of
the devices' busy time in a profiled step (K=2, T=1; with one micro-batch `except_last`
recomputes nothing): it counts ops whose time is not proportional to FLOPs (batch norm,
pooling, small convs), and the taped forward of the last cell.""",
}


def _fmt_s(x: float) -> str:
    return f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def _mib(x: float) -> str:
    return f"{x / MIB:.2f}"


def _verdict(ok: bool | None) -> str:
    if ok is None:
        return "n/a"
    return "**met**" if ok else "**missed**"


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _error_block(name: str, result: dict) -> list[str]:
    return [f"_{name} failed_: `{result.get('error', '')[:500]}`", ""]


def _one_device_median(entries: list[dict]) -> float | None:
    samples = []
    for e in entries:
        if "times" in e:
            samples += e["times"]["K1_T1"]["samples_s"]
    return _median(samples)


def _speedup_section(name: str, data: dict, targets: bool) -> tuple[list[str], dict]:
    pipe = data["pipeline"]
    lines = [f"### {name}", ""]
    summary = {}
    if "error" in pipe:
        return lines + _error_block(name, pipe), summary
    times = pipe["times"]
    base = times["K2_T1"]["median_s"]
    one = _one_device_median(data["one_device"])
    one_core = times["K1_T1_one_core"]["median_s"]
    lines += ["| config | median step | speedup vs naive MP (K=2,T=1) | ideal 2T/(T+1) | "
              "vs one device, both cores | vs one device, one core |",
              "|---|---|---|---|---|---|"]
    for key, value in times.items():
        if not key.startswith("K2_T"):
            continue
        t = int(key[4:])
        m = value["median_s"]
        ideal = 2 * t / (t + 1)
        summary[t] = base / m
        lines.append(f"| K=2, T={t} | {_fmt_s(m)} | {base / m:.2f}x | {ideal:.2f}x | "
                     f"{(one / m) if one else float('nan'):.2f}x | {one_core / m:.2f}x |")
    lines.append(f"| K=1, T=1, no remat, one core | {_fmt_s(one_core)} | "
                 f"{base / one_core:.2f}x | | | |")
    if one:
        lines.append(f"| K=1, T=1, no remat, both cores (intra-op 2) | {_fmt_s(one)} | "
                     f"{base / one:.2f}x | | | |")
    lines += ["", "Partition (K=2):", "", "```", pipe.get("partition", ""), "```", "",
              f"Reproduce: `{pipe['command']}` (and `{data['one_device'][0].get('command')}` "
              "for the one-device baseline).", ""]
    if targets and 8 in summary:
        lines += [f"Target >= 1.7x at T=8: {summary[8]:.2f}x -> {_verdict(summary[8] >= 1.7)}.",
                  ""]
    return lines, summary


def _serial_speedup_section(data: dict) -> tuple[list[str], dict]:
    """Figure 1a: speedup per remat policy on serial devices; returns {policy: {T: x}}."""
    lines = ["## 1a. Accelerator emulation: speedup on serial devices (transformer, K=2)", "",
             NOTES["speedup_serial"], ""]
    if "error" in data:
        return lines + _error_block("speedup_serial", data), {}
    times = {k: v["median_s"] for k, v in data["times"].items()}
    policies = ("never", "always", "except_last")
    ts = sorted({int(k.rsplit("_T", 1)[1]) for k in times if k.startswith("serial_")})
    has_work = all(f"work_never_K1_T{t}" in times for t in ts)
    lines += ["| T | ideal 2T/(T+1) | " + " | ".join(
        f"remat={p}: step / speedup" for p in policies)
        + " | theory (K-1)/(T+K-1) | work W(T), K=1 | inferred mean idle (never) |",
        "|---|---|" + "---|" * len(policies) + "---|---|---|"]
    summary: dict = {p: {} for p in policies}
    for t in ts:
        cells = []
        for p in policies:
            m, base = times[f"serial_{p}_K2_T{t}"], times[f"serial_{p}_K2_T1"]
            summary[p][t] = base / m
            cells.append(f"{_fmt_s(m)} / {base / m:.2f}x")
        # One serial device does all the work of T micro-batches one op at a time, so its
        # step time is the work W(T) the K devices share; their mean idle fraction at T is
        # then 1 - W(T) / (K x step).
        work = times.get(f"work_never_K1_T{t}")
        work_cells = "- | -"
        if has_work:
            idle = 1 - work / (K * times[f"serial_never_K2_T{t}"])
            work_cells = f"{_fmt_s(work)} | {idle:.3f}"
        lines.append(f"| {t} | {2 * t / (t + 1):.2f}x | " + " | ".join(cells)
                     + f" | {(K - 1) / (t + K - 1):.3f} | {work_cells} |")
    if has_work and 8 in ts:
        w1, w8 = times["work_never_K1_T1"], times["work_never_K1_T8"]
        bubble_only = w8 * (8 + K - 1) / (K * 8)
        lines += ["", f"Micro-batching on one serial device: W(8) / W(1) = {w8 / w1:.2f}x. A "
                  "pipeline that lost nothing but GPipe's bubble would take W(T) x (T+K-1) / "
                  f"(K x T) = {_fmt_s(bubble_only)} at T=8; remat=never takes "
                  f"{times['serial_never_K2_T8'] / bubble_only:.2f}x that."]
    serial, shared = times["serial_never_K2_T1"], times["shared_never_K2_T1"]
    lines += ["", f"Naive model parallelism (K=2, T=1, remat=never) on the shared inter-op pool: "
              f"{_fmt_s(shared)}, vs {_fmt_s(serial)} on serial devices: the shared pool lets "
              f"the 'sequential' baseline use {serial / shared:.2f} cores, so no pipeline can "
              f"beat it by more than {2 * shared / serial:.2f}x on 2 cores (figure 1).", "",
              f"Reproduce: `{data['command']}`", ""]
    return lines, summary


def _profile_rows(pipe: dict) -> list[tuple[int, dict]]:
    rows = []
    for t, prof in sorted(pipe.get("profiles", {}).items(), key=lambda kv: int(kv[0])):
        steps = prof["steps"]
        keys = steps[0].keys()
        med = {k: _median([s[k] for s in steps]) for k in keys}
        rows.append((int(t), med))
    return rows


def _bubble_section(results: dict) -> list[str]:
    lines = ["## 6. Bubble: measured idle fraction per device vs (K-1)/(T+K-1)", "",
             NOTES["bubble"], ""]
    for name in ("transformer", "amoebanet"):
        pipe = results.get(f"speedup_{name}", {}).get("pipeline", {})
        rows = _profile_rows(pipe)
        if not rows:
            continue
        lines += [f"### {name} (K=2)", "",
                  "| T | theory (K-1)/(T+K-1) | device 0 idle | device 1 idle | mean idle | "
                  "bubble share of pipelined phase | imbalance share | target mean idle <= "
                  "theory + 0.05 |", "|---|---|---|---|---|---|---|---|"]
        for t, m in rows:
            theory = (K - 1) / (t + K - 1)
            idle = [m["device_0_idle_in_pipeline"], m["device_1_idle_in_pipeline"]]
            pipe_frac = max(1.0 - m["setup"] - m["weight_update"], 1e-9)
            mean_idle = sum(idle) / len(idle)
            lines.append(
                f"| {t} | {theory:.3f} | {idle[0]:.3f} | {idle[1]:.3f} | {mean_idle:.3f} | "
                f"{m['bubble'] / pipe_frac:.3f} | {m['load_imbalance'] / pipe_frac:.3f} | "
                f"{_verdict(mean_idle <= theory + 0.05)} |")
        lines += ["", "Figure 4 breakdown of the step (fractions of step time, median of 3 "
                  "profiled steps):", "",
                  "| T | step | setup | compute | recompute | load imbalance | bubble | "
                  "weight update | kernel time (sum over devices) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for t, m in rows:
            lines.append(f"| {t} | {m['step_ms']:.0f} ms | {m['setup']:.3f} | "
                         f"{m['compute']:.3f} | {m['recompute']:.3f} | "
                         f"{m['load_imbalance']:.3f} | {m['bubble']:.3f} | "
                         f"{m['weight_update']:.3f} | "
                         f"{(m['device_0_busy'] + m['device_1_busy']) * m['step_ms']:.0f} ms |")
        lines.append("")
    return lines


def render(results: dict) -> str:
    m = results["machine"]
    when = datetime.datetime.fromtimestamp(results["started"], datetime.timezone.utc)
    minutes = (results["finished"] - results["started"]) / 60
    lines = [
        "# Benchmarks",
        "",
        "Written by `python bench/run_all.py" + (" --quick" if results["quick"] else "")
        + "`; every table, ratio and verdict below comes from that one recorded run (the "
        "explanatory notes cite the profiles and side measurements they were written from, "
        "with their dates). Re-run it to refresh this file (raw numbers: "
        "`bench/results.json`; re-render with "
        "`python bench/run_all.py --from_json bench/results.json`).",
        "",
        f"- Date: {when:%Y-%m-%d %H:%M} UTC; run took {minutes:.0f} min"
        + (" (quick mode)" if results["quick"] else ""),
        f"- Machine: {m['cores']} cores ({m['cpu']}), no GPU; Python {m['python']}, "
        f"TensorFlow {m['tensorflow']}",
        "- oneDNN: on (`TF_ENABLE_ONEDNN_OPTS=1`) for every figure, on both sides of every "
        "comparison (without it, the input-gradient matmul of small micro-batches is "
        "pathologically slow, see ../shared/TF_NOTES.md)",
        "- Threads: pipelines run on 2 logical CPU devices with intra-op 1 / inter-op 2 "
        "(one core per \"device\"); \"one device, both cores\" = 1 device, intra-op 2 / "
        "inter-op 2",
        "- Memory figures: BFC allocator (`TF_CPU_ALLOCATOR_USE_BFC=true`); timing figures: "
        "TensorFlow's default CPU allocator",
        f"- Load average (1/5/15 min) at start {tuple(round(x, 2) for x in m['load_start'])}, "
        f"at end {tuple(round(x, 2) for x in m.get('load_end', (0, 0, 0)))} (the benchmark "
        "itself keeps about 1 busy; more means other processes shared the 2 cores): absolute "
        "times are noisy, so ratios are measured side by side (interleaved rounds in one "
        "process), medians of 5 rounds",
        "- Optimizer in every timed step: momentum SGD applied on each weight's device",
        "",
    ]
    verdicts = []

    # 1. Speedup.
    lines += ["## 1. Pipeline speedup (K=2) vs naive model parallelism (K=2, T=1)", "",
              "Logical devices on the shared inter-op pool (intra-op 1, inter-op 2), as the "
              "issue prescribes: a cell may use both cores while the other idles, so this "
              "understates what pipelining buys on accelerators (figure 1a removes that). "
              "Default re-materialisation (`except_last`) for the pipelined runs; the one-device "
              "baselines train the same model without micro-batches or recomputation.", "",
              "Models: **transformer** = 8 pre-LN Transformer blocks (self-attention with 4 "
              "heads + FFN), D=128, FFN 512, 16 sequences x 256 tokens, per-token softmax "
              "(compute-heavy: long sequences); **amoebanet** = AmoebaNet-D (tasks/image) "
              "with 1 normal cell per stack, F=32, 32x32x3 images, batch 32; "
              "**weight_heavy** = 4 dense 2048x2048 tanh layers, batch 64.", ""]
    speedups = {}
    for name in ("transformer", "amoebanet", "weight_heavy"):
        data = results.get(f"speedup_{name}")
        if data is None:
            continue
        sec, summary = _speedup_section(name, data, targets=name == "transformer")
        speedups[name] = summary
        lines += sec
    serial = results.get("speedup_serial")
    serial_summary = {}
    time_verdict = None
    if serial is not None:
        sec, serial_summary = _serial_speedup_section(serial)
        lines += sec
        import time_model

        partition_text = results.get("speedup_transformer", {}).get("pipeline", {}).get(
            "partition", "")
        sec, time_verdict = time_model.render(serial, partition_text)
        lines += sec
    for policy in ("always", "never"):
        s8 = serial_summary.get(policy, {}).get(8)
        if s8 is not None:
            verdicts.append((f"1. Transformer speedup at T=8 >= 1.7x (serial devices, "
                             f"remat={policy} on both sides)", f"{s8:.2f}x", s8 >= 1.7))
    if 8 in speedups.get("transformer", {}):
        s8 = speedups["transformer"][8]
        verdicts.append(("1. Transformer speedup at T=8 >= 1.7x (shared inter-op pool, "
                         "except_last vs naive without recomputation)", f"{s8:.2f}x",
                         s8 >= 1.7))
    lines += ["### Why (figure 1)", "", NOTES["speedup"], ""]
    mc = results.get("microbatch_cost")
    if mc and "times" in mc:
        t = mc["times"]
        names = sorted(t, key=lambda n: int(n.split("_T")[1]))
        lines += ["Diagnostic: the same transformer at K=1 (no parallelism, no recomputation), "
                  "only split into micro-batches:", "",
                  "| config | median step | vs T=1 |", "|---|---|---|"]
        for n in names:
            lines.append(f"| K=1, T={n.split('_T')[1]} | {_fmt_s(t[n]['median_s'])} | "
                         f"{t[n]['median_s'] / t[names[0]]['median_s']:.2f}x |")
        lines += ["", f"Reproduce: `{mc['command']}`"
                  + (f" ({mc['note']})" if mc.get("note") else ""), ""]

    # 2. Overhead.
    lines += ["## 2. Framework overhead: K=1, T=1, no remat vs plain tf.function + "
              "GradientTape", ""]
    ov = results.get("overhead", {})
    if "error" in ov or not ov:
        lines += _error_block("overhead", ov)
    else:
        p = ov["times"]["pipeline"]["median_s"]
        q = ov["times"]["plain"]["median_s"]
        ratios = [a / b for a, b in zip(ov["times"]["pipeline"]["samples_s"],
                                        ov["times"]["plain"]["samples_s"])]
        lines += ["Model: 4 Transformer blocks (D=128, FFN 512, 8 x 128 tokens), same "
                  "weights and update on both sides.", "",
                  "| variant | median step |", "|---|---|",
                  f"| PipeliningLayer K=1, T=1, remat=never | {_fmt_s(p)} |",
                  f"| plain tf.function + GradientTape | {_fmt_s(q)} |", "",
                  f"Ratio (median of per-round ratios): {_median(ratios):.3f}x; target <= 1.05x "
                  f"-> {_verdict(_median(ratios) <= 1.05)}.", "",
                  NOTES["overhead"], "", f"Reproduce: `{ov['command']}`", ""]
        verdicts.append(("2. Framework overhead <= 1.05x", f"{_median(ratios):.3f}x",
                         _median(ratios) <= 1.05))

    # 3. Remat cost.
    lines += ["## 3. Re-materialisation cost: throughput with / without recomputation", ""]
    rc = results.get("remat_cost", {})
    if "error" in rc or not rc:
        lines += _error_block("remat_cost", rc)
    else:
        t = rc["times"]
        lines += ["Same 4-block Transformer. Throughput ratio = step time without "
                  "recomputation / step time with it (higher is better; paper 0.80, "
                  "torchgpipe 0.85).", "",
                  "| config | never | except_last | always | except_last / never | "
                  "always / never |", "|---|---|---|---|---|---|"]
        for kt in ("K1_T1", "K2_T4"):
            nv = t[f"{kt}_never"]["median_s"]
            el = t[f"{kt}_except_last"]["median_s"]
            al = t[f"{kt}_always"]["median_s"]
            lines.append(f"| {kt.replace('_', ', ').replace('K', 'K=').replace('T', 'T=')} | "
                         f"{_fmt_s(nv)} | {_fmt_s(el)} | {_fmt_s(al)} | {nv / el:.3f} | "
                         f"{nv / al:.3f} |")
        k1_el = t["K1_T1_never"]["median_s"] / t["K1_T1_except_last"]["median_s"]
        k1_al = t["K1_T1_never"]["median_s"] / t["K1_T1_always"]["median_s"]
        k2_el = t["K2_T4_never"]["median_s"] / t["K2_T4_except_last"]["median_s"]
        lines += ["", f"Target >= 0.85 at K=1 with `except_last` (the default): {k1_el:.3f} -> "
                  f"{_verdict(k1_el >= 0.85)}; honest cost of recomputing everything (K=1, "
                  f"`always`): {k1_al:.3f} -> {_verdict(k1_al >= 0.85)}; pipelined K=2, T=4 "
                  f"with `except_last`: {k2_el:.3f} -> {_verdict(k2_el >= 0.85)}.", "",
                  NOTES["remat"], "", f"Reproduce: `{rc['command']}`", ""]
        verdicts.append(("3. Remat throughput ratio >= 0.85 (K=1, except_last)",
                         f"{k1_el:.3f} (always: {k1_al:.3f}; K=2,T=4 except_last: "
                         f"{k2_el:.3f})", k1_el >= 0.85))

    # 4. Memory.
    lines += ["## 4. Memory: weights, gradients/optimizer state, activations", ""]
    mem = results.get("memory", {})
    if "error" in mem or not mem:
        lines += _error_block("memory", mem)
    else:
        by_t = {int(k): v for k, v in mem["by_T"].items()}
        first = by_t[min(by_t)]
        a = first["layer_activation_bytes"]
        num_layers = first["config"]["layers"]
        c = first["activation_bytes"]["never"] / (num_layers * a)
        lines += [NOTES["memory"], "",
                  f"Weights: {_mib(first['weight_bytes'])} MiB; gradients: "
                  f"{_mib(first['grad_bytes'])} MiB; a = {_mib(a)} MiB; fitted tensors per "
                  f"layer c = {c:.2f}.", "",
                  "| T | activations never (MiB) | except_last | always | never / always | "
                  "measured always / a | GPipe model K + c*L/T |",
                  "|---|---|---|---|---|---|---|"]
        for t, r in sorted(by_t.items()):
            act = r["activation_bytes"]
            ratio = act["never"] / max(act["always"], 1)
            lines.append(f"| {t} | {_mib(act['never'])} | {_mib(act['except_last'])} | "
                         f"{_mib(act['always'])} | {ratio:.2f}x | {act['always'] / a:.2f} | "
                         f"{K + c * num_layers / t:.2f} |")
        if 8 in by_t:
            act = by_t[8]["activation_bytes"]
            ratio = act["never"] / max(act["always"], 1)
            lines += ["", f"Target: activations >= 4x smaller with recomputation at K=2, T=8: "
                      f"{ratio:.2f}x -> {_verdict(ratio >= 4)}.", ""]
            verdicts.append(("4. Activations >= 4x smaller with remat (K=2, T=8)",
                             f"{ratio:.2f}x", ratio >= 4))
        lines += [f"Reproduce: `{mem['command']}` (one T: `python bench/remat_memory.py "
                  "--num_layers=16 --num_cells=2 --num_micro_batches=8`)", ""]

    # 5. Fits.
    lines += ["## 5. Largest model that fits a fixed memory budget per device", ""]
    fits = results.get("fits", {})
    if "error" in fits or not fits:
        lines += _error_block("fits", fits)
    else:
        budget = fits["budget_bytes"]
        cfg = fits["configs"]
        naive = cfg["naive (K=1, T=1, no remat)"]
        cell = cfg["pipeline cell (T=8, remat)"]
        block_params = _params_per_block(cell) or _params_per_block(naive)
        lines += [NOTES["fits"], "",
                  f"Budget: {_mib(budget)} MiB per device. Model family: Transformer blocks of "
                  f"D=128, FFN 512, 4 heads ({block_params / 1e6:.3f}M parameters each), 16 "
                  "sequences x 128 tokens, momentum SGD.", "",
                  "| setup | devices | blocks per device | total blocks | parameters | "
                  "measured peak per device (MiB) | bytes per block (MiB) |",
                  "|---|---|---|---|---|---|---|"]
        rows = [("naive, one device", 1, naive)] + [
            ("GPipe pipeline, T=8, remat", k, cell) for k in (2, 4, 8)]
        base_blocks = max(naive["max_blocks"], 1)
        for label, k, entry in rows:
            n = entry["max_blocks"]
            peak = entry["measurements"].get(str(n), entry["measurements"].get(n, {}))
            total = k * n
            lines.append(f"| {label} | {k} | {n} | {total} (x{total / base_blocks:.1f}) | "
                         f"{total * block_params / 1e6:.2f}M | "
                         f"{_mib(peak.get('total', 0))} | {_mib(entry['per_block_bytes'])} |")
        lines += ["", "Measured points (blocks: per-device peak MiB): naive "
                  + _points(naive) + "; pipeline cell " + _points(cell) + ".", "",
                  f"Reproduce: `{fits['command']}`", ""]

    # 6. Bubble.
    lines += _bubble_section(results)
    bubble_ok = _bubble_verdict(results)
    if bubble_ok is not None:
        verdicts.append(("6. Mean device idle <= (K-1)/(T+K-1) + 0.05 (transformer, all T)",
                         bubble_ok[1], bubble_ok[0]))

    # 7. Partition.
    lines += ["## 7. Partition balance of every registered model (max/mean cell cost)", "",
              NOTES["partition"], ""]
    part = results.get("partition", {})
    if "error" in part or not part:
        lines += _error_block("partition", part)
    else:
        lines += ["| model | pipeline | layers | K=2 | K=4 | K=8 |", "|---|---|---|---|---|---|"]
        for row in part["rows"]:
            if "error" in row:
                lines.append(f"| {row['model']} | ({row['error']}) | | | | |")
                continue
            cells = []
            for k in (2, 4, 8):
                v = row.get(f"K{k}")
                if isinstance(v, float):
                    cells.append(f"{v:.3f} {tuple(row.get(f'K{k}_sizes', ()))}")
                else:
                    cells.append("-" if v is None else str(v))
            lines.append(f"| {row['model']} | {row['pipeline']} | {row['num_layers']} | "
                         + " | ".join(cells) + " |")
        lines += ["", "Cell sizes (layers per cell) in parentheses.", "",
                  "Cost model vs measurement for the benchmark models (K=2, T=1, profiled):", "",
                  "| model | cost-model imbalance | measured busy-time imbalance |",
                  "|---|---|---|"]
        for name in ("transformer", "amoebanet"):
            pipe = results.get(f"speedup_{name}", {}).get("pipeline", {})
            rows = dict(_profile_rows(pipe))
            if 1 not in rows:
                continue
            busy = [rows[1]["device_0_busy"], rows[1]["device_1_busy"]]
            match = re.search(r"imbalance \(max/mean\): ([0-9.]+)", pipe.get("partition", ""))
            lines.append(f"| {name} | {match.group(1) if match else '?'} | "
                         f"{max(busy) / (sum(busy) / 2):.2f} |")
        lines += ["", f"Reproduce: `{part['command']}`", ""]

    # 8. Scale-out.
    import scaleout

    lines += scaleout.render(results)

    if serial is not None and time_verdict is not None:
        verdicts.append(("16. Time model within 15% of the measured step (serial devices, "
                         "transformer, gpipe, K=2, T in {1, 4, 8}, every remat)",
                         f"worst {time_verdict[0]:.1%} (every T: {time_verdict[1]:.1%})",
                         time_verdict[2]))

    # Summary first.
    summary = ["## Targets", "", "| target | measured | verdict |", "|---|---|---|"]
    for name, value, ok in verdicts:
        summary.append(f"| {name} | {value} | {_verdict(ok)} |")
    summary.append("")
    first_figure = next(i for i, line in enumerate(lines) if line.startswith("## 1."))
    head, body = lines[:first_figure], lines[first_figure:]
    return "\n".join(head + summary + body + separate_figures()).rstrip() + "\n"


SEPARATE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "separate")


def separate_figures() -> list[str]:
    """Figures recorded by their own scripts (bench/separate/*.md, each with its date and
    command), kept when this file is re-rendered."""
    lines: list[str] = []
    for path in sorted(glob.glob(os.path.join(SEPARATE_DIR, "*.md"))):
        with open(path) as f:
            lines += ["", f.read().rstrip()]
    return lines


def _params_per_block(entry: dict) -> int:
    ms = entry.get("measurements", {})
    one, two = ms.get("1") or ms.get(1), ms.get("2") or ms.get(2)
    if one and two:
        return two["params"] - one["params"]
    return 0


def _points(entry: dict) -> str:
    items = sorted(((int(k), v["total"]) for k, v in entry["measurements"].items()))
    return ", ".join(f"{n}: {_mib(b)}" for n, b in items)


def _bubble_verdict(results: dict) -> tuple[bool, str] | None:
    pipe = results.get("speedup_transformer", {}).get("pipeline", {})
    rows = _profile_rows(pipe)
    if not rows:
        return None
    worst, parts = 0.0, []
    for t, m in rows:
        theory = (K - 1) / (t + K - 1)
        mean_idle = (m["device_0_idle_in_pipeline"] + m["device_1_idle_in_pipeline"]) / 2
        worst = max(worst, mean_idle - theory)
        parts.append(f"T={t}: {mean_idle:.2f} vs {theory:.2f}")
    return worst <= 0.05, "; ".join(parts)


DOCS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                        "benchmarks")


TARGET_PREFIX = "Target: "


def _slug(title: str) -> str:
    words = re.sub(r"\(.*?\)", "", title.split(". ", 1)[-1]).lower()
    return "_".join(re.findall(r"[a-z0-9]+", words)[:6])


def split_report(text: str) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """(run description, targets table, {file name: lines}) of a rendered report: one file per
    numbered figure, its lettered sub-figures (1a, 1b) with it."""
    lines = text.splitlines()
    head: list[str] = []
    targets: list[str] = []
    files: dict[str, list[str]] = {}
    current: list[str] = head
    for line in lines:
        match = re.match(r"^## (\d+)[a-z]?\. (.*)", line)
        if line.startswith("## Targets"):
            current = targets
        elif match:
            number = int(match.group(1))
            name = next((n for n in files if n.startswith(f"{number:02d}_")), None)
            if name is None:
                name = f"{number:02d}_{_slug(line[3:])}.md"
                files[name] = []
            current = files[name]
        current.append(line)
    return head, targets, files


def write_reports(text: str, root: str) -> None:
    """BENCHMARKS.md as one screen (the targets and their verdicts, links to the details) and
    one file per figure under docs/benchmarks/, from a rendered report."""
    head, targets, files = split_report(text)
    os.makedirs(DOCS_DIR, exist_ok=True)
    with open(os.path.join(DOCS_DIR, "README.md"), "w") as f:
        f.write("# How the benchmarks were measured\n\n" + "\n".join(head[1:]).strip() + "\n")
    for name, body in files.items():
        with open(os.path.join(DOCS_DIR, name), "w") as f:
            f.write("\n".join(body).strip() + "\n")
    links, headlines = [], []
    for name in sorted(os.listdir(DOCS_DIR)):
        if not name.endswith(".md") or name == "README.md":
            continue
        with open(os.path.join(DOCS_DIR, name)) as f:
            lines = f.read().splitlines()
        title = lines[0].lstrip("# ").strip()
        links.append(f"- [{title}](docs/benchmarks/{name})")
        number = title.split(".")[0]
        # A figure recorded by its own script states its targets as 'Target: what | measured |
        # verdict' lines; they join the headline table.
        headlines += [f"| {number}. {line[len(TARGET_PREFIX):].strip()} |" for line in lines
                      if line.startswith(TARGET_PREFIX) and line.count(" | ") == 2]
    targets = targets[:-1] + headlines + targets[-1:] if targets and not targets[-1] else \
        targets + headlines
    screen = ["# Benchmarks", "",
              "Ratios measured side by side in one run on a 2-core CPU machine with logical "
              "devices standing in for accelerators; how, when and on what: "
              "[docs/benchmarks/README.md](docs/benchmarks/README.md). Each target with its "
              "figure and verdict:", "", *targets[2:], "## Details, one file per figure", "",
              *links]
    with open(os.path.join(root, "BENCHMARKS.md"), "w") as f:
        f.write("\n".join(screen).rstrip() + "\n")


def record_separate(name: str, title: str, body: list[str], command: str) -> str:
    """Writes bench/separate/<name>.md (title, date and load, body, how to reproduce) and
    re-renders BENCHMARKS.md from bench/results.json with it. Returns the section's path."""
    import json
    import platform

    os.makedirs(SEPARATE_DIR, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    load = tuple(round(x, 2) for x in os.getloadavg())
    text = [f"## {title}", "",
            f"Recorded {now:%Y-%m-%d %H:%M} UTC by its own script on {os.cpu_count()} cores "
            f"(Python {platform.python_version()}); load average at the end {load}.", "",
            *body, "", f"Reproduce: `{command}`"]
    path = os.path.join(SEPARATE_DIR, f"{name}.md")
    with open(path, "w") as f:
        f.write("\n".join(text) + "\n")
    root = os.path.dirname(os.path.dirname(SEPARATE_DIR))
    with open(os.path.join(root, "bench", "results.json")) as f:
        results = json.load(f)
    write_reports(render(results), root)
    return path
