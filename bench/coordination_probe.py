"""Measures what TensorFlow's own cluster machinery does when a task dies or stops (issue 45).

Two tasks on 127.0.0.1, each a client of its own devices (as MultiWorkerMirroredStrategy): the
coordination service (leader task 0, `configure_coordination_service`), a start-up agreement
through its key-value store and a barrier, then steps of a cross-task all-reduce. The driver
kills (SIGKILL) or stops (SIGSTOP) one task at step 20 and prints, for the survivor, which error
it met, after how many seconds, and whether it then left through a normal `sys.exit`.

    .venv/bin/python bench/coordination_probe.py [--victim=1] [--signal=KILL|STOP]
        [--health_check] [--heartbeat_timeout_s=10]

Only the processes started here are stopped, by PID; only 127.0.0.1 is used.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import bench_lib

TASK = r'''
import json, os, sys, threading, time
spec = json.loads(sys.argv[1])
addresses, index, hb_ms, health = spec["addresses"], spec["index"], spec["hb_ms"], spec["health"]
steps, linger = spec["steps"], spec["linger"]
import tensorflow as tf
from tensorflow.core.protobuf import tensorflow_server_pb2
from tensorflow.python.eager import context
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
ctx = context.context()
ctx.configure_collective_ops(collective_leader="/job:worker/replica:0/task:0",
                             device_filters=(f"/job:worker/task:{index}",))
ctx.configure_coordination_service(
    service_type="standalone", service_leader="/job:worker/replica:0/task:0",
    heartbeat_timeout_in_ms=hb_ms, shutdown_barrier_timeout_in_ms=5000,
    coordinated_jobs=[coordination_config_pb2.CoordinatedJob(name="worker",
                                                             num_tasks=len(addresses))])
t0 = time.monotonic()
ctx.enable_collective_ops(tensorflow_server_pb2.ServerDef(
    cluster=tf.train.ClusterSpec({"worker": addresses}).as_cluster_def(),
    default_session_config=ctx.config, job_name="worker", task_index=index, protocol="grpc",
    port=int(addresses[index].rpartition(":")[2])))
print(f"EVENT up {time.monotonic() - t0:.2f}", flush=True)
ctx.set_config_key_value(f"flags/{index}", "--max_steps=5")
other = ctx.get_config_key_value(f"flags/{1 - index}", timeout_in_ms=60000)
print(f"EVENT kv {other}", flush=True)
ctx.wait_at_barrier("start", timeout_in_ms=60000)
print("EVENT barrier", flush=True)
aborted = []
if health:
    def watch():
        peer = f"/job:worker/replica:0/task:{1 - index}"
        while True:
            try:
                ctx.check_collective_ops_peer_health(peer, timeout_in_ms=2000)
            except Exception as e:
                aborted.append(time.monotonic())
                print(f"EVENT health {type(e).__name__} {str(e).splitlines()[0][:160]}", flush=True)
                ctx.abort_collective_ops(14, f"task {1 - index} lost")
                return
            time.sleep(1.0)
    threading.Thread(target=watch, daemon=True).start()
dev = f"/job:worker/replica:0/task:{index}/device:CPU:0"
@tf.function
def step(x):
    with tf.device(dev):
        return tf.raw_ops.CollectiveReduceV2(input=x, group_size=2, group_key=1, instance_key=1,
            ordering_token=[], merge_op="Add", final_op="Id")
x = tf.ones([1000])
s = 0
try:
    while s < steps:
        s += 1
        step(x).numpy()
        print(f"EVENT step {s}", flush=True)
        time.sleep(0.1)
except Exception as e:
    print(f"EVENT raised {type(e).__name__} {' '.join(str(e).split())[:200]}", flush=True)
    print("EVENT exiting", flush=True)
    sys.exit(1)
t1 = time.monotonic()
print(f"EVENT done {steps} steps; lingering {linger} s", flush=True)
time.sleep(linger)
print("EVENT exiting 0", flush=True)
'''


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--signal", default="KILL", choices=["KILL", "STOP"])
    parser.add_argument("--health_check", action="store_true")
    parser.add_argument("--heartbeat_timeout_s", type=float, default=10.0)
    parser.add_argument("--give_up_s", type=float, default=90.0)
    parser.add_argument("--finish_first", action="store_true",
                        help="both run 20 steps; the victim exits at once, the other 25 s later")
    args = parser.parse_args()
    addresses = [f"127.0.0.1:{bench_lib.free_port()}" for _ in range(2)]
    tasks = bench_lib.ProbeTasks(TASK, {i: {
        "addresses": addresses, "index": i, "hb_ms": int(args.heartbeat_timeout_s * 1000),
        "health": args.health_check, "steps": 20 if args.finish_first else 10**9,
        "linger": (0 if i == args.victim else 25) if args.finish_first else 0}
        for i in range(2)}, log_level="1")
    survivor = 1 - args.victim
    tasks.wait_for(args.victim, "EVENT step 20")
    if args.finish_first:
        hit = time.monotonic()
        tasks.procs[args.victim].wait()
        print(f"victim exited {tasks.procs[args.victim].returncode} after "
              f"{time.monotonic() - hit:.1f} s")
    else:
        os.kill(tasks.procs[args.victim].pid, getattr(signal, "SIG" + args.signal))
    hit = time.monotonic()
    status = tasks.wait(survivor, args.give_up_s)
    ended = time.monotonic() - hit
    print(f"victim task {args.victim} SIG{args.signal}, health_check={args.health_check}, "
          f"heartbeat timeout {args.heartbeat_timeout_s} s")
    tasks.print_since(survivor, hit, "survivor")
    print(f"  survivor exit status {status} after {ended:.1f} s"
          + (" (still running: stopped by PID)" if status is None else ""))
    tasks.stop()

if __name__ == "__main__":
    main()
