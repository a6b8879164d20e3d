"""bench/memory_at_peak.py: the live buffers at an allocator's peak, from profiler events.

The parser is checked on a trace written here event by event (what TensorFlow's BFC allocator
records under the profiler: one MemoryAllocation / MemoryDeallocation event per buffer, with
its address, requested and allocated bytes and the allocator's bytes in use after it), and the
whole tool once on a two-device pipeline, whose every device must show its cell's buffers.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))

import memory_at_peak  # noqa: E402

from lingvo_lite.pipeline import tf_private  # noqa: E402


def _space(events: list[tuple[str, dict]]):
    """An XSpace with one plane and line holding `events` (name, stats) 1 us apart."""
    xplane_pb2 = tf_private.xplane_pb2()
    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    line = plane.lines.add(timestamp_ns=1000)
    stat_ids: dict[str, int] = {}
    event_ids: dict[str, int] = {}
    for i, (name, stats) in enumerate(events):
        if name not in event_ids:
            event_ids[name] = len(event_ids) + 1
            plane.event_metadata[event_ids[name]].name = name
        event = line.events.add(metadata_id=event_ids[name], offset_ps=i * 1_000_000)
        for key, value in stats.items():
            if key not in stat_ids:
                stat_ids[key] = len(stat_ids) + 1
                plane.stat_metadata[stat_ids[key]].name = key
            stat = event.stats.add(metadata_id=stat_ids[key])
            if isinstance(value, str):
                stat.str_value = value
            else:
                stat.int64_value = value
    return space


def _alloc(addr, op, requested, allocated, in_use):
    stats = {"addr": addr, "requested_bytes": requested, "allocation_bytes": allocated,
             "bytes_allocated": in_use}
    if op:
        stats["tf_op"] = op
    return "MemoryAllocation", stats


def _free(addr, in_use):
    return "MemoryDeallocation", {"addr": addr, "bytes_allocated": in_use}


def test_live_buffers_at_the_highest_point():
    # 4,096 B held before the trace; a (1,000 B requested, 1,024 given) and b (received, no
    # op, 3,000 in a 6,144 chunk) alive together at 11,264; a is freed, c (2,000) comes: 12,288
    # is lower than a + b + c would be, and higher than the first peak: the peak is c's.
    events = [_alloc(1, "cell_0/fprop_mb_0/fprop/Relu", 1000, 1024, 4096 + 1024),
              _alloc(2, None, 3000, 6144, 4096 + 1024 + 6144),
              _free(1, 4096 + 6144),
              _alloc(3, "gradient_tape/cell_0/bprop/recompute/MatMul", 2000, 2048,
                     4096 + 6144 + 2048),
              _free(2, 4096 + 2048)]
    peak = memory_at_peak.peak_of(memory_at_peak.allocation_events([_space(events)]))
    assert peak.allocated == 4096 + 6144 + 2048
    assert sorted(b.op for b in peak.buffers) == [
        "(received: no op)", "gradient_tape/cell_0/bprop/recompute/MatMul"]
    assert (peak.traced_requested, peak.traced_allocated) == (3000 + 2000, 6144 + 2048)
    assert memory_at_peak.by_scope(peak.buffers, depth=2) == [
        ("(received: no op)", 1, 3000, 6144), ("gradient_tape/cell_0", 1, 2000, 2048)]


@pytest.mark.slow
def test_the_tool_shows_each_devices_cell():
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "memory_at_peak.py"),
         "--model=weight_heavy", "--quick", "--num_cells=2", "--micro_batches=2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for device in (0, 1):
        section = out.split(f"device {device}:")[1].split("device ")[0]
        assert f"cell_{device}/" in section, out
        assert f"cell_{1 - device}/" not in section, out
