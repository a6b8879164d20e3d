"""replica_means: weighted means over replicas against numpy."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.distributed import collectives, replica_means


class WeightedMeanGradsTest(tf.test.TestCase):

    def test_each_cells_gradients_are_the_weighted_mean_over_the_replicas(self):
        rng = np.random.default_rng(0)
        # Two replicas of two cells on four devices; leaf 0 belongs to cell 0, leaves 1-2 to
        # cell 1; leaf 3 is untrained (None).
        values = [[rng.normal(size=(3,)), rng.normal(size=(2, 2)), rng.normal(size=()), None]
                  for _ in range(2)]
        weights = [3.0, 1.0]
        reduces = [collectives.AllReduce(["/device:CPU:0", "/device:CPU:2"]),
                   collectives.AllReduce(["/device:CPU:1", "/device:CPU:3"])]
        grads = [NestedMap(a=tf.constant(v[0]), b=tf.constant(v[1]), c=tf.constant(v[2]),
                           d=None) for v in values]
        got = replica_means.weighted_mean_grads(
            grads, [tf.constant(w) for w in weights], reduces, cell_of_leaf=[0, 1, 1, 0])
        for name, i in (("a", 0), ("b", 1), ("c", 2)):
            want = (weights[0] * values[0][i] + weights[1] * values[1][i]) / sum(weights)
            for r in range(2):
                self.assertAllClose(want, got[r][name], rtol=1e-12)
        self.assertIsNone(got[0].d)
        self.assertIn("CPU:2", got[1].a.device)  # Each replica's mean on its own device.


if __name__ == "__main__":
    tf.test.main()
