"""The cluster placement backend: pipeline cells on the tasks of a TF cluster.

Two worker processes serve on 127.0.0.1; a client process places cell k on
'/job:worker/replica:0/task:k' (placement='cluster') and checks that loss and
gradients equal the unpipelined model's computed locally. Each role runs in its
own process because connecting to a cluster changes the process's TF context.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf
from conftest import REPO

ROOT = REPO

WORKER = textwrap.dedent("""
    import sys, time
    import tensorflow as tf
    spec = tf.train.ClusterSpec({"worker": sys.argv[1].split(",")})
    server = tf.distribute.Server(spec, job_name="worker", task_index=int(sys.argv[2]),
                                  protocol="grpc", start=True)
    print("ready", flush=True)
    server.join()
""")

CLIENT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    sys.path.insert(0, sys.argv[2] + "/tests")
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.distribute.cluster_resolver import SimpleClusterResolver
    spec = tf.train.ClusterSpec({"worker": sys.argv[1].split(",")})
    tf.config.experimental_connect_to_cluster(
        SimpleClusterResolver(spec, rpc_layer="grpc"), make_master_device_default=False)
    import pipeline_models as pt
    pipe = pt.make_pipeline(pt.mlp_layers(), num_cells=2, num_micro_batches=4,
                            placement="cluster")
    devices = sorted({v.device for v in pipe.vars.Flatten()})
    assert [d.split("/device")[0] for d in devices] == [
        "/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"], devices
    batch = pt.make_batch()
    # The unrolled executor, then the micro-batch loop (whose while loops then span the two
    # worker processes).
    loop = pt.make_pipeline(pt.mlp_layers(), num_cells=2, num_micro_batches=4,
                            placement="cluster", remat="always", micro_batch_loop=True)
    for label, p in (("RESULT", pipe), ("RESULT_LOOP", loop)):
        loss, grads = pt.pipeline_loss_and_grads(p, batch, 3)
        ref_loss, ref_grads = pt.reference_loss_and_grads(p, batch, 3)
        err = max(float(np.max(np.abs(a - b) / (np.abs(a) + 1e-3)))
                  for a, b in zip(ref_grads, grads))
        print(label, float(loss), float(ref_loss), err, flush=True)
""")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class ClusterPlacementTest(tf.test.TestCase):

    @pytest.mark.slow
    def test_pipeline_on_two_cluster_workers_matches_local_model(self):
        addresses = ",".join(f"127.0.0.1:{p}" for p in _free_ports(2))
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        workers = [subprocess.Popen([sys.executable, "-c", WORKER, addresses, str(i)],
                                    stdout=subprocess.PIPE, text=True, env=env)
                   for i in range(2)]
        try:
            for w in workers:
                self.assertEqual("ready", w.stdout.readline().strip())
            proc = subprocess.run([sys.executable, "-c", CLIENT, addresses, ROOT],
                                  capture_output=True, text=True, timeout=240, env=env)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
            self.assertEqual(["RESULT", "RESULT_LOOP"], [line.split()[0] for line in lines],
                             msg=proc.stderr[-3000:])
            for line in lines:
                loss, ref_loss, rel_err = map(float, line.split()[1:])
                self.assertAllClose(ref_loss, loss, rtol=2e-5)
                self.assertLess(rel_err, 1e-4)
        finally:
            for w in workers:
                w.kill()
                w.wait()
