"""The Gantt figure, checked through matplotlib's objects against a hand-written step.

The step: K=2 devices, T=2 micro-batches, GPipe order, times in ns chosen so every box is
wide (labels fit) and one device idles at known times. Every expectation below is stated from
this table, not from the code under test.
"""

from __future__ import annotations

import unittest

import numpy as np
from matplotlib.patches import Rectangle
from matplotlib.text import Text

from lingvo_lite.analysis import chrome_trace, gantt, ideal_timeline, trace_analysis
from lingvo_lite.pipeline import op_names
from lingvo_lite.pipeline.schedules import custom_schedule, schedule

MS = 1_000_000  # ns
T0 = 5 * MS  # The first op's start on the profiler clock: the chart's time 0.


def _box(cell, phase, mb, start_ms, end_ms):
    start, end = T0 + start_ms * MS, T0 + end_ms * MS
    return trace_analysis.Box(cell, phase, mb, start, end, end - start, 3, ((start, end),))


# (cell, phase, micro-batch, start ms, end ms) of the measured step.
STEP = [
    (0, "F", 0, 0, 10), (0, "F", 1, 10, 20),
    (1, "F", 0, 10, 20), (1, "F", 1, 20, 30), (1, "B", 1, 30, 50), (1, "B", 0, 50, 70),
    (0, "R", 1, 50, 55), (0, "B", 1, 55, 75), (0, "R", 0, 75, 80), (0, "B", 0, 80, 100),
]
BOXES = [_box(*row) for row in STEP]
INFO = gantt.StepInfo(model="TinyModel", num_cells=2, num_micro_batches=2, schedule="gpipe",
                      remat="always", step_ms=110.0)
BREAKDOWN = trace_analysis.Breakdown(
    step_ns=110 * MS, setup=0.05, compute=0.55, recompute=0.05, load_imbalance=0.1,
    bubble=0.2, weight_update=0.05, device_busy=(0.9, 0.6), device_idle_in_pipeline=(0.0, 0.3))


def _overlapping(extents: list) -> list[tuple[int, int]]:
    """Pairs of boxes that overlap (`Bbox.overlaps`), found by a sweep over x: only boxes
    whose x ranges meet are compared (all pairs of ~800 labels took a minute)."""
    order = sorted(range(len(extents)), key=lambda i: extents[i].x0)
    found = []
    for n, i in enumerate(order):
        for j in order[n + 1:]:
            if extents[j].x0 >= extents[i].x1:
                break
            if extents[i].overlaps(extents[j]):
                found.append((min(i, j), max(i, j)))
    return found


def _axes(fig, label):
    return next(ax for ax in fig.axes if ax.get_label() == label)


def _phase_legend(fig) -> list[str]:
    """The entries of the figure's one legend that has an 'idle' entry."""
    legends = [[t.get_text() for t in ax.get_legend().get_texts()]
               for ax in fig.axes if ax.get_legend() is not None]
    found = [entries for entries in legends if "idle" in entries]
    assert len(found) == 1, legends
    return found[0]


def _rect(ax, gid) -> Rectangle:
    found = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_gid() == gid]
    assert len(found) == 1, (gid, len(found))
    return found[0]


class GanttFigureTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.fig = gantt.gantt_figure(BOXES, INFO, breakdown=BREAKDOWN)
        cls.ax = _axes(cls.fig, "measured")

    def test_one_row_per_device_and_a_time_axis_in_ms(self):
        labels = [t.get_text() for t in self.ax.get_yticklabels()]
        self.assertEqual(2, len(labels))
        self.assertTrue(labels[0].startswith("device 0") and labels[1].startswith("device 1"))
        self.assertIn("(ms)", self.ax.get_xlabel())
        self.assertEqual((0.0, 100.0), self.ax.get_xlim())  # First op start to last op end.
        # Device 0 idles from 20 to 50 ms: 30 of 100 ms. Device 1: 0-10 and 70-100 ms.
        self.assertIn("idle 30%", labels[0])
        self.assertIn("idle 40%", labels[1])

    def test_a_box_per_action_with_its_start_duration_row_and_label(self):
        texts = {t.get_gid(): t for t in self.ax.texts if isinstance(t, Text)}
        for cell, phase, mb, start_ms, end_ms in STEP:
            name = f"{phase} cell {cell} mb {mb}"
            rect = _rect(self.ax, name)
            self.assertAlmostEqual(start_ms, rect.get_x())
            self.assertAlmostEqual(end_ms - start_ms, rect.get_width())
            self.assertAlmostEqual(cell, rect.get_y() + rect.get_height() / 2)
            label = texts[f"{name} label"]
            self.assertEqual(str(mb), label.get_text())
            x, y = label.get_position()
            self.assertAlmostEqual((start_ms + end_ms) / 2, x)
            self.assertAlmostEqual(cell, y)
        boxes = [p for p in self.ax.patches if (p.get_gid() or "")[:1] in "FRB"]
        self.assertEqual(len(STEP), len(boxes))

    def test_phase_colours_and_a_legend_entry_per_phase_present(self):
        self.assertEqual(["forward", "recompute", "backward", "between its ops", "idle"],
                         _phase_legend(self.fig))
        self.assertNotEqual(_rect(self.ax, "F cell 0 mb 0").get_facecolor()[:3],
                            _rect(self.ax, "B cell 0 mb 0").get_facecolor()[:3])
        without_recompute = [b for b in BOXES if b.phase != "R"]
        fig = gantt.gantt_figure(without_recompute, INFO)
        self.assertEqual(["forward", "backward", "between its ops", "idle"], _phase_legend(fig))

    def test_idle_band_spans_each_row(self):
        for k in range(2):
            band = _rect(self.ax, f"idle device {k}")
            self.assertEqual((0.0, 100.0), (band.get_x(), band.get_x() + band.get_width()))

    def test_title_names_model_k_t_schedule_remat_and_step_time(self):
        title = self.fig.get_suptitle()
        for fact in ("TinyModel", "K=2", "T=2", "gpipe", "remat always", "110.0 ms"):
            self.assertIn(fact, title)

    def test_breakdown_is_a_stacked_bar_of_the_six_parts(self):
        ax = _axes(self.fig, "breakdown")
        parts = [("setup", 5), ("compute", 55), ("recompute", 5), ("load_imbalance", 10),
                 ("bubble", 20), ("weight_update", 5)]
        left = 0.0
        for part, pct in parts:
            rect = _rect(ax, f"breakdown {part}")
            self.assertAlmostEqual(left, rect.get_x())
            self.assertAlmostEqual(pct, rect.get_width())
            left += pct
        self.assertAlmostEqual(100.0, left)

    def test_predicted_panel_replays_the_schedule(self):
        sched = schedule.make_schedule("gpipe", 2, 2)
        predicted = ideal_timeline.predict_from_measured(sched, BOXES)
        fig = gantt.gantt_figure(BOXES, INFO, predicted=predicted)
        ax = _axes(fig, "predicted")
        # Mean durations: F 10 ms on both devices, B 20 ms, R 5 ms on device 0. GPipe with
        # no waits: device 1 runs F0 10-20, F1 20-30, B1 30-50, B0 50-70; device 0 then
        # R1 50-55, B1 55-75, R0 75-80, B0 80-100: the hand-written step had no waits.
        for cell, phase, mb, start_ms, end_ms in STEP:
            rect = _rect(ax, f"{phase} cell {cell} mb {mb}")
            self.assertAlmostEqual(start_ms, rect.get_x())
            self.assertAlmostEqual(end_ms - start_ms, rect.get_width())
        self.assertEqual(_axes(fig, "measured").get_xlim(), ax.get_xlim())

    def test_predicted_weight_gradients_get_their_own_colour_and_legend_entry(self):
        # The measured step has no W; the zero-bubble prediction does. Mean durations as
        # above (F 10, B 20, R 5 ms on device 0) and W 10 ms: device 1 runs F0 10-20, B0
        # 20-40, F1 40-50, B1 50-70, W0 70-80, W1 80-90 (its order F0 B0 F1 B1 W0 W1).
        sched = schedule.make_schedule("zero_bubble", 2, 2)
        durations = ideal_timeline.mean_busy_ns(BOXES)
        durations.update({(0, "W"): 10 * MS, (1, "W"): 10 * MS})
        predicted = ideal_timeline.predict_boxes(sched, durations)
        fig = gantt.gantt_figure(BOXES, INFO, predicted=predicted)
        ax = _axes(fig, "predicted")
        for mb, start_ms in ((0, 70), (1, 80)):
            rect = _rect(ax, f"W cell 1 mb {mb}")
            self.assertAlmostEqual(start_ms, rect.get_x())
            self.assertAlmostEqual(10, rect.get_width())
        w_colour = _rect(ax, "W cell 1 mb 0").get_facecolor()[:3]
        for phase in ("F", "B"):
            self.assertNotEqual(w_colour, _rect(ax, f"{phase} cell 1 mb 0").get_facecolor()[:3])
        # The legend has the measured phases (R included) and the predicted W.
        self.assertEqual(["forward", "recompute", "backward", "weight gradient",
                          "between its ops", "idle"], _phase_legend(fig))

    def test_height_grows_with_k_and_large_pipelines_render(self):
        heights = {}
        for K, T in ((2, 8), (8, 32)):
            sched = schedule.make_schedule("gpipe", K, T)
            durations = {(k, p): d * MS for k in range(K) for p, d in (("F", 1), ("B", 2))}
            boxes = ideal_timeline.predict_boxes(sched, durations)
            fig = gantt.gantt_figure(boxes, gantt.StepInfo("M", K, T, "gpipe", "never", 1.0))
            image = gantt.render_rgb(fig)
            self.assertEqual(np.uint8, image.dtype)
            self.assertEqual(gantt.FIGURE_WIDTH_IN * gantt.DPI, image.shape[1])
            heights[K] = image.shape[0]
            labels = {t.get_gid() for t in _axes(fig, "measured").texts}
            # At T=8 every micro-batch is labelled on every device, at least in its backward
            # box. At K=8, T=32 a backward box is 2 of (T+K-1) x 3 = 117 ms, about 10 pixels:
            # too narrow for a number, so at least every 4th micro-batch is labelled.
            every = 1 if T <= 8 else 4
            for k in range(K):
                for t in range(0, T, every):
                    self.assertTrue({f"F cell {k} mb {t} label", f"B cell {k} mb {t} label"}
                                    & labels, msg=f"K={K}, T={T}, cell {k}, mb {t}")
        # Six more devices: six more rows, each tall enough for a line of text (30 px).
        self.assertGreaterEqual(heights[8] - heights[2], 6 * 30)

    def test_no_two_labels_overlap_at_k8_t32(self):
        for name, K, T in (("gpipe", 8, 32), ("1f1b", 8, 32), ("zbv", 8, 16)):
            sched = schedule.make_schedule(name, K, T)
            durations = {(k, p): d * MS for k in range(K)
                         for p, d in (("F", 1), ("B", 2), ("W", 1))}
            boxes = ideal_timeline.predict_boxes(sched, durations)
            fig = gantt.gantt_figure(boxes, gantt.StepInfo.of("M", sched, "never", 1.0),
                                     predicted=boxes)
            fig.canvas.draw()
            renderer = fig.canvas.get_renderer()
            for panel in ("measured", "predicted"):
                extents = [t.get_window_extent(renderer) for t in _axes(fig, panel).texts]
                self.assertGreater(len(extents), K * 4, msg=(name, panel))
                self.assertEqual([], _overlapping(extents), msg=(name, panel))

    def test_legend_names_every_shade(self):
        sched = schedule.make_schedule("zbv", 4, 4)
        durations = {(k, p): d * MS for k in range(4) for p, d in (("F", 1), ("B", 2), ("W", 1))}
        boxes = ideal_timeline.predict_boxes(sched, durations)
        fig = gantt.gantt_figure(boxes, gantt.StepInfo.of("M", sched, "never", 1.0))
        self.assertEqual(["forward", "backward", "weight gradient", "between its ops",
                          "later cell", "idle"], _phase_legend(fig))


if __name__ == "__main__":
    unittest.main()


class InterleavedAndBatchedTest(unittest.TestCase):

    def test_interleaved_cells_share_their_devices_row_and_later_stages_are_hatched(self):
        # 4 cells on 2 devices (v=2): device 0 runs cells 0 and 2, device 1 cells 1 and 3.
        rows = [(0, "F", 0, 0, 10), (1, "F", 0, 10, 20), (2, "F", 0, 20, 30),
                (3, "F", 0, 30, 40), (3, "B", 0, 40, 60), (2, "B", 0, 60, 80),
                (1, "B", 0, 80, 100), (0, "B", 0, 100, 120)]
        info = gantt.StepInfo("M", 4, 1, "interleaved", "never", 120.0,
                              cell_devices=schedule.make_schedule("interleaved", 4, 2,
                                                                  2).cell_devices)
        self.assertEqual((0, 1, 0, 1), info.cell_devices)
        fig = gantt.gantt_figure([_box(*r) for r in rows], info)
        ax = _axes(fig, "measured")
        labels = [t.get_text() for t in ax.get_yticklabels()]
        self.assertEqual(2, len(labels))
        # Device 0 is busy 0-10, 20-30, 60-80 and 100-120 ms: 60 of 120 ms idle.
        self.assertIn("idle 50%", labels[0])
        for cell, _, mb, _, _ in rows:
            rect = _rect(ax, f"F cell {cell} mb {mb}")
            self.assertAlmostEqual(cell % 2, rect.get_y() + rect.get_height() / 2)
        busy = {p.get_gid(): p for p in ax.collections}
        self.assertFalse(busy["F cell 0 mb 0 busy"].get_hatch())
        self.assertTrue(busy["F cell 2 mb 0 busy"].get_hatch())
        self.assertIn("K=4 on 2 devices", fig.get_suptitle())

    def test_zbv_cells_are_drawn_on_the_schedules_devices(self):
        # ZB-V, 4 cells on 2 devices: device 0 holds cells 0 and 3, device 1 cells 1 and 2
        # (not k % 2). One micro-batch, hand-placed: F down the V and back up, then B.
        rows = [(0, "F", 0, 0, 10), (1, "F", 0, 10, 20), (2, "F", 0, 20, 30),
                (3, "F", 0, 30, 40), (3, "B", 0, 40, 50), (2, "B", 0, 50, 60),
                (1, "B", 0, 60, 70), (0, "B", 0, 70, 80)]
        info = gantt.StepInfo.of("M", schedule.make_schedule("zbv", 4, 1), "never", 80.0)
        self.assertEqual((0, 1, 1, 0), info.cell_devices)
        fig = gantt.gantt_figure([_box(*r) for r in rows], info)
        ax = _axes(fig, "measured")
        labels = [t.get_text() for t in ax.get_yticklabels()]
        self.assertEqual(2, len(labels))
        # Device 0 runs cells 0 and 3: busy 0-10, 30-50 and 70-80 ms, idle 40 of 80 ms;
        # device 1 (cells 1 and 2) busy 10-30 and 50-70: idle 40 of 80 too. Under k % 2
        # device 0 would be busy 0-10, 20-30, 50-60, 70-80.
        self.assertIn("idle 50%", labels[0])
        self.assertAlmostEqual(0.5, gantt.device_idle_fraction(
            [_box(*r) for r in rows], 0, T0, T0 + 80 * MS, info.cell_devices))
        self.assertAlmostEqual(0.75, gantt.device_idle_fraction(
            [_box(*r) for r in rows if r[0] in (0, 3)][:2], 0, T0, T0 + 80 * MS,
            info.cell_devices))
        expected_row = {0: 0, 1: 1, 2: 1, 3: 0}
        for cell, phase, mb, _, _ in rows:
            rect = _rect(ax, f"{phase} cell {cell} mb {mb}")
            self.assertAlmostEqual(expected_row[cell], rect.get_y() + rect.get_height() / 2)
        busy = {p.get_gid(): p for p in ax.collections}
        # Each device's second cell (3 on device 0, 2 on device 1) is hatched.
        self.assertFalse(busy["F cell 0 mb 0 busy"].get_hatch())
        self.assertFalse(busy["F cell 1 mb 0 busy"].get_hatch())
        self.assertTrue(busy["F cell 2 mb 0 busy"].get_hatch())
        self.assertTrue(busy["F cell 3 mb 0 busy"].get_hatch())
        self.assertIn("K=4 on 2 devices", fig.get_suptitle())

    def test_custom_schedule_with_a_hand_written_mapping_is_drawn_on_its_devices(self):
        # A CustomSchedule from text: cells 0 and 1 on device 0, cell 2 on device 1 (not
        # k % 2, which would put cell 1 on device 1). Chart rows, trace tracks and the
        # breakdown's per-device busy time all follow that mapping.
        sched = custom_schedule.CustomSchedule(
            "device 0: 0F0 1F0 1B0 0B0\ndevice 1: 2F0 2B0", device_of_cell=(0, 0, 1))
        self.assertEqual((0, 0, 1), sched.cell_devices)
        rows = [(0, "F", 0, 0, 10), (1, "F", 0, 10, 20), (2, "F", 0, 20, 40),
                (2, "B", 0, 40, 80), (1, "B", 0, 80, 100), (0, "B", 0, 100, 120)]
        boxes = [_box(*r) for r in rows]
        info = gantt.StepInfo.of("M", sched, "never", 120.0)
        ax = _axes(gantt.gantt_figure(boxes, info), "measured")
        for cell, phase, mb, _, _ in rows:
            rect = _rect(ax, f"{phase} cell {cell} mb {mb}")
            self.assertAlmostEqual((0, 0, 1)[cell], rect.get_y() + rect.get_height() / 2)
        # Device 0 busy 0-20 and 80-120 ms (60 of 120): idle 50%; device 1 20-80: idle 50%.
        labels = [t.get_text() for t in ax.get_yticklabels()]
        self.assertEqual(2, len(labels))
        self.assertIn("idle 50%", labels[0])
        trace = chrome_trace.trace_events(boxes, step=1, cell_devices=info.cell_devices)
        tracks = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
                  if e["ph"] == "M" and e["name"] == "thread_name"}
        self.assertEqual({0: "device 0, cell 0", 1: "device 0, cell 1", 2: "device 1, cell 2"},
                         tracks)
        ev = trace_analysis.OpEvent
        events = [ev(f"cell_{c}/{'fprop' if p == 'F' else 'bprop'}_mb_0/MatMul", "MatMul",
                     start * MS, end * MS) for c, p, _, start, end in rows]
        breakdown = trace_analysis.compute_breakdown(events, cell_devices=sched)
        self.assertEqual((0.5, 0.5), tuple(round(b, 6) for b in breakdown.device_busy))

    def test_batched_weight_gradient_box_is_labelled_all(self):
        all_mb = op_names.ALL_MICRO_BATCHES
        rows = STEP + [(0, "W", all_mb, 100, 140), (1, "W", all_mb, 70, 110)]
        fig = gantt.gantt_figure([_box(*r) for r in rows], INFO)
        ax = _axes(fig, "measured")
        texts = {t.get_gid(): t.get_text() for t in ax.texts if isinstance(t, Text)}
        self.assertEqual("all", texts["W cell 0 mb all label"])
        self.assertIn("weight gradient", _phase_legend(fig))
