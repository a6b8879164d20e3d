"""Suggestions from the breakdown: they fire for an imbalanced partition, not a balanced one."""

from __future__ import annotations

import unittest

from lingvo_lite.analysis import breakdown_advice, trace_analysis
from lingvo_lite.pipeline.schedules import schedule

GPIPE_K2_T8 = schedule.make_schedule("gpipe", 2, 8)
CONFIG = breakdown_advice.PipelineConfig(GPIPE_K2_T8)


def _breakdown(busy0: float, busy1: float, bubble: float) -> trace_analysis.Breakdown:
    """A 100 ms step: 5% setup, 5% weight update, devices busy busy0 and busy1 of it."""
    pipelined = 0.9
    mean = (busy0 + busy1) / 2
    return trace_analysis.Breakdown(
        step_ns=100_000_000, setup=0.05, compute=mean, recompute=0.0,
        load_imbalance=max(busy0, busy1) - mean, bubble=bubble, weight_update=0.05,
        device_busy=(busy0, busy1),
        device_idle_in_pipeline=(1 - busy0 / pipelined, 1 - busy1 / pipelined))


class AdviceTest(unittest.TestCase):

    def test_imbalanced_partition_gets_a_rebalancing_suggestion(self):
        # Device 1 busy 72% of the step, device 0 36%: 2x; imbalance (72 - 54)% = 18%.
        b = _breakdown(0.36, 0.72, bubble=0.18)
        line = breakdown_advice.summary_line(b, CONFIG)
        self.assertTrue(line.startswith("bubble 18%, load imbalance 18%: device 1 is 2.0x "
                                        "busier than device 0;"), msg=line)
        self.assertIn("partition_cost=", line)
        measured = breakdown_advice.PipelineConfig(
            GPIPE_K2_T8,
            partition_costs=("flops", "param_bytes", "activation_bytes", "measured"))
        self.assertIn("consider partition_cost='measured'",
                      breakdown_advice.summary_line(b, measured))
        already = breakdown_advice.PipelineConfig(
            GPIPE_K2_T8, partition_cost="measured",
            partition_costs=("flops", "param_bytes", "activation_bytes", "measured"))
        line = breakdown_advice.summary_line(b, already)
        self.assertNotIn("consider partition_cost", line)
        self.assertIn("re-measure them on a quiet machine", line)
        self.assertIn("move layers off device 1", line)

    def test_balanced_partition_gets_no_suggestion(self):
        # Both devices busy 80% of the step: GPipe's bound at K=2, T=8 is 1/9 = 11% of
        # the 90% pipelined time, i.e. 10% of the step; measured bubble 10%.
        b = _breakdown(0.80, 0.80, bubble=0.10)
        self.assertEqual([], breakdown_advice.advice(b, CONFIG))
        self.assertEqual("bubble 10%, load imbalance 0%: balanced, nothing to suggest",
                         breakdown_advice.summary_line(b, CONFIG))

    def test_few_micro_batches_suggest_more(self):
        b = _breakdown(0.45, 0.45, bubble=0.45)
        few = breakdown_advice.PipelineConfig(schedule.make_schedule("gpipe", 2, 1))
        tips = breakdown_advice.advice(b, few)
        # GPipe at K=2: (K-1)/(T+K-1) = 1/2 at T=1, 1/9 at T=8.
        self.assertTrue(any("at T=1 the gpipe schedule's bubble is 50%" in t
                            and "num_micro_batches=8 would bring it to 11%" in t
                            for t in tips), msg=tips)

    def test_markdown_table_lists_every_part_and_device(self):
        text = breakdown_advice.markdown(_breakdown(0.36, 0.72, bubble=0.18), CONFIG)
        for row in ("| setup | 5.0% | 5.00 |", "| load imbalance | 18.0% | 18.00 |",
                    "| bubble | 18.0% | 18.00 |", "| 0 | 36.0% | 60.0% |",
                    "| 1 | 72.0% | 20.0% |"):
            self.assertIn(row, text)
        self.assertIn("- load imbalance 18%: device 1 is 2.0x busier", text)

    def test_interleaved_bound_counts_devices_and_virtual_stages(self):
        # 4 cells on D=2 devices (v=2), T=2: (D-1)/(vT+D-1) = 1/5 of the pipelined time,
        # where GPipe's bound for 4 cells would say 3/5 and for 2 devices without
        # interleaving 1/3.
        config = breakdown_advice.PipelineConfig(
            schedule.make_schedule("interleaved", 4, 2, virtual_stages=2))
        self.assertEqual(2, config.num_devices)
        self.assertAlmostEqual(1 / 5, config.bubble_bound())
        text = breakdown_advice.markdown(_breakdown(0.45, 0.45, bubble=0.45), config)
        self.assertIn("The interleaved schedule's bubble at K=4 cells on D=2 devices, T=2: "
                      "20.0%", text)
        tips = breakdown_advice.advice(_breakdown(0.45, 0.45, bubble=0.45), config)
        self.assertTrue(any("at T=2 the interleaved schedule's bubble is 20%" in t
                            for t in tips), msg=tips)

    def test_zbv_bound_and_devices_come_from_the_schedule(self):
        # ZB-V, 4 cells on 2 devices (device d holds cells d and 3-d), T=2: 12 actions per
        # device in 13 unit ticks; device 1 waits one tick for 0F0, device 0 one for 2F0
        # before 3F0: 2 idle slots of 26, 1/13. The table lists 2 devices, not 4 cells.
        config = breakdown_advice.PipelineConfig(schedule.make_schedule("zbv", 4, 2))
        self.assertEqual(2, config.num_devices)
        self.assertAlmostEqual(1 / 13, config.bubble_bound())
        text = breakdown_advice.markdown(_breakdown(0.45, 0.45, bubble=0.45), config)
        self.assertIn("The zbv schedule's bubble at K=4 cells on D=2 devices, T=2: 7.7%", text)
        self.assertNotIn("| 2 |", text)


if __name__ == "__main__":
    unittest.main()
