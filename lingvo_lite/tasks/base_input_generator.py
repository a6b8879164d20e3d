"""BaseInputGenerator: the shared tf.data pipeline behind every task's input (Lingvo-style).

A subclass only says where single examples come from (`_build_examples`) and how one example is
preprocessed (`_preprocess`); this class owns the rest of the pipeline so that every task batches,
shuffles and repeats the same way:

    examples -> shuffle -> repeat -> enumerate -> _preprocess(example, seed) -> _batch -> prefetch

Determinism: shuffling uses `p.seed`, and every random op in `_preprocess` must be a stateless
`tf.random.stateless_*` op driven by the `seed` argument, which is `p.seed` folded with the
example's position in the (shuffled, repeated) stream. The same params therefore give the same
batches on every run and machine, each epoch still sees fresh augmentations, and an iterator
restored from a checkpoint continues exactly where it stopped (the position counter is part of the
iterator state; there is no hidden random-generator state).

tf.data combines `p.seed` with TensorFlow's global seed, so the shuffle order also follows
`tf.random.set_seed` (and `keras.utils.set_random_seed`): trainer.py sets it only with `--seed`,
the same in every task; a program that sets its own gets another order, the same on every run.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_lite.core import hyperparams
from lingvo_lite.core.nested_map import NestedMap

__all__ = ["BaseInputGenerator"]


class BaseInputGenerator:
    """Builds a batched, seeded `tf.data.Dataset` of `NestedMap`s from single examples."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        """Returns the default params of this input generator."""
        p = hyperparams.InstantiableParams(cls)
        p.Define("name", "input", "Name of this input generator (used in logs and errors).")
        p.Define("batch_size", 32, "Global mini-batch size (examples per batch, all replicas).")
        p.Define("shuffle", True, "Shuffle the examples (seeded; reshuffled every epoch).")
        p.Define("shuffle_buffer_size", 10000, "Number of examples in the shuffle buffer.")
        p.Define("repeat", True, "Repeat forever (True for training, False for one eval pass).")
        p.Define(
            "seed", 1234,
            "Seed of the shuffle order and of all random preprocessing (augmentation).",
        )
        p.Define(
            "drop_remainder", True,
            "Drop a last partial batch so every batch has exactly batch_size examples "
            "(pipelines with micro-batches need a fixed batch size).",
        )
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        params = params.Copy()
        self._params = params
        self._validate()
        params.Freeze()
        self._shard: tuple[int, int] | None = None

    @property
    def params(self) -> hyperparams.InstantiableParams:
        """The (frozen) params this generator was built from."""
        return self._params

    def _validate(self) -> None:
        """Checks the params; subclasses extend it (call super) and raise ValueError on misuse."""
        p = self._params
        name = type(self).__name__
        if not isinstance(p.batch_size, int) or isinstance(p.batch_size, bool) or p.batch_size < 1:
            raise ValueError(f"{name}: batch_size must be an int >= 1, got {p.batch_size!r}.")
        for flag in ("shuffle", "repeat", "drop_remainder"):
            if not isinstance(p.Get(flag), bool):
                raise ValueError(f"{name}: {flag} must be True or False, got {p.Get(flag)!r}.")
        if p.shuffle and (
            not isinstance(p.shuffle_buffer_size, int) or p.shuffle_buffer_size < 1
        ):
            raise ValueError(
                f"{name}: shuffle_buffer_size must be an int >= 1 when shuffle=True, "
                f"got {p.shuffle_buffer_size!r}."
            )
        if not isinstance(p.seed, int) or isinstance(p.seed, bool):
            raise ValueError(f"{name}: seed must be an int, got {p.seed!r}.")

    # ---- for subclasses --------------------------------------------------------------------------

    def _build_examples(self) -> tf.data.Dataset:
        """Returns a finite dataset of single, unbatched examples (dicts or NestedMaps)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _build_examples().")

    def _preprocess(self, example: NestedMap, seed: tf.Tensor) -> NestedMap:
        """Preprocesses one example; random ops must be `tf.random.stateless_*` ops using `seed`.

        Args:
          example: one example from `_build_examples`, as a NestedMap of tensors.
          seed: int64 tensor of shape [2], unique to this example's position in the stream.

        Returns:
          The example to batch; every leaf must have the same static shape for all examples.
        """
        del seed
        return example

    def _batch(self, ds: tf.data.Dataset) -> tf.data.Dataset:
        """Groups preprocessed examples into batches; override for padding or bucketing."""
        p = self._params
        return ds.batch(p.batch_size, drop_remainder=p.drop_remainder)

    def num_examples(self) -> int | None:
        """Number of examples in one pass over the data, or None if unknown."""
        return None

    def explain_data_error(self, error: Exception) -> str | None:
        """One line naming the bad data file and the fix for an error raised while iterating
        the dataset, or None when this input cannot tell (the error is then re-raised).

        Called by the trainer only after such an error, so it may be slow (e.g. scan files).

        Example:
          >>> gen = BaseInputGenerator.Params().Instantiate()
          >>> gen.explain_data_error(tf.errors.NotFoundError(None, None, "x")) is None
          True
        """
        del error
        return None

    def shard(self, num_shards: int, index: int) -> None:
        """Makes `dataset()` yield shard `index` of every global batch (multi-client training).

        Each global batch of `batch_size` examples is split into `num_shards` contiguous parts;
        this generator yields part `index` of each (`batch_size / num_shards` examples), the same
        examples, seeds and order a single process would give that part. With the default
        `_batch` only this shard's examples are preprocessed (the example stream, e.g. file
        records, is still read in full to keep the shuffle order); with an overridden `_batch`
        (bucketing) every batch is built and sliced.

        >>> gen = BaseInputGenerator.Params().Set(batch_size=4).Instantiate()
        >>> gen.shard(2, 1)   # yields examples 2 and 3 of every batch of 4
        """
        p = self._params
        if p.batch_size % num_shards or not 0 <= index < num_shards:
            raise ValueError(f"{p.name}: batch_size={p.batch_size} does not split into "
                             f"{num_shards} equal shards; make input.batch_size a multiple of "
                             f"{num_shards}.")
        self._shard = (num_shards, index)

    # ---- pipeline --------------------------------------------------------------------------------

    def dataset(self) -> tf.data.Dataset:
        """Returns the batched dataset; each element is a NestedMap of [batch_size, ...] tensors."""
        p = self._params
        ds = self._build_examples()
        if p.shuffle:
            ds = ds.shuffle(p.shuffle_buffer_size, seed=p.seed, reshuffle_each_iteration=True)
        if p.repeat:
            ds = ds.repeat()
        ds = ds.enumerate()
        by_example = self._shard is not None and type(self)._batch is BaseInputGenerator._batch
        if by_example:  # Drops the other shards' examples before they are preprocessed.
            num_shards, index = self._shard
            shard_size = p.batch_size // num_shards
            ds = ds.filter(lambda i, _: (i % p.batch_size) // shard_size == index)
        base_seed = tf.constant([p.seed, 0], dtype=tf.int64)

        def _map_fn(index: tf.Tensor, example: Any) -> NestedMap:
            seed = tf.random.experimental.stateless_fold_in(base_seed, index)
            # NestedMaps (not plain dicts) in and out, so batches offer attribute access.
            example = NestedMap.FromNestedDict(example)
            return NestedMap.FromNestedDict(self._preprocess(example, seed))

        ds = ds.map(_map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if by_example:
            ds = ds.batch(shard_size, drop_remainder=p.drop_remainder)
        else:
            ds = self._batch(ds)
            if self._shard is not None:
                ds = ds.map(self._slice_shard)
        return ds.prefetch(tf.data.AUTOTUNE)

    def _slice_shard(self, batch: NestedMap) -> NestedMap:
        num_shards, index = self._shard

        def part(x: tf.Tensor) -> tf.Tensor:
            size = tf.shape(x)[0] // num_shards
            return x[index * size:(index + 1) * size]

        return batch.Transform(part)
