"""What is alive at each device's memory peak: one training step, every allocation recorded.

Runs like `memory_model_check.py` (one TensorFlow worker process per device, each with its own
BFC allocator, `device_memory.py`), then one more step with TensorFlow's profiler on in every
worker, and reads back the allocator's allocation and deallocation events: at the moment a
device's allocated bytes peak, the buffers alive, grouped by the op scope that made them
(the executor names ops `cell_{k}/{action}/...`; a buffer received from another device has no
op), with requested and allocated bytes (BFC may hand out a free chunk up to twice the
request), next to the memory model's prediction for that device.

    python bench/memory_at_peak.py --model=amoebanet --num_cells=4 --micro_batches=4 \
        --schedule=zero_bubble
    python bench/memory_at_peak.py --model=transformer --num_cells=2 --micro_batches=8 \
        --buffers=10    # also the 10 largest buffers of each device

Buffers allocated before the step (weights, optimizer slots) have no event in the trace;
they are the difference between the allocator's figure at the peak and the traced buffers.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
import tempfile
from collections.abc import Iterable, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MIB = 2**20
RECEIVED = "(received: no op)"


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One live allocation."""

    op: str  # The TensorFlow op that made it; RECEIVED for a buffer with none.
    shape: str
    requested: int
    allocated: int


@dataclasses.dataclass(frozen=True)
class Peak:
    """A device's allocator at its highest point in the traced step."""

    allocated: int  # The allocator's bytes in use then (everything, traced or not).
    buffers: tuple[Buffer, ...]  # Those allocated during the trace and still alive.

    @property
    def traced_requested(self) -> int:
        return sum(b.requested for b in self.buffers)

    @property
    def traced_allocated(self) -> int:
        return sum(b.allocated for b in self.buffers)


def _stat_value(plane, stat):
    kind = stat.WhichOneof("value")
    if kind == "ref_value":
        return plane.stat_metadata[stat.ref_value].name
    return getattr(stat, kind) if kind else None


def allocation_events(spaces: Iterable) -> list[tuple[int, bool, dict]]:
    """(time ns, is_allocation, stats) of every MemoryAllocation / MemoryDeallocation event in
    profiler XSpaces, in time order."""
    events = []
    for space in spaces:
        for plane in space.planes:
            names = {key: meta.name for key, meta in plane.event_metadata.items()}
            stat_names = {key: meta.name for key, meta in plane.stat_metadata.items()}
            for line in plane.lines:
                for event in line.events:
                    name = names.get(event.metadata_id)
                    if name not in ("MemoryAllocation", "MemoryDeallocation"):
                        continue
                    stats = {stat_names.get(s.metadata_id): _stat_value(plane, s)
                             for s in event.stats}
                    events.append((line.timestamp_ns + event.offset_ps // 1000,
                                   name == "MemoryAllocation", stats))
    events.sort(key=lambda e: e[0])
    return events


def peak_of(events: Sequence[tuple[int, bool, dict]]) -> Peak:
    """The live buffers when the allocator's `bytes_allocated` was highest (the first such
    event), replayed up to that event."""
    in_use = [int(stats.get("bytes_allocated") or 0) for _, _, stats in events]
    if not in_use:
        return Peak(0, ())
    highest = max(range(len(in_use)), key=in_use.__getitem__)
    live: dict[int, Buffer] = {}
    for _, is_allocation, stats in events[:highest + 1]:
        address = stats.get("addr")
        if is_allocation:
            requested = int(stats.get("requested_bytes") or 0)
            live[address] = Buffer(str(stats.get("tf_op") or RECEIVED),
                                   str(stats.get("shape") or ""), requested,
                                   int(stats.get("allocation_bytes") or requested))
        else:
            live.pop(address, None)
    return Peak(in_use[highest], tuple(live.values()))


def op_scope(op: str, depth: int = 3) -> str:
    """The op's first `depth` name scopes
    ('gradient_tape/cell_1/bprop/recompute/Relu_3' -> 'gradient_tape/cell_1/bprop')."""
    return "/".join(op.split("/")[:depth])


def by_scope(buffers: Iterable[Buffer], depth: int = 3) -> list[tuple[str, int, int, int]]:
    """(scope, buffers, requested bytes, allocated bytes), largest first."""
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for b in buffers:
        group = groups[op_scope(b.op, depth)]
        group[0] += 1
        group[1] += b.requested
        group[2] += b.allocated
    return sorted(((k, *v) for k, v in groups.items()), key=lambda g: -g[3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="amoebanet",
                        help="A bench_lib model: transformer, amoebanet, weight_heavy, "
                             "mt_transformer.")
    parser.add_argument("--num_cells", type=int, default=2, help="K (cells).")
    parser.add_argument("--micro_batches", type=int, default=4, help="T.")
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--remat", default="except_last")
    parser.add_argument("--virtual_stages", type=int, default=1,
                        help="Cells per device (the interleaved schedule).")
    parser.add_argument("--depth", type=int, default=3, help="Name scopes to group by.")
    parser.add_argument("--buffers", type=int, default=0,
                        help="Also list each device's N largest live buffers.")
    parser.add_argument("--quick", action="store_true", help="Smaller benchmark shapes.")
    args = parser.parse_args()
    v = args.virtual_stages
    if args.num_cells % v:
        parser.error(f"--num_cells={args.num_cells} is not a multiple of "
                     f"--virtual_stages={v}; set --num_cells to K x v.")

    import bench_lib
    import device_memory
    import memory_model_check

    from lingvo_lite.analysis import trace_analysis

    layers, shapes, make_batch = bench_lib.model(args.model, args.quick)
    num_devices = args.num_cells // v
    with tempfile.TemporaryDirectory() as logdir:
        with device_memory.Cluster(num_devices) as cluster:
            measured = device_memory.measure_step(
                cluster, layers, shapes, make_batch, args.num_cells, args.micro_batches,
                args.schedule, args.remat, virtual_stages=v, trace_dir=logdir)
        peaks = [peak_of(allocation_events(trace_analysis.load_xspaces(
            os.path.join(logdir, str(d))))) for d in range(num_devices)]
    model = memory_model_check.predicted(layers, shapes, args.num_cells, args.micro_batches,
                                         args.schedule, args.remat, virtual_stages=v)
    for d, peak in enumerate(peaks):
        print(f"device {d}: median peak {measured[d] / MIB:.2f} MiB over "
              f"{device_memory.MEASURED_STEPS} steps, model {model[d] / MIB:.2f}; traced step's "
              f"peak {peak.allocated / MIB:.2f} MiB allocated, of which traced buffers "
              f"{peak.traced_allocated / MIB:.2f} ({peak.traced_requested / MIB:.2f} "
              "requested)")
        for scope, count, requested, allocated in by_scope(peak.buffers, args.depth):
            if allocated >= 0.01 * peak.allocated:
                print(f"  {allocated / MIB:8.2f} MiB ({requested / MIB:.2f} requested) "
                      f"{count:4d} buffers  {scope}")
        for b in sorted(peak.buffers, key=lambda b: -b.allocated)[:args.buffers]:
            print(f"    {b.allocated / MIB:8.2f} MiB ({b.requested / MIB:.2f}) {b.shape} {b.op}")


if __name__ == "__main__":
    main()
