"""Several trainers racing for one logdir's stale lock: exactly one takes it (issue 39).

Each round writes a stale `trainer.lock` (a PID that has exited, on this host), then starts
N processes that wait for the same instant and call `LogdirLock.acquire`; a winner holds the lock
until every other racer has made its attempt (each leaves a marker file when done), so a loser
always meets a live owner however late the machine's load lets it start, and a second winner
can only mean two trainers holding the lock at once. Before the takeover ran
under a lock of its own, two of them sometimes both acquired it (6 of 60 races in the issue;
8 of 8 rounds here, with the window between the staleness check and the removal widened).
The processes import only `logdir_lock` (no TensorFlow), so a round takes about a second.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest

from conftest import REPO

RACERS = 6
ROUNDS = 8

RACER = textwrap.dedent("""
    import os, sys, time
    from lingvo_lite.training import logdir_lock
    logdir, start, racers = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    tried = os.path.join(os.path.dirname(logdir), os.path.basename(logdir) + ".tried")
    lock = logdir_lock.LogdirLock(logdir)
    # Widen the window between judging the old lock stale and removing it (a slow disk or a
    # busy machine): with the takeover unguarded, every round then had several winners.
    _is_stale = logdir_lock._is_stale
    def slow_is_stale(owner):
        time.sleep(0.2)
        return _is_stale(owner)
    logdir_lock._is_stale = slow_is_stale
    time.sleep(max(0.0, start - time.time()))
    try:
        lock.acquire()
    except logdir_lock.LogdirInUseError as e:
        print("REFUSED", e, flush=True)
        open(os.path.join(tried, str(os.getpid())), "w").close()
        sys.exit(0)
    print("ACQUIRED", flush=True)
    open(os.path.join(tried, str(os.getpid())), "w").close()
    deadline = time.time() + 45
    while len(os.listdir(tried)) < racers and time.time() < deadline:
        time.sleep(0.05)
    lock.release()
""")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


class StaleLockRaceTest(unittest.TestCase):

    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="lock_race_")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)

    def test_exactly_one_of_several_racers_takes_over_a_stale_lock(self):
        env = dict(os.environ, PYTHONPATH=REPO)
        for round_ in range(ROUNDS):
            logdir = os.path.join(self.root, f"run{round_}")
            os.makedirs(logdir)
            os.makedirs(logdir + ".tried")
            with open(os.path.join(logdir, "trainer.lock"), "w") as f:
                json.dump({"pid": _dead_pid(), "hostname": socket.gethostname(),
                           "proc_start_ticks": 1, "start_time": "earlier"}, f)
            start = time.time() + 1.5  # After every racer has started and imported.
            procs = [subprocess.Popen([sys.executable, "-c", RACER, logdir, str(start),
                                       str(RACERS)],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
                     for _ in range(RACERS)]
            try:
                outs = [p.communicate(timeout=60)[0] for p in procs]
            finally:
                for p in procs:  # Only the processes started here, by PID.
                    if p.poll() is None:
                        p.kill()
                        p.communicate()
            for p, out in zip(procs, outs):
                self.assertEqual(0, p.returncode, msg=out)
                self.assertNotIn("Traceback", out)
            winners = [out for out in outs if out.startswith("ACQUIRED")]
            self.assertEqual(1, len(winners), msg=f"round {round_}: {outs}")
            self.assertEqual(RACERS - 1, sum(out.startswith("REFUSED") for out in outs),
                             msg=outs)
            self.assertFalse(os.path.exists(os.path.join(logdir, "trainer.lock")))


if __name__ == "__main__":
    unittest.main()
