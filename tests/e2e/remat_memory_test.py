"""GPipe's memory promise, measured in a fresh process: re-computation cuts the peak
activation memory (bench/remat_memory.py, whose allocator statistics need an environment
variable set before TensorFlow starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf
from conftest import REPO


class RematMemoryTest(tf.test.TestCase):

    @pytest.mark.slow
    def test_recomputation_cuts_peak_activation_memory_4x(self):
        # Measured in a subprocess: the BFC allocator statistics need an env var set
        # before TensorFlow starts. 16 layers, K=2, T=8 as in GPipe's O(N + L/K x N/T).
        # All logical devices share one allocator, so one inter-op thread keeps two cells'
        # recomputations from overlapping at random and makes the peak repeatable.
        script = os.path.join(REPO, "bench", "remat_memory.py")
        proc = subprocess.run(
            [sys.executable, script, "--num_layers=16", "--num_cells=2",
             "--num_micro_batches=8", "--modes=never,always", "--inter_op_threads=1"],
            capture_output=True, text=True, timeout=300, check=True)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        activations = result["activation_bytes"]  # Peak minus the returned gradients.
        self.assertGreaterEqual(activations["never"] / activations["always"], 4.0,
                                msg=str(result))


if __name__ == "__main__":
    tf.test.main()
