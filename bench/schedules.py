"""Schedules side by side: gpipe, 1f1b, interleaved, zero_bubble, zbv; batched weight gradients.

    python bench/schedules.py                      # the recorded run (~10 min on 2 cores)
    python bench/schedules.py --quick              # smaller shapes, fewer T and rounds
    python bench/schedules.py --schedules=zero_bubble,interleaved,zbv --micro_batches=2,4,8 \
        --models=transformer --no_co_run --no_weight_heavy    # ZB-V next to its neighbours

Two figures, each in a fresh process with K logical CPU devices (intra-op 1, inter-op K):

- `speedup`: on serial devices (the accelerator emulation), every schedule at every T, timed in
  interleaved rounds against naive model parallelism (gpipe, T=1). Each configuration is also
  profiled, on the shared pool (TensorFlow's single-threaded executor, which serial devices use,
  emits no per-op profiler events): the measured mean idle fraction of the devices during the
  pipelined phase (each cell's ops counted on the schedule's device for it, `cell_devices`)
  stands next to the schedule's theoretical bubble (its unit-time timeline's idle share).
  interleaved puts 2 cells on each device (virtual_stages=2); zbv (ZB-V) too, device d
  holding cells d and 2K-1-d; zero_bubble's and zbv's B records the inputs and output
  gradients of the weight ops and W computes their weight gradients from them. The same
  model on one serial device (K=1, T=1) is the speedup's second baseline (`--one_device`).
  Every row also shows the time model's step (issue 16,
  `time_model.predicted_from_phase_costs`): the schedule simulated with each action's duration
  measured on its own (every cell's forward, backward, input-only and weight-gradient calls,
  and the forward-plus-gradient of a micro-batch that keeps its activations, at the micro-batch
  size, on its serial device, chained in one step as many times as a pipeline step runs
  them) plus the optimizer's update. Each of those calls is also timed beside a copy of
  itself on another device (`--no_co_run` skips it): the ratio is its co-run slowdown, how
  much longer it takes while another core is busy (the cores share the host's memory
  bandwidth; `shared_processors.CoRunSlowdown`), and the rows show the model with and without it.
  The twins double the figure's memory: at K=2 with T up to 16, AmoebaNet's worker grew past
  this project's 24 GiB machine, so time the co-run factors there at fewer T (`--micro_batches
  =4,8`) or not at all.
- `weight_heavy`: 4 dense 2048x2048 layers on a batch of 64, gpipe with per-micro-batch vs batched
  weight gradients, against naive model parallelism, on serial devices and on the shared pool.

All numbers in a figure come from one process, so the ratios compare like with like.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_lib  # noqa: E402

# (schedule, cells per device): K devices run K x v cells.
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1), ("zbv", 2))
REMAT = "except_last"


def _idle_per_device(events, sched) -> float:
    """Mean over devices of their idle share of the pipelined phase (first to last cell op),
    each cell's ops on the device `sched` places it on."""
    from lingvo_lite.analysis import trace_analysis

    breakdown = trace_analysis.compute_breakdown(events, cell_devices=sched)
    return statistics.mean(breakdown.device_idle_in_pipeline)


def _profile(fn, batch, sched, steps: int = 3) -> float:
    return statistics.median(
        _idle_per_device(events, sched)
        for events in bench_lib.profiled_steps(fn, batch, steps)[0])


PHASES = ("forward", "bprop", "input_only", "wgrad", "kept", "kept_input_only")


def chain_length(kind: str, num_micro_batches: int) -> int:
    """How many calls of phase `kind` one timed step chains: as many as a pipeline step runs
    per cell (T), or one for a kept micro-batch (with remat 'except_last', GPipe keeps one per
    cell)."""
    return 1 if kind.startswith("kept") else num_micro_batches


def _phase_calls(pipe, batch, num_micro_batches: int) -> dict[str, object]:
    """Each cell's calls as traced functions of their own, to be timed on the cell's serial
    device at the micro-batch size of T: `{phase}_{k}` for every phase of PHASES and cell k,
    `update` and `update_cell_{k}`. A `{phase}_{k}` step runs `chain_length(phase, T)` calls,
    each after the one before, on micro-batches 0, 1, ...; its time / chain_length is the
    phase's cost.

    Phases: `forward` (the cell's fprop call), `bprop` (the re-computing backward call: forward
    re-run, input and weight gradients added to sums), `input_only` (B of a split backward:
    the same with the weight gradients of `weight_ops` deferred, their records returned),
    `wgrad` (W: those weight gradients computed from B's records), `kept` (F and B of a
    micro-batch that keeps its activations, as the executor runs them: the forward under a
    tape, its gradient, the weight gradients added to sums) and `kept_input_only` (the same
    as a split backward's B); `update`: momentum SGD on all the weights, `update_cell_{k}` on
    cell k's (each device updates its own weights once its gradients are final). The kept pair
    is timed as one: alone, a forward under a tape whose gradient is never taken measured as fast
    as the plain forward. Boundary inputs come from the layers of the cells before, run
    eagerly.

    Why chains: a call timed as a step of its own pays a top-level dispatch that the calls
    inside a pipeline's step share (AmoebaNet cells at a micro-batch of 4: 0.5-1.2 ms on 3-6
    ms forwards), and a call costs more when it is the first of its kind in a step: AmoebaNet
    cell 0's kept pair, chains of 1, 2, 4: 39, 54, 64 ms. So each phase is timed as the
    pipeline runs it; timed as 4 calls, kept pairs too, the model under-predicted the
    Transformer's naive MP step (T=1, one kept pair per cell) by 48%.
    """
    import tensorflow as tf

    from lingvo_lite.core import fprop_context
    from lingvo_lite.layers import weight_ops
    from lingvo_lite.pipeline import cell_functions, micro_batch, tf_private

    run = pipe._executor(0)  # noqa: SLF001 (a benchmark reaching into the layer's parts)
    serial = run._serial  # noqa: SLF001
    thetas = pipe._cell_thetas(pipe.theta)  # noqa: SLF001
    xs = micro_batch.split(batch, num_micro_batches)
    offset = tf.constant(0, tf.int64)
    calls = {}
    records = {}  # (cell, prepared micro-batch) -> B's records, W's inputs.

    def scalar(values) -> tf.Tensor:
        return tf.add_n([tf.reduce_sum(tf.cast(v, tf.float32)) for v in values
                         if v is not None])

    def make(kind, k, cell, prepared_inputs, dy, sums, seed):
        length = chain_length(kind, num_micro_batches)

        def call(prepared) -> list:
            if kind == "forward":
                out, _, _ = cell.forward(thetas[k], prepared, offset, seed)
                return cell_functions.flatten(out)
            if kind.startswith("kept"):
                return kept(kind, k, cell, prepared, dy, sums, seed)
            if kind == "wgrad":
                return cell.weight_gradient(thetas[k], records[(k, id(prepared))], sums)
            split = kind == "input_only"
            dx, new, recs = cell.backward_with_records(
                thetas[k], prepared, dy, [None] * len(sums) if split else sums, offset, seed,
                need_dx=k > 0, defer_weight_grads=split)
            return list(dx) + list(new) + [t for r in recs for t in (r.x, r.dy)]

        @tf.function(autograph=False)
        def fn(_):
            outs = []
            with fprop_context.fprop_context(training=True, step_seed=1, batch_dim=0), \
                    pipe._cell_scope(k):  # noqa: SLF001
                for i in range(length):
                    with tf.control_dependencies([v for v in outs if v is not None]):
                        outs = call(prepared_inputs[i])
                return scalar(outs)
        return fn

    def kept(kind, k, cell, prepared, dy, sums, seed) -> list:
        # As Executor._train_forward / _train_backward run a kept micro-batch (cell 0's input
        # needs no gradient); a split backward's B defers the weight_ops weight gradients.
        xs = [v for v in prepared.leaves if cell_functions.is_float(v)] if k else []
        weights = [v for v in thetas[k].Flatten() if cell_functions.is_trainable(v)]
        split = kind == "kept_input_only"
        tape = tf.GradientTape(watch_accessed_variables=False)
        with tape, (weight_ops.deferring(weights) if split and not serial
                    else contextlib.nullcontext()) as stash:
            tape.watch(xs + weights)
            out, _, _ = cell.forward(thetas[k], prepared, offset, seed, inline=not serial)
        ys, dys = cell_functions.float_outputs_and_gradients(out, cell_functions.flatten(dy))
        with tf_private.serial_function_calls(serial):
            grads = tape.gradient(ys, xs + weights, output_gradients=dys,
                                  unconnected_gradients=tf.UnconnectedGradients.NONE if split
                                  else tf.UnconnectedGradients.ZERO)
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        grads[len(xs):] = cell.accumulate([None] * len(sums) if split else sums,
                                          grads[len(xs):])
        recs = stash.records if stash is not None else []
        return grads + [t for r in recs for t in (r.x, r.dy)]

    def split_records(k, cell, prepared, dy, sums, seed) -> list:
        """B's records of one micro-batch, made once (W's inputs when timing W alone)."""
        made = []

        @tf.function(autograph=False)
        def fn():
            with fprop_context.fprop_context(training=True, step_seed=1, batch_dim=0), \
                    pipe._cell_scope(k):  # noqa: SLF001
                _, _, recs = cell.backward_with_records(
                    thetas[k], prepared, dy, [None] * len(sums), offset, seed, need_dx=False,
                    defer_weight_grads=True)
            made[:] = recs
            return [t for r in recs for t in (r.x, r.dy)]

        flat = fn()
        return [r.with_tensors(flat[2 * i], flat[2 * i + 1]) for i, r in enumerate(made)]

    with fprop_context.fprop_context(training=True, step_seed=1, batch_dim=0):
        seeds = run._step_seeds()  # noqa: SLF001
        for k, cell in enumerate(run._cells):  # noqa: SLF001
            with pipe._cell_scope(k):  # noqa: SLF001
                prepared_inputs = [cell.prepare(x) for x in xs]
                # The cell's layers run eagerly (calling the serial-device function eagerly
                # with an input from another device can deadlock, see cell_functions).
                ys = [pipe._chain_cell(thetas[k], k, x) for x in xs]  # noqa: SLF001
                y = ys[0]
                dy = y.Transform(lambda v: None if v is None or v.shape.rank == 0
                                 else tf.ones_like(v) if v.dtype.is_floating else None)
                if "loss" in y:
                    dy.loss = tf.constant(1.0 / num_micro_batches)
                sums = [tf.zeros_like(v) for v in thetas[k].Flatten()
                        if cell_functions.is_trainable(v)]
            for prepared in prepared_inputs:
                records[(k, id(prepared))] = split_records(k, cell, prepared, dy, sums, seeds[k])
            for kind in PHASES:
                calls[f"{kind}_{k}"] = make(kind, k, cell, prepared_inputs, dy, sums, seeds[k])
            xs = ys
    def update_of(variables):
        slots = [tf.Variable(tf.zeros_like(v)) for v in variables]

        @tf.function(autograph=False)
        def update(_):
            bench_lib._apply(variables, slots,  # noqa: SLF001
                             [tf.zeros_like(v) for v in variables], 1e-3, 0.9)
            return tf.constant(0.0)
        return update

    calls["update"] = update_of([v for v in pipe.vars.Flatten() if v.trainable])
    for k, theta in enumerate(thetas):
        calls[f"update_cell_{k}"] = update_of([v for v in theta.Flatten()
                                               if cell_functions.is_trainable(v)])
    return calls


def _side_by_side(fn, twin):
    """One step running `fn` and `twin` (the same calls on other devices) at once."""
    import tensorflow as tf

    @tf.function(autograph=False)
    def both(x):
        return fn(x) + twin(x)
    return both


def fig_speedup(args: argparse.Namespace) -> dict:
    from lingvo_lite.pipeline.schedules import schedule

    k = args.devices
    layers, shapes, make_batch = bench_lib.model(args.model, args.quick)
    batch = make_batch()
    remat = REMAT
    steps, meta = {}, {}
    naive = bench_lib.make_pipeline(layers, shapes, k, 1, remat, serial_devices=True)
    steps["naive"] = (bench_lib.pipeline_train_step(naive)[0], batch)
    meta["naive"] = dict(schedule="gpipe", T=1, v=1)
    if args.one_device:  # The whole model on one serial device: the speedup's own baseline.
        alone = bench_lib.make_pipeline(layers, shapes, 1, 1, remat, serial_devices=True)
        steps["one_device"] = (bench_lib.pipeline_train_step(alone)[0], batch)
    for t in args.micro_batches:
        for name, v in SCHEDULES:
            if args.schedules and name not in args.schedules:
                continue
            if len(layers) < k * v or (name == "interleaved" and t % k):
                continue
            pipe = bench_lib.make_pipeline(layers, shapes, k * v, t, remat, schedule=name,
                                           virtual_stages=v, serial_devices=True)
            key = f"{name}_T{t}"
            steps[key] = (bench_lib.pipeline_train_step(pipe)[0], batch)
            meta[key] = dict(schedule=name, T=t, v=v, theory=schedule.make_schedule(
                name, k * v, t, v).bubble_fraction())
    # The time model's inputs, timed in the same interleaved rounds as the steps: the cells of
    # each partition (K x v cells) alone at each micro-batch size; schedules with the same
    # cells share them.
    # Each call is also timed beside a copy of itself (a twin pipeline whose cell c sits on
    # the next device): how much slower it runs while another core is busy, the time model's
    # co-run slowdown (cores share the host's memory bandwidth).
    groups = sorted({(k * m["v"], m["T"]) for m in meta.values()})
    for cells, t in groups:
        pipe = bench_lib.make_pipeline(layers, shapes, cells, t, remat, serial_devices=True)
        calls = _phase_calls(pipe, batch, t)
        if args.co_run:
            devices = [f"/device:CPU:{(c + 1) % cells}" for c in range(cells)]
            twin = _phase_calls(bench_lib.make_pipeline(
                layers, shapes, cells, t, remat, serial_devices=True, placement=devices),
                batch, t)
        for name, fn in calls.items():
            steps[f"phase_K{cells}_T{t}_{name}"] = (fn, batch)
            if args.co_run and name != "update":  # The model updates cell by cell.
                steps[f"pair_K{cells}_T{t}_{name}"] = (_side_by_side(fn, twin[name]), batch)
    samples = bench_lib.interleaved(steps, args.rounds, args.iters)
    for m in meta.values():
        cells, group = k * m["v"], f"K{k * m['v']}_T{m['T']}_"

        def cost(name: str, group: str = group) -> float:
            return bench_lib.median(samples[f"phase_{group}{name}"])

        def co_run(name: str, group: str = group) -> float:
            return bench_lib.median(samples[f"pair_{group}{name}"]) / cost(name)

        m["phase_costs"] = {kind: [cost(f"{kind}_{c}") / chain_length(kind, m["T"])
                                   for c in range(cells)] for kind in PHASES}
        m["phase_costs"]["update"] = cost("update")
        m["phase_costs"]["update_cells"] = [cost(f"update_cell_{c}") for c in range(cells)]
        if args.co_run:
            m["co_run"] = {kind: [co_run(f"{kind}_{c}") for c in range(cells)]
                           for kind in PHASES}
            m["co_run"]["update_cells"] = [co_run(f"update_cell_{c}") for c in range(cells)]
    # TensorFlow's single-threaded executor (serial devices) emits no per-op profiler events,
    # so the idle time is measured on the shared-pool variant of each configuration.
    for key, m in meta.items():
        if key == "naive":
            continue
        pipe = bench_lib.make_pipeline(layers, shapes, k * m["v"], m["T"], remat,
                                       schedule=m["schedule"], virtual_stages=m["v"])
        fn = bench_lib.pipeline_train_step(pipe)[0]
        float(fn(batch))
        m["idle"] = _profile(fn, batch, pipe.make_schedule(m["T"]))
    return {"model": args.model, "devices": k, "processors": len(os.sched_getaffinity(0)),
            "median_s": {n: bench_lib.median(s) for n, s in samples.items()}, "meta": meta}


def fig_weight_heavy(args: argparse.Namespace) -> dict:
    layers, shapes, make_batch = bench_lib.model("weight_heavy", args.quick)
    batch = make_batch()
    k = args.devices
    steps = {}
    for serial in (True, False):
        tag = "serial" if serial else "shared"
        naive = bench_lib.make_pipeline(layers, shapes, k, 1, "never", serial_devices=serial)
        steps[f"{tag}_naive"] = (bench_lib.pipeline_train_step(naive)[0], batch)
        for t in args.micro_batches:
            for mode in ("per_micro_batch", "batched"):
                pipe = bench_lib.make_pipeline(layers, shapes, k, t, "except_last",
                                               serial_devices=serial, weight_gradients=mode)
                steps[f"{tag}_{mode}_T{t}"] = (bench_lib.pipeline_train_step(pipe)[0], batch)
    samples = bench_lib.interleaved(steps, args.rounds, args.iters)
    return {"devices": k, "median_s": {n: bench_lib.median(s) for n, s in samples.items()}}


def _run_worker(figure: str, args: argparse.Namespace, **extra) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), f"--worker={figure}",
           f"--devices={args.devices}", f"--rounds={args.rounds}", f"--iters={args.iters}",
           "--micro_batches=" + ",".join(str(t) for t in args.micro_batches)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--no_co_run"] if args.no_co_run else []
    cmd += ["--schedules=" + ",".join(args.schedules)] if args.schedules else []
    cmd += ["--one_device"] if args.one_device else []
    cmd += [f"--{name}={value}" for name, value in extra.items()]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _predicted(result: dict, key: str, co_run: bool = True) -> float | None:
    """The time model's step for configuration `key`, from its cells' measured call times;
    with `co_run`, each call slowed by its measured co-run factor while another core is busy
    (results measured without them: None)."""
    import time_model

    m = result["meta"].get(key)
    if not m or "phase_costs" not in m or (co_run and "co_run" not in m):
        return None
    processors = result.get("processors")
    if not co_run and not (processors and processors < result["devices"]):
        processors = None  # Each device on a core of its own.
    return time_model.predicted_from_phase_costs(
        m["phase_costs"], m["schedule"], m["T"], m["v"], REMAT, processors,
        m["co_run"] if co_run else None)


def _speedup_table(result: dict) -> list[str]:
    """The speedup table, with the time model's prediction (issue 16) for every row: with
    the cores' co-run slowdown where it was measured, and without it."""
    naive = result["median_s"]["naive"]
    variants = (True, False) if "co_run" in result["meta"]["naive"] else (False,)

    def model_columns(key: str, step: float) -> str:
        cells = []
        for co_run in variants:
            predicted = _predicted(result, key, co_run)
            cells += (["", ""] if predicted is None else
                      [f"{predicted * 1e3:.0f} ms", f"{predicted / step - 1:+.1%}"])
        return "| " + " | ".join(cells) + " |"

    processors = result.get("processors")
    shared = (f", time-sharing {processors} cores" if processors
              and processors < result["devices"] else "")
    model_heads = " | ".join(
        (f"time model{' (co-run slowdown)' if co_run else ''} | its error"
         if len(variants) == 1 or co_run else "without co-run slowdown | its error")
        for co_run in variants)
    alone = result["median_s"].get("one_device")
    vs_alone = ([" speedup vs one device |", "---|"] if alone else ["", ""])

    def alone_column(step: float) -> str:
        return f" {alone / step:.2f}x |" if alone else ""

    lines = [f"### {result['model']} (K={result['devices']} devices, serial{shared})", "",
             "| schedule | T | median step | speedup vs naive MP |" + vs_alone[0]
             + " measured mean idle "
             f"(shared pool) | theoretical bubble | {model_heads} |",
             "|---|---|---|---|" + vs_alone[1] + "---|---|" + "---|---|" * len(variants)]
    if alone:
        lines.append(f"| one device (K=1, T=1) | 1 | {alone * 1e3:.0f} ms | "
                     f"{naive / alone:.2f}x |{alone_column(alone)} | | "
                     + "| " * (2 * len(variants)))
    lines.append(f"| naive MP (gpipe, T=1) | 1 | {naive * 1e3:.0f} ms | 1.00x |"
                 f"{alone_column(naive)} | " + model_columns("naive", naive))
    errors = {co_run: {} for co_run in variants}
    for co_run in variants:
        predicted_naive = _predicted(result, "naive", co_run)
        if predicted_naive is not None:
            errors[co_run][("naive MP", 1)] = predicted_naive / naive - 1
    for key, m in result["meta"].items():
        if key == "naive":
            continue
        step = result["median_s"][key]
        name = m["schedule"] + (f" (v={m['v']})" if m["v"] > 1 else "")
        lines.append(f"| {name} | {m['T']} | {step * 1e3:.0f} ms | {naive / step:.2f}x |"
                     f"{alone_column(step)} {100 * m['idle']:.0f}% | {100 * m['theory']:.0f}% "
                     + model_columns(key, step))
        for co_run in variants:
            predicted = _predicted(result, key, co_run)
            if predicted is not None:
                errors[co_run][(name, m["T"])] = predicted / step - 1
    lines.append("")
    for co_run in variants:
        if errors[co_run]:
            label = ("Time model" if len(variants) == 1 else
                     "Time model with co-run slowdown" if co_run else "Without it")
            lines.append(_worst_error_line(label, errors[co_run]))
    return lines


def _worst_error_line(label: str, errors: dict) -> str:
    worst = max(errors.items(), key=lambda kv: abs(kv[1]))
    issue_ts = sorted({t for _, t in errors} & {1, 4, 8})
    at_issue_t = [abs(e) for (_, t), e in errors.items() if t in issue_ts]
    within = sum(abs(e) <= 0.15 for (_, t), e in errors.items() if t in issue_ts)
    return (f"{label}: worst error {worst[1]:+.1%} ({worst[0][0]}, T={worst[0][1]})"
            + (f"; at T in {{{', '.join(map(str, issue_ts))}}} (issue 16's T): worst "
               f"{max(at_issue_t):.1%}, {within} of {len(at_issue_t)} within 15%"
               if at_issue_t else "") + " (issue 16: within 15%).")


def _weight_heavy_table(result: dict, micro_batches: list[int]) -> list[str]:
    s = result["median_s"]
    lines = [f"### weight_heavy (K={result['devices']}): per-micro-batch vs batched weight "
             "gradients", "",
             "| devices | T | per_micro_batch | batched | per_micro_batch vs naive MP | "
             "batched vs naive MP |", "|---|---|---|---|---|---|"]
    for tag in ("serial", "shared"):
        naive = s[f"{tag}_naive"]
        for t in micro_batches:
            a, b = s[f"{tag}_per_micro_batch_T{t}"], s[f"{tag}_batched_T{t}"]
            lines.append(f"| {tag} | {t} | {a * 1e3:.0f} ms | {b * 1e3:.0f} ms | "
                         f"{naive / a:.2f}x | {naive / b:.2f}x |")
        lines.append(f"| {tag} | naive MP (T=1) | {naive * 1e3:.0f} ms | | 1.00x | |")
    return lines


def _save_measurements(name: str, results: list[dict], source: str | None) -> None:
    """Keeps a recorded run's measurements beside its section, so the time model can be
    re-rendered from them (`--from_json`)."""
    import report

    path = os.path.join(report.SEPARATE_DIR, f"{name}.json")
    if source and os.path.abspath(source) == os.path.abspath(path):
        return
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--models", default="transformer,amoebanet,weight_heavy")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--micro_batches", default="2,4,8,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no_weight_heavy", action="store_true",
                        help="Skip the weight_heavy figure (per-micro-batch vs batched).")
    parser.add_argument("--no_co_run", action="store_true",
                        help="Skip timing each call beside a copy of itself (the time model's "
                        "co-run slowdown).")
    parser.add_argument("--schedules", default="",
                        help="Comma-separated schedule names to run (default: all of "
                        "SCHEDULES).")
    parser.add_argument("--one_device", action="store_true",
                        help="Also time the model on one serial device (K=1, T=1): a speedup "
                        "column against it.")
    parser.add_argument("--record", action="store_true",
                        help="Write the tables into BENCHMARKS.md (bench/separate/), the "
                        "measurements beside them (.json).")
    parser.add_argument("--from_json", default=None,
                        help="Render (and with --record, record) the tables from a recorded "
                        "run's measurements instead of measuring.")
    args = parser.parse_args()
    args.co_run = not args.no_co_run
    args.schedules = [n for n in str(args.schedules).split(",") if n]
    args.micro_batches = [int(t) for t in str(args.micro_batches).split(",")]
    if args.worker:
        bench_lib.setup(args.devices * 2, 1, args.devices)
        figure = {"speedup": fig_speedup, "weight_heavy": fig_weight_heavy}[args.worker]
        print(json.dumps(figure(args)))
        return
    if args.quick:
        args.micro_batches, args.rounds, args.iters = [2, 4], 2, 1
    lines = []
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
    else:
        results = []
        for model in args.models.split(","):
            results.append(_run_worker("speedup", args, model=model))
            print(json.dumps(results[-1]), flush=True)
    for result in results:
        lines += _speedup_table(result) + [""]
    if not args.no_weight_heavy:
        wh_args = argparse.Namespace(**vars(args))
        wh_args.micro_batches = [1] + args.micro_batches
        result = _run_worker("weight_heavy", wh_args)
        print(json.dumps(result), flush=True)
        lines += _weight_heavy_table(result, wh_args.micro_batches)
    print("\n".join(lines))
    if args.record and args.devices != 2:
        import report

        cores = len(os.sched_getaffinity(0))
        intro = [
            f"K={args.devices} serial logical devices on a host with {cores} cores: at most "
            f"{cores} devices run at once, so the devices time-share the cores. The time model "
            "replays each schedule with the actions' durations timed alone (as in section 12) "
            f"and `shared_processors.replay(processors={cores})`: with n > {cores} actions "
            "running, each "
            f"runs at {cores}/n of its speed. The cores share one memory system, so each "
            "call is also timed beside a copy of itself on another device: its co-run "
            "factor s. While two calls a and b run on the two cores, the model slows each by "
            "1 + sqrt((s_a - 1)(s_b - 1)) (`shared_processors.CoRunSlowdown`); the last two "
            "columns "
            "leave that out. On hardware "
            "with a processor and memory per device (accelerators), processors=None and the "
            "devices run side by side unslowed. remat 'except_last', momentum SGD; naive MP = "
            "gpipe at T=1 on the same devices; interleaved: 2 cells per device.", ""]
        command = ("python bench/schedules.py --record --no_weight_heavy "
                   f"--devices={args.devices} --models={args.models} "
                   f"--micro_batches={','.join(map(str, args.micro_batches))}")
        _save_measurements(f"12c_schedules_k{args.devices}", results, args.from_json)
        print(report.record_separate(
            f"12c_schedules_k{args.devices}", f"12c. Schedules at K={args.devices} on "
            f"{cores} cores: the time model with time-shared devices (issue 16)",
            intro + lines, command))
    elif args.record:
        import report

        intro = [
            "Serial logical devices (the accelerator emulation), remat 'except_last', momentum "
            "SGD; naive MP = gpipe at T=1 on the same devices. interleaved: 2 cells per device "
            "(virtual_stages=2). zero_bubble: ZB-H1; B records each weight op's input and output "
            "gradient, W computes the weight gradients from them (layers.weight_ops). "
            "Theoretical bubble: the schedule's unit-time timeline (every action one tick). "
            "Measured idle: profiled on the shared pool (see the script's docstring).", ""]
        _save_measurements("12_schedules", results, args.from_json)
        print(report.record_separate("12_schedules", "12. Schedules side by side, and batched "
                                     "weight gradients (issue 14)", intro + lines,
                                     "python bench/schedules.py --record"))


if __name__ == "__main__":
    main()
