"""Deterministic dropout and drop-path, independent of micro-batching.

GPipe splits a mini-batch into micro-batches and recomputes forwards in the
backward pass; the dropout mask must be the same in all of those calls and the
same as the unsplit model would draw. So the keep decision for element j of
example i is a pure function of

    (layer seed, step_seed, global example index = example_offset + i, j)

computed with a counter-based generator (Philox, keyed by the layer seed)
instead of a stateful RNG. Example i is the index along `batch_dim` (0 for
[batch, ...] inputs, 1 for time-major [time, batch, ...] ones) and j the
position within the example, so the mask does not depend on where the batch
axis is, nor on how the batch was split along it. `step_seed`, `example_offset`
and `batch_dim` come from `fprop_context.current()`; the first two may be
Python ints or scalar int tensors. A PipeliningLayer sets `batch_dim` to its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer, fprop_context, hyperparams, layer_memory, weight_params
from lingvo_lite.core.nested_map import NestedMap

__all__ = ["drop_path", "dropout", "DropoutLayer", "DropPathLayer", "uniform_hash"]


def _as_seed_pair(seed: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(seed, int):
        return seed, 0
    pair = tuple(int(s) for s in seed)
    if len(pair) != 2:
        raise ValueError(f"seed must be an int or a pair of ints, got {seed!r}.")
    return pair  # type: ignore[return-value]


def _philox_key(seed0: int, seed1: int) -> int:
    """A 64-bit Philox key from a seed pair (splitmix64 finaliser, in Python)."""
    z = ((seed0 & 0xFFFFFFFF) << 32 | (seed1 & 0xFFFFFFFF)) + 0x9E3779B97F4A7C15
    z &= 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def uniform_hash(shape: Any, seed: int | Sequence[int], step_seed: Any,
                 example_offset: Any, batch_dim: int = 0) -> tf.Tensor:
    """Float32 values in [0, 1) of `shape`: a pure function of the inputs.

    With i the index along `batch_dim` and j... the others, entry [.., i, ..]
    depends only on (seed, step_seed, example_offset + i, flat index of j...
    within one example), so slicing the batch and shifting `example_offset`
    accordingly reproduces the same values bit for bit, and for batch_dim b the
    values are those of batch_dim 0 on the shape with axis b moved to the front.

    How: Philox is counter-based. With key = f(seed) and the 128-bit counter's
    high word = step_seed, element e of one long stream comes from counter group
    e // 4, lane e % 4 (4 uint32 per group, one per float32). A micro-batch that
    starts at example o of the mini-batch starts at element o * per_example, so
    it generates from group (o * per_example) // 4 and drops the first
    (o * per_example) % 4 values: exactly the mini-batch stream's slice.
    """
    shape = tf.cast(tf.convert_to_tensor(shape), tf.int64)
    if batch_dim:
        rank = int(shape.shape[0])
        if not 0 <= batch_dim < rank:
            raise ValueError(f"uniform_hash: batch_dim={batch_dim} is out of range for a "
                             f"shape of rank {rank}.")
        # Generate batch-major (examples contiguous in the stream), then move the axis back.
        perm = [batch_dim] + [d for d in range(rank) if d != batch_dim]
        u = uniform_hash(tf.gather(shape, perm), seed, step_seed, example_offset)
        return tf.transpose(u, [perm.index(d) for d in range(rank)])
    seed0, seed1 = _as_seed_pair(seed)
    key = tf.constant([_philox_key(seed0, seed1)], tf.uint64)
    start = tf.cast(example_offset, tf.int64) * tf.reduce_prod(shape[1:])
    lead = start % 4
    counter = tf.cast(tf.stack([start // 4, tf.cast(step_seed, tf.int64)]), tf.uint64)
    count = tf.reduce_prod(shape) + lead
    u = tf.raw_ops.StatelessRandomUniformV2(
        shape=tf.reshape(count, [1]), key=key, counter=counter, alg=1, dtype=tf.float32)
    return tf.reshape(u[lead:], shape)


def _check_keep_prob(keep_prob: Any, where: str) -> None:
    if isinstance(keep_prob, (int, float)) and not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"{where}: keep_prob must be in (0, 1], got {keep_prob!r}.")


def _normalize_dims(dims: Sequence[int] | None, rank: int, where: str) -> tuple[int, ...]:
    out = []
    for d in dims or ():
        nd = d + rank if d < 0 else d
        if not 0 <= nd < rank:
            raise ValueError(f"{where}: noise_shape_broadcast_dims entry {d} is out of range "
                             f"for inputs of rank {rank}.")
        out.append(nd)
    return tuple(sorted(set(out)))


def dropout(x: tf.Tensor, keep_prob: Any, seed: int | Sequence[int], step_seed: Any,
            example_offset: Any,
            noise_shape_broadcast_dims: Sequence[int] | None = None,
            batch_dim: int = 0) -> tf.Tensor:
    """Deterministic inverted dropout of `x`, whose examples lie along `batch_dim`.

    Keeps an element iff its `uniform_hash` value < keep_prob and scales kept
    values by 1 / keep_prob. Dims in `noise_shape_broadcast_dims` share one mask
    value; if `batch_dim` is among them all examples share one mask.
    """
    _check_keep_prob(keep_prob, "dropout")
    x = tf.convert_to_tensor(x)
    rank = x.shape.rank
    if rank is None or rank <= batch_dim:
        raise ValueError(f"dropout: x needs a known rank > batch_dim={batch_dim}, got "
                         f"{x.shape}.")
    dims = _normalize_dims(noise_shape_broadcast_dims, rank, "dropout")
    shape = tf.shape(x)
    noise_shape = tf.stack([1 if i in dims else shape[i] for i in range(rank)])
    if batch_dim in dims:
        example_offset = 0  # One mask for the whole batch, wherever the micro-batch starts.
    u = uniform_hash(noise_shape, seed, step_seed, example_offset, batch_dim)
    keep_prob_f = tf.cast(keep_prob, tf.float32)
    # A select on a boolean mask: the backward keeps the mask, 1 byte per element. A product
    # with a float mask kept 4 bytes per element and x as well (the product's gradient for the
    # mask reads x, even though nothing asks for it). Same values and gradients.
    scaled = x * tf.cast(1.0 / keep_prob_f, x.dtype)
    return tf.where(u < keep_prob_f, scaled, tf.zeros([], x.dtype))


def drop_path(x: tf.Tensor, keep_prob: Any, seed: int | Sequence[int]) -> tf.Tensor:
    """Drop-path (stochastic depth): drops whole examples of `x`.

    Active only when `fprop_context.current().training` and keep_prob is not 1;
    step_seed, example_offset and batch_dim (the examples' axis) come from the
    context. `keep_prob` may be a scalar tensor (e.g. scheduled over training steps).
    """
    ctx = fprop_context.current()
    if not ctx.training or (isinstance(keep_prob, (int, float)) and keep_prob == 1.0):
        return x
    x = tf.convert_to_tensor(x)
    return dropout(x, keep_prob, seed, ctx.step_seed, ctx.example_offset,
                   noise_shape_broadcast_dims=_all_but(ctx.batch_dim, x.shape.rank),
                   batch_dim=ctx.batch_dim)


def _all_but(batch_dim: int, rank: int | None) -> list[int]:
    return [d for d in range(rank or 0) if d != batch_dim]


class DropoutLayer(base_layer.BaseLayer):
    """Inverted dropout whose mask is reproducible and independent of micro-batching.

    Identity in eval mode (`fprop_context.current().training` False) or when
    keep_prob == 1. The layer's seed is derived from `random_seed` and its path,
    so two dropout layers draw different masks.
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("keep_prob", 1.0, "Probability of keeping an element, in (0, 1].")
        p.Define("noise_shape_broadcast_dims", None,
                 "Optional list of dims along which the mask is shared (e.g. all non-batch "
                 "dims for a per-example mask).")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        _check_keep_prob(self.params.keep_prob, self.path)
        self._seed = weight_params.derive_seed(self.params.random_seed, self.path)

    @property
    def seed(self) -> tuple[int, int]:
        """The (user seed, path hash) pair this layer's masks are derived from."""
        return self._seed

    def _broadcast_dims(self, rank: int, batch_dim: int) -> Sequence[int] | None:
        return self.params.noise_shape_broadcast_dims

    def FProp(self, theta: NestedMap, inputs: tf.Tensor) -> tf.Tensor:
        del theta  # No weights.
        p = self.params
        inputs = tf.convert_to_tensor(inputs)
        if inputs.dtype.is_floating:
            inputs = tf.cast(inputs, self.fprop_dtype)
        ctx = fprop_context.current()
        if not ctx.training or p.keep_prob == 1.0:
            return inputs
        return dropout(inputs, p.keep_prob, self._seed, ctx.step_seed, ctx.example_offset,
                       self._broadcast_dims(inputs.shape.rank, ctx.batch_dim), ctx.batch_dim)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        _check_keep_prob(p.keep_prob, p.name or cls.__name__)
        shape = base_layer.to_shape(inputs)
        flops = 0
        mask = 0
        if p.keep_prob != 1.0:
            # Counted in training mode: one multiply per element plus the mask's
            # compare and select (integer hashing is not counted as flops).
            flops = 3 * int(shape.num_elements() or 0)
            # The backward keeps the boolean mask (1 byte per element of the noise shape).
            mask = cls._mask_elements(p, shape)
        # Only the mask is read.
        return base_layer.fprop_meta(flops, shape, 0, p.fprop_dtype or p.dtype,
                                     memory=layer_memory.MemoryRecord(
                                         saved_activation_bytes=mask * tf.bool.size,
                                         saved_covers_input=True))

    @classmethod
    def _mask_elements(cls, p: hyperparams.Params, shape: tf.TensorShape) -> int:
        dims = _normalize_dims(p.noise_shape_broadcast_dims, shape.rank, cls.__name__)
        return math.prod(int(d) for i, d in enumerate(shape.as_list()) if i not in dims)


class DropPathLayer(DropoutLayer):
    """Drop-path as in AmoebaNet/NASNet: one keep decision per example (along batch_dim)."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Delete("noise_shape_broadcast_dims")
        return p

    def _broadcast_dims(self, rank: int, batch_dim: int) -> Sequence[int] | None:
        return _all_but(batch_dim, rank)

    @classmethod
    def _mask_elements(cls, p: hyperparams.Params, shape: tf.TensorShape) -> int:
        return int(shape[0])  # One per example (FPropMeta's shapes are batch-major).
