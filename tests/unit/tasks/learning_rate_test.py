"""Learning-rate schedules against their formulas, evaluated here in plain Python."""

from __future__ import annotations

import math

import tensorflow as tf

from lingvo_lite.tasks import learning_rate

STEPS = [0, 1, 2, 99, 100, 101, 299, 300, 301, 999, 1000, 1500]


def _values(params) -> list[float]:
    schedule = params.Instantiate()
    return [float(schedule.value(tf.constant(step, tf.int64))) for step in STEPS]


class ScheduleTest(tf.test.TestCase):

    def test_constant(self):
        self.assertAllClose([1.0] * len(STEPS), _values(learning_rate.Constant.Params()))

    def test_exponential_decay_staircase_and_smooth(self):
        for staircase in (True, False):
            params = learning_rate.ExponentialDecay.Params().Set(
                decay_rate=0.97, decay_steps=100, staircase=staircase)
            want = [0.97 ** (math.floor(s / 100) if staircase else s / 100) for s in STEPS]
            self.assertAllClose(want, _values(params), rtol=1e-6)

    def test_exponential_decay_warm_up(self):
        params = learning_rate.ExponentialDecay.Params().Set(
            decay_rate=0.5, decay_steps=300, warmup_steps=100)
        want = [0.5 ** math.floor(s / 300) * min(1.0, (s + 1) / 100) for s in STEPS]
        self.assertAllClose(want, _values(params), rtol=1e-6)

    def test_transformer_schedule(self):
        params = learning_rate.TransformerSchedule.Params().Set(warmup_steps=300, model_dim=512)
        want = [512 ** -0.5 * min((s + 1) ** -0.5, (s + 1) * 300 ** -1.5) for s in STEPS]
        self.assertAllClose(want, _values(params), rtol=1e-6)
        # The peak is at the end of the warm-up.
        self.assertEqual(STEPS.index(299), max(range(len(want)), key=want.__getitem__))

    def test_cosine_decay(self):
        params = learning_rate.CosineDecay.Params().Set(
            warmup_steps=100, total_steps=1000, final_factor=0.1)

        def factor(s):
            if s < 100:
                return (s + 1) / 100
            progress = min(max((s - 100) / 900, 0.0), 1.0)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        self.assertAllClose([factor(s) for s in STEPS], _values(params), rtol=1e-5)
        self.assertAllClose(0.1, _values(params)[STEPS.index(1500)], rtol=1e-6)


if __name__ == "__main__":
    tf.test.main()
