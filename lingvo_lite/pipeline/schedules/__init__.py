"""Schedules as data: per-device action lists, their text form, a parser, a validator, and
the one registry of schedule names.

`schedule` holds the `Schedule` base class (actions, dependencies, deadlock reports, the text
form), GPipe, 1F1B, zero-bubble and interleaved, and the registry (`make_schedule`,
`schedule_classes`, and which schedules the planner tries and the micro-batch loop runs);
`zbv_schedule` is ZB-V in a module of its own (how a new schedule is added); `custom_schedule`
reads per-device orders written by hand and validates them.

>>> from lingvo_lite.pipeline import schedules
>>> print(schedules.make_schedule("1f1b", 2, 2).format_orders())
device 0: F0 F1 B0 B1
device 1: F0 B0 F1 B1

Imported on first use, like the names of `lingvo_lite`.
"""

from lingvo_lite.core import _lazy

_EXPORTS = {
    "Schedule": "lingvo_lite.pipeline.schedules.schedule",
    "make_schedule": "lingvo_lite.pipeline.schedules.schedule",
    "schedule_classes": "lingvo_lite.pipeline.schedules.schedule",
    "CustomSchedule": "lingvo_lite.pipeline.schedules.custom_schedule",
    "parse_orders": "lingvo_lite.pipeline.schedules.custom_schedule",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = _lazy.exporter(__name__, _EXPORTS, globals())
