"""Prediction and observation of pipelined steps: what a user reads before and after a run.

Prediction from params and costs alone: `simulator` (replays a schedule with action
durations: step time, bubble, Figure 4 breakdown) and `memory_model` (each device's peak
memory). Observation of a profiled step: `trace_analysis` (profiler ops -> boxes per cell,
phase and micro-batch), `gantt` and `chrome_trace` (charts), `ideal_timeline` and
`breakdown_advice` (what to change). The runtime (`lingvo_lite.pipeline`) never imports this
package; it reads the runtime's schedules and op names.

>>> from lingvo_lite import analysis, pipeline
>>> costs = analysis.PhaseCosts.uniform(2, forward=1.0, backward=2.0)
>>> analysis.simulate(pipeline.make_schedule("gpipe", 2, 4), costs, remat="never").step_time
15.0

Imported on first use, like the names of `lingvo_lite`.
"""

from lingvo_lite.core import _lazy

_EXPORTS = {
    "simulate": "lingvo_lite.analysis.simulator",
    "PhaseCosts": "lingvo_lite.analysis.simulator",
    "Prediction": "lingvo_lite.analysis.simulator",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = _lazy.exporter(__name__, _EXPORTS, globals())
