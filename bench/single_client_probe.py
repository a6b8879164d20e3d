"""Measures what TensorFlow offers a single-client cluster when a serving task dies or stops.

Task 1 serves its devices (`tf.distribute.Server`); task 0 serves too and is the one client
(`experimental_connect_to_cluster`), calling a function whose ops run on task 1 (remote ops, not
collectives, as trainer.py's single-client mode). The driver kills or stops task 1 at step 20.
The client watches task 1 with TensorFlow's peer health check
(`check_collective_ops_peer_health`: it raises InternalError "CheckPeerHealth is not supposed to
be called for local collectives" in this mode), or with a gRPC GetStatus call to its server
(--probe=get_status, the RPC the health check sends), and on failure cancels the running step
through a `CancellationManager` (and/or `abort_collective_ops`): printed is whether the blocked
step raised, which error, and when.

    .venv/bin/python bench/single_client_probe.py [--signal=STOP|KILL] [--how=cancel|abort]

Only the processes started here are stopped, by PID; only 127.0.0.1 is used.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import bench_lib

TASK = r'''
import json, sys, threading, time
spec = json.loads(sys.argv[1])
addresses, index, how = spec["addresses"], spec["index"], spec["how"]
import tensorflow as tf
cluster = tf.train.ClusterSpec({"worker": addresses})
server = tf.distribute.Server(cluster, job_name="worker", task_index=index, protocol="grpc",
                              start=True)
print("EVENT serving", flush=True)
if index == 1:
    while True:
        time.sleep(1)
from tensorflow.python.distribute.cluster_resolver import SimpleClusterResolver
from tensorflow.python.eager import cancellation, context
tf.config.experimental_connect_to_cluster(SimpleClusterResolver(cluster, rpc_layer="grpc"),
                                          make_master_device_default=False)
remote = "/job:worker/replica:0/task:1/device:CPU:0"
with tf.device(remote):
    w = tf.Variable(tf.ones([200, 200]))
@tf.function
def step(x):
    with tf.device(remote):
        y = tf.matmul(x, w)
    return tf.reduce_sum(y)
cm = cancellation.CancellationManager()
def get_status():
    if spec["probe"] == "health_check":
        context.context().check_collective_ops_peer_health(
            "/job:worker/replica:0/task:1", timeout_in_ms=2000)
        return
    import grpc
    with grpc.insecure_channel(addresses[1]) as channel:  # GetStatusRequest is empty.
        channel.unary_unary("/tensorflow.WorkerService/GetStatus",
                            request_serializer=lambda _: b"",
                            response_deserializer=lambda data: data)(None, timeout=2.0)
def watch():
    while True:
        try:
            get_status()
        except Exception as e:
            print(f"EVENT health {type(e).__name__} {' '.join(str(e).split())[:150]}", flush=True)
            if how in ("cancel", "both"):
                cm.start_cancel()
            if how in ("abort", "both"):
                context.context().abort_collective_ops(14, "task 1 lost")
            print("EVENT cancelled", flush=True)
            return
        time.sleep(1.0)
threading.Thread(target=watch, daemon=True).start()
x = tf.ones([1, 200])
s = 0
try:
    with cancellation.CancellationManagerContext(cm):
        while True:
            s += 1
            step(x).numpy()
            print(f"EVENT step {s}", flush=True)
            time.sleep(0.1)
except Exception as e:
    print(f"EVENT raised {type(e).__name__} {' '.join(str(e).split())[:200]}", flush=True)
    sys.exit(1)
'''


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--signal", default="STOP", choices=["KILL", "STOP"])
    parser.add_argument("--how", default="cancel", choices=["cancel", "abort", "both"])
    parser.add_argument("--give_up_s", type=float, default=60.0)
    parser.add_argument("--probe", default="get_status", choices=["get_status", "health_check"],
                        help="TF's check_collective_ops_peer_health, or a gRPC GetStatus call "
                        "to the task's TensorFlow server")
    args = parser.parse_args()
    addresses = [f"127.0.0.1:{bench_lib.free_port()}" for _ in range(2)]
    # The serving task first, then the client.
    tasks = bench_lib.ProbeTasks(TASK, {i: {"addresses": addresses, "index": i, "how": args.how,
                                            "probe": args.probe} for i in (1, 0)})
    tasks.wait_for(0, "EVENT step 20")
    os.kill(tasks.procs[1].pid, getattr(signal, "SIG" + args.signal))
    hit = time.monotonic()
    status = tasks.wait(0, args.give_up_s)
    print(f"serving task 1 SIG{args.signal}; the client's reaction: {args.how}")
    tasks.print_since(0, hit, "client")
    print(f"  client exit status {status} after {time.monotonic() - hit:.1f} s"
          + (" (still running: stopped by PID)" if status is None else ""))
    tasks.stop()

if __name__ == "__main__":
    main()
