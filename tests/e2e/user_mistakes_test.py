"""Common mistakes refused with one clear line (issue 39's API trips).

- `PipeliningLayer.FPropAndGrads(theta, a, b)`: `return_input_grads` is keyword-only, so a
  second input is refused at the call (it used to be read as the flag and fail deep inside the
  cell functions with `TypeError: unhashable type: 'NestedMap'` at K=2); a non-bool flag too.
- `--mode=check_equivalence` and `--mode=inspect_model` with num_micro_batches not dividing the
  batch: one `trainer.py: error:` line, exit status 1, no traceback (check_equivalence printed
  a traceback around the message; inspect_model exited 0 without naming the problem).
"""

from __future__ import annotations

import io
import subprocess

import tensorflow as tf
from conftest import launch_trainer, random_xy_batch, tanh_stack_with_loss

from lingvo_lite.core import fprop_context
from lingvo_lite.pipeline import pipelining_layer
from lingvo_lite.training import options, runner


class FPropAndGradsArgumentsTest(tf.test.TestCase):

    def _pipe(self):
        return pipelining_layer.PipeliningLayer.Params().Set(
            name="pipe", layers=tanh_stack_with_loss(3, 8, 4), num_cells=2,
            num_micro_batches=2, partition_method="uniform").Instantiate()

    def test_a_second_positional_input_is_refused_at_the_call(self):
        pipe = self._pipe()
        batch = random_xy_batch(4, 8, 4)
        with fprop_context.fprop_context(training=True):
            with self.assertRaisesRegex(TypeError, r"positional argument"):
                pipe.FPropAndGrads(pipe.theta, batch, batch)
            with self.assertRaisesRegex(
                    TypeError, r"pipe\.FPropAndGrads\(theta, inputs, return_input_grads=\.\.\.\): "
                               r"return_input_grads must be True or False, got NestedMap"):
                pipe.FPropAndGrads(pipe.theta, batch, return_input_grads=batch)
            out, grads, dx = pipe.FPropAndGrads(pipe.theta, batch, return_input_grads=True)
        self.assertEqual(dx.x.shape, batch.x.shape)


class BatchSplitMessagesTest(tf.test.TestCase):

    def test_micro_batches_not_dividing_the_batch_is_one_line(self):
        def expected(mode: str) -> list[str]:
            return [f"trainer.py: error: --mode={mode}: PipeliningLayer 'network': "
                    "num_micro_batches=3 does not divide the mini-batch size 16; choose one of "
                    "[1, 2, 4, 8, 16] or change the batch size."]

        # check_equivalence printed a traceback around the message: a real trainer.py.
        proc = launch_trainer("--model=tests.testdata_models.TinyMlp",
                              "--mode=check_equivalence", "--num_micro_batches=3",
                              stderr=subprocess.STDOUT)
        out = proc.communicate(timeout=300)[0]
        self.assertEqual(1, proc.returncode, msg=out)
        self.assertNotIn("Traceback", out)
        errors = [line for line in out.splitlines() if line.startswith("trainer.py: error:")]
        self.assertEqual(expected("check_equivalence"), errors, msg=out)
        # inspect_model exited 0 without naming the problem: runner.main, in-process.
        out, err = io.StringIO(), io.StringIO()
        status = runner.main(options.RunOptions(
            model="tests.testdata_models.TinyMlp", mode="inspect_model", num_micro_batches=3),
            out=out, err=err)
        self.assertEqual(1, status, msg=out.getvalue())
        self.assertEqual(expected("inspect_model"), err.getvalue().splitlines())
