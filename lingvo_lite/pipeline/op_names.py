"""The names of the ops a pipeline emits: one format, one parser.

The executor emits every action as calls of its cell's functions, each traced once and called
once per micro-batch. Two kinds of names come out of that:

- call sites in the step's graph carry the action: `cell_{k}/fprop_mb_{t}/...` for the forward
  F(k, t), `cell_{k}/bprop_mb_{t}/...` for the backward B(k, t), `cell_{k}/wgrad_mb_{t}/...`
  for the weight gradient W(k, t) of a schedule that splits the backward (zero-bubble);
- ops inside a cell's functions carry the function but not the micro-batch (the body is shared
  by all T calls): `cell_{k}/fprop/...` (the forward), `cell_{k}/bprop/recompute/...` and
  `cell_{k}/bprop/...` (the re-computed forward and the backward of a re-materialised action),
  `cell_{k}/wgrad/...` (the weight gradient of a split backward, added to the sums in the same
  function);
- with `weight_gradients='batched'`, one call per cell computes the weight gradient of all
  micro-batches at once after the cell's last backward: call site `cell_{k}/wgrad_all/...`,
  body `cell_{k}/wgrad/...`; its micro-batch is `ALL_MICRO_BATCHES`;
- a micro-batch that keeps its activations runs its forward inline at its call site
  (`cell_{k}/fprop_mb_{t}/fprop/...`), and TensorFlow names the tape gradient of those ops
  `gradient_tape/cell_{k}/fprop_mb_{t}/...` (tape gradients traced inside a function:
  `gradient_tape/<forward op>/...`); its weight gradients are added to the cell's sums at the
  call site too, `cell_{k}/bprop_mb_{t}/accumulate/...`.

With data-parallel replicas every name above is preceded by `replica_{r}/`. `parse` maps any of
these to a `ParsedName`; a function-body op's micro-batch comes from the order in which its
function ran (`trace_analysis.assign_micro_batches`).

Example:
    >>> parse("gradient_tape/cell_1/fprop_mb_3/fprop/dense/MatMul/MatMul")
    ParsedName(cell=1, phase='B', micro_batch=3, family='fprop_gradient', replica=0)
"""

from __future__ import annotations

import dataclasses
import re

from lingvo_lite.pipeline.schedules.schedule import Phase, Schedule

__all__: list[str] = []

FORWARD, RECOMPUTE, BACKWARD, WEIGHT = "F", "R", "B", "W"
RECOMPUTE_SCOPE = "recompute"
# Function families: which calls a function-body op belongs to.
FPROP, BPROP, ACCUMULATE = "fprop", "bprop", "accumulate"
WGRAD = "wgrad"  # The weight gradient W(k, t) of a split backward, summed into the cell's.
FPROP_GRADIENT = "fprop_gradient"  # The tape gradient of a kept (inline) forward.
FAMILIES = (FPROP, BPROP, ACCUMULATE, FPROP_GRADIENT, WGRAD)
_FUNCTIONS = (FPROP, BPROP, WGRAD)
_CALL_KIND = {FORWARD: FPROP, BACKWARD: BPROP, WEIGHT: WGRAD}
ALL_MICRO_BATCHES = -1  # The micro-batch of the one batched weight-gradient call per cell.
BATCHED_WGRAD_SCOPE = f"{WGRAD}_all"

_NAME = re.compile(
    r"^(?P<grad>gradient_tape/|gradients/)?(?:.*?/)?"
    r"cell_(?P<cell>\d+)/(?P<kind>fprop|bprop|wgrad)(?:_mb_(?P<t>\d+)|(?P<all>_all))?/"
    r"(?P<rest>.*)$")
_REPLICA = re.compile(r"(?:^|/)replica_(?P<replica>\d+)/cell_\d+/")


@dataclasses.dataclass(frozen=True)
class ParsedName:
    """What an op name says: cell, phase (F, R, B or W), micro-batch (None inside a function)."""

    cell: int
    phase: str
    micro_batch: int | None
    family: str  # One of FAMILIES: the function (or call site kind) the op belongs to.
    replica: int = 0


def _replica_prefix(replica: int | None) -> str:
    return "" if replica is None else f"replica_{replica}/"


def action_scope(phase: str, cell: int, micro_batch: int) -> str:
    """The name scope of the call site of action `phase`(cell, micro_batch), phase F, B or W."""
    if phase not in _CALL_KIND:
        raise ValueError(f"phase={phase!r}: actions are one of {tuple(_CALL_KIND)}")
    return f"cell_{cell}/{_CALL_KIND[phase]}_mb_{micro_batch}"


def function_scope(family: str, cell: int, replica: int | None = None) -> str:
    """The name scope opened inside cell `cell`'s function of `family` (fprop, bprop, ...)."""
    if family not in _FUNCTIONS:
        raise ValueError(f"family={family!r}: functions are one of {_FUNCTIONS}")
    return f"{_replica_prefix(replica)}cell_{cell}/{family}"


def parse(name: str) -> ParsedName | None:
    """The cell, phase, micro-batch and family of a pipeline op's name; None for other ops."""
    m = _NAME.match(name)
    if m is None:
        return None
    cell = int(m.group("cell"))
    t = None if m.group("t") is None else int(m.group("t"))
    if m.group("all"):
        if m.group("kind") != WGRAD:
            return None
        t = ALL_MICRO_BATCHES
    replica_match = _REPLICA.search(name)
    replica = int(replica_match.group("replica")) if replica_match else 0
    kind, rest, grad = m.group("kind"), m.group("rest"), m.group("grad")
    if kind == BPROP and rest.startswith(ACCUMULATE + "/"):
        return ParsedName(cell, BACKWARD, t, ACCUMULATE, replica)
    if kind == WGRAD:
        return ParsedName(cell, WEIGHT, t, WGRAD, replica)
    if kind == FPROP:
        if grad:
            return ParsedName(cell, BACKWARD, t, FPROP_GRADIENT, replica)
        return ParsedName(cell, FORWARD, t, FPROP, replica)
    recomputed = rest.startswith(RECOMPUTE_SCOPE + "/") or f"/{RECOMPUTE_SCOPE}/" in rest
    phase = RECOMPUTE if recomputed and not grad else BACKWARD
    return ParsedName(cell, phase, t, BPROP, replica)


def batched_weight_gradient_scope(cell: int) -> str:
    """The name scope of cell `cell`'s one weight-gradient call for all micro-batches."""
    return f"cell_{cell}/{BATCHED_WGRAD_SCOPE}"


def function_runs(sched: Schedule, keep: frozenset[tuple[int, int]],
                  kept_inline: bool = True,
                  batched_weight_grads: bool = False) -> dict[tuple[int, str], list[int]]:
    """Per (cell, function family), the micro-batches of that function's calls in run order.

    `keep` is the remat plan (`remat.remat_plan`). A cell's actions run one after the other in
    its schedule order, so the j-th run of a function's ops on cell k belongs to the j-th entry
    here: this is how a profiler trace, whose function-body ops carry no micro-batch, is mapped
    back to actions.

    The families each action calls. A kept micro-batch's forward and its gradient run inline
    (`kept_inline`, the executor's choice except on serial devices), so their ops carry the
    micro-batch and run no function; otherwise the forward is an fprop call and its gradient
    TensorFlow's gradient function of that call (fprop_gradient). A kept backward adds its
    weight gradients to the sums at the call site (accumulate ops carry the micro-batch):
      F(k, t): fprop, unless kept and inline.
      B(k, t), whole backward or a split backward's B (the weight gradients of `weight_ops`
        deferred): kept -> fprop_gradient if not inline; else bprop (which re-computes and
        adds to the sums).
      W(k, t): wgrad (one function computes the deferred weight gradients from B's records
        and adds them to the sums).
    With `batched_weight_grads` (and T > 1, a schedule that does not split the backward) every
    backward is a split backward's B, and after the cell's last one a wgrad call for
    ALL_MICRO_BATCHES computes the deferred weight gradients of all of them.
    """
    batched = (batched_weight_grads and not sched.splits_backward
               and sched.num_micro_batches > 1)
    kept_gradient = [] if kept_inline else [FPROP_GRADIENT]
    runs: dict[tuple[int, str], list[int]] = {}
    for k in range(sched.num_cells):
        for action in sched.cell_order(k):
            t = action.micro_batch
            if action.phase is Phase.FORWARD:
                families = [] if (k, t) in keep and kept_inline else [FPROP]
            elif action.phase is Phase.WEIGHT:
                families = [WGRAD]
            elif (k, t) in keep:
                families = kept_gradient
            else:
                families = [BPROP]
            for family in families:
                runs.setdefault((k, family), []).append(t)
        if batched:
            runs.setdefault((k, WGRAD), []).append(ALL_MICRO_BATCHES)
    return runs
