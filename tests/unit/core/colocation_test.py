"""colocation.colocated: ops and slots beside a variable (off a TPUStrategy: its device)."""

from __future__ import annotations

import doctest

import tensorflow as tf

from lingvo_lite.core import colocation


class ColocatedTest(tf.test.TestCase):

    def test_ops_land_on_the_variables_device(self):
        with tf.device("/device:CPU:1"):
            v = tf.Variable([1.0, 2.0])
        with colocation.colocated(v):
            w = v * 3.0
        self.assertIn("CPU:1", w.device)
        self.assertAllEqual([3.0, 6.0], w)
        self.assertIsNone(colocation.current_tpu_strategy())

    def test_docstring_example(self):
        self.assertEqual(0, doctest.testmod(colocation).failed)


if __name__ == "__main__":
    tf.test.main()
