"""bench/time_model.py: a schedule's step from each cell's timed calls, worked out by hand."""

from __future__ import annotations

import os
import sys

from absl.testing import absltest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))

import time_model  # noqa: E402

# K=2 cells, forward 1; a re-computing backward call 3 (its forward re-run included); a kept
# micro-batch's forward-and-backward pair 3, so its B is 2; each cell's update 1.
COSTS = {"forward": [1.0, 1.0], "bprop": [3.0, 3.0], "kept": [3.0, 3.0],
         "input_only": [2.0, 2.0], "kept_input_only": [2.5, 2.5], "wgrad": [1.0, 1.0],
         "update": 2.0, "update_cells": [1.0, 1.0]}


class PredictedFromPhaseCostsTest(absltest.TestCase):

    def test_devices_alone(self):
        # gpipe, T=2, remat except_last (micro-batch 1 keeps its activations): F00 [0, 1];
        # F01 and F10 [1, 2]; F11 [2, 3]; B11 kept [3, 5]; B10 re-computes [5, 8] beside B01
        # kept [5, 7]; B00 [8, 11]; device 1 updates [8, 9], device 0 [11, 12].
        self.assertAlmostEqual(12.0, time_model.predicted_from_phase_costs(
            COSTS, "gpipe", 2, 1, "except_last"))

    def test_co_run_slowdown_of_each_call(self):
        # Two processors; beside a copy of itself the forward runs 2x slower, the kept pair
        # 1.5x, the re-computing call 2x, device 0's update 1x, device 1's 3x; two jobs slow
        # each other by 1 + sqrt(excess x excess). F00 [0, 1]; F01 and F10 side by side at
        # 1/2: [1, 3]; F11 [3, 4]; B11 [4, 6]; from 6, B01 (2 of work) and B10 (3) at
        # 1 / (1 + sqrt(0.5)): B01 ends at 8 + sqrt(2), B10's last 1 alone until 9 + sqrt(2);
        # then B00 (3) beside device 1's update (1), both at 1 / (1 + sqrt(2)): the update
        # ends at 10 + 2 sqrt(2), B00's last 2 alone until 12 + 2 sqrt(2); device 0's update
        # 1 more.
        co_run = {"forward": [2.0, 2.0], "kept": [1.5, 1.5], "bprop": [2.0, 2.0],
                  "update_cells": [1.0, 3.0]}
        self.assertAlmostEqual(13.0 + 2.0 * 2.0 ** 0.5, time_model.predicted_from_phase_costs(
            COSTS, "gpipe", 2, 1, "except_last", processors=2, co_run=co_run))

    def test_a_kept_micro_batch_has_no_w_on_serial_devices(self):
        # zero_bubble, T=1: the micro-batch keeps its activations on both cells; F [0, 1] and
        # [1, 2]; cell 1's B (the kept pair 2.5 less the forward) [2, 3.5]. On serial devices
        # its weight gradients were computed in B, so W is empty: device 1 updates [3.5, 4.5];
        # cell 0's B [3.5, 5], its update [5, 6]. Where B defers them, each W takes 1 more:
        # device 1's W [3.5, 4.5] and update [4.5, 5.5]; device 0's W [5, 6], update [6, 7].
        self.assertAlmostEqual(6.0, time_model.predicted_from_phase_costs(
            COSTS, "zero_bubble", 1, 1, "except_last"))
        self.assertAlmostEqual(7.0, time_model.predicted_from_phase_costs(
            COSTS, "zero_bubble", 1, 1, "except_last", serial_devices=False))

    def test_a_device_update_factor_weighs_its_cells_updates(self):
        # Interleaved, 4 cells on 2 devices: device 0 updates cells 0 and 2 (1 and 3 of
        # work, factors 1 and 3: (1 + 9) / 4), device 1 cells 1 and 3 (2 and 0, 2 and 5).
        sched = time_model.schedule.make_schedule("interleaved", 4, 2, 2)
        self.assertEqual([2.5, 2.0], time_model.device_update_factors(
            sched, [1.0, 2.0, 3.0, 0.0], [1.0, 2.0, 3.0, 5.0]))

if __name__ == "__main__":
    absltest.main()
