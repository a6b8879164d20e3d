"""What a layer declares about its memory: the record `FPropMeta` may carry, and its rules.

`FPropMeta` gives flops, output shapes and parameter counts (`base_layer.fprop_meta`) and,
optionally, one `MemoryRecord`: the bytes the layer keeps for its backward, its gradient
temporaries, what a deferred weight gradient holds. Everything left undeclared gets this
module's defaults. The memory model (`lingvo_lite.analysis.memory_model`) reads the records
through the functions here; the runtime never does.

Example:
    >>> import tensorflow as tf
    >>> from lingvo_lite.core import base_layer
    >>> meta = base_layer.fprop_meta(0, tf.TensorShape([8, 4]),
    ...                              memory=MemoryRecord(saved_activation_bytes=1024))
    >>> saved_activation_bytes(meta), backward_temporary_bytes(meta)  # max(2 x 128, 0.5 x 1024)
    (1024, 512)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = [
    "backward_temporary_bytes",
    "composite",
    "DEFAULT_GRADIENT_TEMPORARY_FACTOR",
    "DEFAULT_SAVED_ACTIVATION_FACTOR",
    "DEFAULT_SAVED_GRADIENT_FRACTION",
    "default_backward_temporary_bytes",
    "deferring_backward_temporary_bytes",
    "MemoryRecord",
    "record_of",
    "saved_activation_bytes",
    "saved_covers_input",
    "weight_op_bytes",
    "wrapped",
]

# Bytes a layer keeps for its backward, per byte of its output, when it declares none: its
# output (each op's output is what TensorFlow keeps for the gradient; the layer's input is
# the previous layer's output). Layers with larger internals (attention, wide feed-forward,
# AmoebaNet cells) declare their own sum.
DEFAULT_SAVED_ACTIVATION_FACTOR = 1.0
# Undeclared gradient temporaries: the gradient flowing in and the one going out (2x the
# output), or half of what the layer saved when its internals are larger.
DEFAULT_GRADIENT_TEMPORARY_FACTOR = 2.0
DEFAULT_SAVED_GRADIENT_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class MemoryRecord:
    """A layer's memory declarations, each for the whole mini-batch; None: not declared.

    Attributes:
      saved_activation_bytes: activations kept from the forward for the backward. Default:
        `DEFAULT_SAVED_ACTIVATION_FACTOR` x the output bytes.
      weight_op_bytes: inputs and output gradients of the ops that apply its weights through
        `layers.weight_ops`: what a deferred weight gradient holds from B to W.
      backward_temporary_bytes: gradient temporaries while back-propagating through it,
        beyond what it saved. Default: `default_backward_temporary_bytes`.
      inline_backward_temporary_bytes: the most its backward holds when each temporary is
        freed as soon as the backward has passed its last reader. Default: the above.
      deferring_backward_temporary_bytes: the same for a backward that defers its weight
        gradients (the records of the sub-layers it passed stay until W). Default: the
        inline figure.
      saved_covers_input: its saved bytes include the input its gradients read (attention,
        AmoebaNet cells), so a cell starting with it keeps no extra copy of its input.
    """

    saved_activation_bytes: int | None = None
    weight_op_bytes: int | None = None
    backward_temporary_bytes: int | None = None
    inline_backward_temporary_bytes: int | None = None
    deferring_backward_temporary_bytes: int | None = None
    saved_covers_input: bool = False

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type != "bool" and value is not None:
                object.__setattr__(self, field.name, int(value))

    def replace(self, **changes: Any) -> MemoryRecord:
        """A copy with `changes` applied."""
        return dataclasses.replace(self, **changes)


_EMPTY = MemoryRecord()


def record_of(meta: Any) -> MemoryRecord:
    """The MemoryRecord of an FPropMeta result (an empty one when it declared none)."""
    return meta.get("memory") or _EMPTY


def saved_activation_bytes(meta: Any) -> int:
    """Bytes of activations `meta`'s layer keeps for its backward (declared, else default)."""
    saved = record_of(meta).saved_activation_bytes
    if saved is None:
        return int(DEFAULT_SAVED_ACTIVATION_FACTOR * meta.out_bytes)
    return saved


def default_backward_temporary_bytes(out_bytes: int, saved_bytes: int) -> int:
    """The default gradient temporaries of a layer with these output and saved bytes."""
    return int(max(DEFAULT_GRADIENT_TEMPORARY_FACTOR * out_bytes,
                   DEFAULT_SAVED_GRADIENT_FRACTION * saved_bytes))


def backward_temporary_bytes(meta: Any) -> int:
    """Gradient temporaries while back-propagating through `meta`'s layer (declared, else
    `default_backward_temporary_bytes`)."""
    declared = record_of(meta).backward_temporary_bytes
    if declared is not None:
        return declared
    return default_backward_temporary_bytes(meta.out_bytes, saved_activation_bytes(meta))


def saved_covers_input(meta: Any) -> bool:
    """Whether `meta`'s saved activations already count what its backward reads of its input.

    >>> import tensorflow as tf
    >>> from lingvo_lite.core import base_layer
    >>> saved_covers_input(base_layer.fprop_meta(0, tf.TensorShape([8, 4])))
    False
    """
    return record_of(meta).saved_covers_input


def _has_trained_weights(meta: Any) -> bool:
    return int(meta.num_params) > int(meta.get("non_trainable_params", 0))


def weight_op_bytes(metas: Sequence[Any]) -> int | None:
    """The sum of the layers' declared `weight_op_bytes`; None if a layer with trainable
    weights declared none (a composite layer cannot declare a complete sum)."""
    total = 0
    for m in metas:
        declared = record_of(m).weight_op_bytes
        if declared is None:
            if _has_trained_weights(m):
                return None
            continue
        total += declared
    return total


def deferring_backward_temporary_bytes(metas: Sequence[Any]) -> int:
    """The most a chain of `metas`' layers holds beyond its saved activations while a backward
    that defers weight gradients passes it: through layer i, its own temporaries plus what the
    layers after it, already passed, keep for W beyond what they saved (a matmul's input is
    saved, its output's gradient is not; an undeclared layer with weights: its output).

    >>> import tensorflow as tf
    >>> from lingvo_lite.core import base_layer
    >>> a = base_layer.fprop_meta(0, tf.TensorShape([8, 4]), num_params=16, memory=MemoryRecord(
    ...     weight_op_bytes=256, saved_activation_bytes=128, backward_temporary_bytes=100))
    >>> deferring_backward_temporary_bytes([a, a])  # Through the first: 100 + (256 - 128).
    228
    """
    worst, passed = 0, 0
    for m in reversed(metas):
        own = record_of(m).deferring_backward_temporary_bytes
        worst = max(worst, (backward_temporary_bytes(m) if own is None else own) + passed)
        if _has_trained_weights(m):
            deferred = record_of(m).weight_op_bytes
            passed += (int(m.out_bytes) if deferred is None
                       else max(0, deferred - saved_activation_bytes(m)))
    return worst


def wrapped(meta: Any) -> MemoryRecord:
    """The record of a layer that runs one sub-layer and adds nothing (e.g. one that picks
    its input from a NestedMap): the sub-layer's declarations, defaults filled in."""
    record = record_of(meta)
    return record.replace(saved_activation_bytes=saved_activation_bytes(meta),
                          backward_temporary_bytes=backward_temporary_bytes(meta))


def composite(metas: Sequence[Any], saved_extra: int = 0) -> MemoryRecord:
    """The record of a layer that runs `metas`' layers one after another: it keeps what they
    keep (plus `saved_extra` bytes of its own), defers what they defer, its gradient
    temporaries are its largest child's (deferring: beside the records of the children it
    passed), and its saved bytes cover its input when its first child's do.

    >>> import tensorflow as tf
    >>> from lingvo_lite.core import base_layer
    >>> a = base_layer.fprop_meta(0, tf.TensorShape([8, 4]),
    ...                           memory=MemoryRecord(saved_activation_bytes=1024))
    >>> b = base_layer.fprop_meta(0, tf.TensorShape([8, 4]))  # Saves its output, 128 bytes.
    >>> composite([a, b]).saved_activation_bytes, composite([a, b]).backward_temporary_bytes
    (1152, 512)
    """
    return MemoryRecord(
        saved_activation_bytes=saved_extra + sum(saved_activation_bytes(m) for m in metas),
        weight_op_bytes=weight_op_bytes(metas),
        backward_temporary_bytes=max(map(backward_temporary_bytes, metas), default=None),
        deferring_backward_temporary_bytes=deferring_backward_temporary_bytes(metas),
        saved_covers_input=bool(metas) and saved_covers_input(metas[0]))
