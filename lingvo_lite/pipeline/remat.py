"""Re-materialisation decided once, as data: which (cell, micro-batch) keep their activations.

A forward F(k, t) either keeps its activations (it runs under a tape and its backward
differentiates what was kept) or keeps only its boundary output (its backward re-runs the forward
first). `remat_plan` makes that choice for every action of a schedule before anything is built,
so the executor, the simulator and the memory model all read the same answer.

Example:
    >>> from lingvo_lite.pipeline.schedules import schedule
    >>> sorted(remat_plan(schedule.make_schedule("gpipe", 2, 3), "except_last"))
    [(0, 2), (1, 2)]
"""

from __future__ import annotations

import functools

from lingvo_lite.pipeline.schedules.schedule import Action, Phase, Schedule

__all__: list[str] = []

REMAT_MODES = ("always", "except_last", "never")


def check_remat_mode(mode: str) -> None:
    if mode not in REMAT_MODES:
        raise ValueError(f"remat={mode!r}; use one of {REMAT_MODES}.")


# The planner asks for the same (schedule, mode) several times (its own check, the
# simulator, the memory model); a schedule never changes, so the answer is kept.
@functools.lru_cache(maxsize=32)
def remat_plan(sched: Schedule, mode: str) -> frozenset[tuple[int, int]]:
    """The (cell, micro_batch) pairs whose forward keeps its activations for the backward.

    'never': all of them; 'always': none; 'except_last': those whose backward B directly
    follows their forward on the device (in GPipe's fill-drain, the last micro-batch of every
    cell), where recomputing would be pure waste: the activations are still there. On a
    device that holds several cells (interleaved) "directly" means with no action of any of
    its cells in between. In a schedule that splits the backward, the re-computation belongs
    to B (input gradient); W uses what B computed.
    """
    check_remat_mode(mode)
    keep = set()
    for order in sched.device_orders():
        for i, action in enumerate(order):
            if action.phase is not Phase.FORWARD:
                continue
            k = action.cell
            if mode == "never" or (
                    mode == "except_last" and i + 1 < len(order)
                    and order[i + 1] == Action(Phase.BACKWARD, k, action.micro_batch)):
                keep.add((k, action.micro_batch))
    return frozenset(keep)


@functools.lru_cache(maxsize=32)
def recomputed_actions(sched: Schedule, mode: str) -> frozenset[Action]:
    """The backward actions (B, never W) that first re-run their forward under `mode`."""
    keep = remat_plan(sched, mode)
    return frozenset(Action(Phase.BACKWARD, k, t) for k in range(sched.num_cells)
                     for t in range(sched.num_micro_batches) if (k, t) not in keep)
