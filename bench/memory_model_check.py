"""The memory model (lingvo_lite/analysis/memory_model.py) against measured per-device peaks.

For each benchmark model (bench_lib.model), K in {1, 2, 4}, T in {1, 4, 8} and each schedule,
one training step (momentum SGD, remat as given) runs with every device in its own process
(`device_memory.py`: one BFC allocator per device) and each device's measured peak is printed
next to the model's prediction and the relative error. Memory only, no timing. K counts
devices: the interleaved schedule puts `--virtual_stages` cells on each (K x v cells; skipped
where T is not a multiple of K or the model has fewer than K x v layers).

    python bench/memory_model_check.py                        # the full table (markdown)
    python bench/memory_model_check.py --models=transformer --num_cells=2 --micro_batches=4
    python bench/memory_model_check.py --json_out=peaks.json    # keep the measurements
    python bench/memory_model_check.py --from_json=peaks.json   # re-predict, measure nothing
    python bench/memory_model_check.py --schedules=interleaved --num_cells=2,4 --micro_batches=4,8

Prints a markdown table, then the worst error and how many devices are within 20%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

TOLERANCE = 0.20  # Issue 16: within 20% of the measured peak per device.


def predicted(layers, shapes, num_cells: int, num_micro_batches: int, schedule: str,
              remat: str, num_slots: int = 1, virtual_stages: int = 1) -> list[int]:
    """The memory model's peak per device (momentum SGD: one slot), as the planner predicts it
    (receives land on the schedule's timeline simulated from the cells' FLOPs)."""
    from lingvo_lite.analysis import planner
    from lingvo_lite.pipeline import pipelining_layer

    p = pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", layers=layers, num_cells=num_cells, input_shapes=shapes)
    mem = planner.predict_memory(p, num_cells, 1, num_micro_batches, schedule, remat,
                                 num_slots, virtual_stages)
    return [m.total for m in mem]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="transformer,amoebanet,weight_heavy")
    parser.add_argument("--num_cells", default="1,2,4")
    parser.add_argument("--micro_batches", default="1,4,8")
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--remat", default="except_last")
    parser.add_argument("--virtual_stages", type=int, default=2,
                        help="Cells per device of the interleaved schedule.")
    parser.add_argument("--quick", action="store_true", help="Smaller benchmark shapes.")
    parser.add_argument("--json_out", default="",
                        help="Also write the measured peaks (bytes) to this JSON file.")
    parser.add_argument("--from_json", default="",
                        help="Measure nothing: print the table for the peaks saved by "
                             "--json_out, with the memory model as it is now.")
    args = parser.parse_args()
    import bench_lib

    if args.from_json:
        with open(args.from_json) as f:
            rows = json.load(f)
        models = {}
        errors = []
        print(HEADER)
        for row in rows:
            if row["model"] not in models:
                models[row["model"]] = bench_lib.model(row["model"], args.quick)
            layers, shapes, _ = models[row["model"]]
            v = row.get("v", 1)
            model = predicted(layers, shapes, row["K"] * v, row["T"], row["schedule"],
                              row["remat"], virtual_stages=v)
            errors += _print_rows(row["model"], row["K"], row["T"], _label(row["schedule"], v),
                                  row["remat"], row["measured"], model)
        _summary(errors)
        return
    import device_memory

    ks = [int(k) for k in args.num_cells.split(",")]
    ts = [int(t) for t in args.micro_batches.split(",")]
    print(HEADER)
    errors, raw = [], []
    with device_memory.Cluster(max(ks)) as cluster:
        for name in args.models.split(","):
            layers, shapes, make_batch = bench_lib.model(name, args.quick)
            for k in ks:
                for t in ts:
                    for sched in args.schedules.split(","):
                        if k == 1 and sched != args.schedules.split(",")[0]:
                            continue  # One cell: every schedule is the same order.
                        v = args.virtual_stages if sched == "interleaved" else 1
                        if v > 1 and (k == 1 or t % k or k * v > len(layers)):
                            continue  # Nothing to interleave, or a T or K it cannot run.
                        measured = device_memory.measure_step(
                            cluster, layers, shapes, make_batch, k * v, t, sched, args.remat,
                            virtual_stages=v)
                        model = predicted(layers, shapes, k * v, t, sched, args.remat,
                                          virtual_stages=v)
                        raw.append({"model": name, "K": k, "v": v, "T": t, "schedule": sched,
                                    "remat": args.remat, "measured": measured,
                                    "predicted": model})
                        if args.json_out:
                            with open(args.json_out, "w") as f:
                                json.dump(raw, f)
                        errors += _print_rows(name, k, t, _label(sched, v), args.remat,
                                              measured, model)
    _summary(errors)


HEADER = ("| model | K | T | schedule | remat | device | measured MiB | predicted MiB | error |\n"
          "|---|---|---|---|---|---|---|---|---|")


def _label(schedule: str, virtual_stages: int) -> str:
    return schedule if virtual_stages == 1 else f"{schedule} v={virtual_stages}"


def _print_rows(name: str, k: int, t: int, sched: str, remat: str, measured: list[int],
                model: list[int]) -> list[float]:
    errors = []
    for d, (m, p) in enumerate(zip(measured, model)):
        err = (p - m) / m
        errors.append(abs(err))
        print(f"| {name} | {k} | {t} | {sched} | {remat} | {d} | {m / 2**20:.2f} | "
              f"{p / 2**20:.2f} | {err:+.1%} |", flush=True)
    return errors


def _summary(errors: list[float]) -> None:
    within = sum(e <= TOLERANCE for e in errors)
    print(f"\nWorst error {max(errors):.1%}; {within} of {len(errors)} devices within "
          f"{TOLERANCE:.0%}.")


if __name__ == "__main__":
    main()
