"""Parallel text input for translation: files -> sentencepiece ids -> fixed-shape padded batches.

A corpus directory holds `<split>.src` and `<split>.tgt` (one sentence per line, line i of one
file translates line i of the other) for the splits train, dev and test. With
`generate='en_de_numbers'` the project's generated corpus (`corpus.py`) is written there the first
time; with `generate=''` the files are the user's own. The joint sentencepiece model
`<data_dir>/spm_<vocab_size>.model` is trained on train.src + train.tgt on first use.

Every example is padded to `max_source_length` / `max_target_length` pieces (sentences longer
than that are dropped from training batches; decoding truncates them instead), unless
`bucket_lengths` is set: then each pair goes to the first bucket whose length holds both its
source and its target, is padded to that length, and is batched with pairs of its bucket, in
batches of that bucket's `bucket_batch_sizes` (fewer, longer sentences per batch keep the
tokens per batch about constant). Batches keep the stream's order within each bucket, so they
are deterministic and an iterator restored from a checkpoint continues exactly; the pipeline
declares the same shapes as its `input_buckets` (`bucket_shapes`). With `pack`, consecutive
pairs share a row while they fit (packing.py), and each batch also has src_segment_ids,
src_segment_pos, tgt_segment_ids and tgt_segment_pos [B, S] / [B, T] int32 (the pair of each
position, 0 for padding, and its position within the pair). Batch fields:

  src_ids [B, S] int32       source pieces + EOS, then PAD
  src_paddings [B, S] f32    1.0 at padded positions
  tgt_ids [B, T] int32       BOS + target pieces (decoder input), then PAD
  tgt_labels [B, T] int32    target pieces + EOS (what the decoder predicts), then PAD
  tgt_paddings [B, T] f32    1.0 at padded positions
  tgt_weights [B, T] f32     1 - tgt_paddings: the loss counts real target tokens only
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from absl import logging

from lingvo_lite.core import hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.tasks import base_input_generator
from tasks.mt import corpus, layers, packing, vocab

__all__ = [
    "batch_for_decoding",
    "bucket_shapes",
    "DEFAULT_DATA_DIR",
    "encode_split",
    "ParallelTextInput",
    "prepare_data_dir",
    "SplitData",
]

GENERATORS = ("", "en_de_numbers")
DEFAULT_DATA_DIR = "~/.cache/lingvo_lite/mt_en_de_numbers"


@dataclasses.dataclass
class SplitData:
    """One split, encoded: padded id arrays, the raw texts, and which lines fit the lengths."""

    arrays: dict[str, np.ndarray]
    sources: list[str]
    references: list[str]
    fits: np.ndarray  # bool [num_lines]: source and target fit the maximum lengths.


def prepare_data_dir(data_dir: str, generate: str, vocab_size: int) -> str:
    """Makes sure the corpus files and the vocabulary exist; returns the vocabulary path."""
    data_dir = os.path.expanduser(data_dir)
    if generate not in GENERATORS:
        raise ValueError(f"generate={generate!r} is unknown; use 'en_de_numbers' for the "
                         "generated corpus or '' for your own files.")
    if generate == "en_de_numbers":
        corpus.write_corpus(data_dir)
    src, tgt = corpus.split_paths(data_dir, "train")
    for path in (src, tgt):
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{path} does not exist: put your parallel text in <data_dir>/<split>.src and "
                f"<split>.tgt (one sentence per line), or set generate='en_de_numbers'.")
    return vocab.ensure_model(data_dir, vocab_size, [src, tgt])


def _read_lines(path: str) -> list[str]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: each split needs <split>.src and "
                                "<split>.tgt in the data_dir.")
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\n").strip() for line in f]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(_unreadable_text_message(path, e)) from None


def _unreadable_text_message(path: str, error: Exception) -> str:
    """One line for a corpus file that exists but cannot be read."""
    if isinstance(error, UnicodeDecodeError):
        return (f"{path} is not UTF-8 text ({error.reason} at byte {error.start}); save it as "
                "UTF-8, one sentence per line, or point data_dir elsewhere.")
    reason = getattr(error, "strerror", None) or str(error)
    return (f"{path} cannot be read ({reason}); make it readable (e.g. chmod a+r {path}) or "
            "point the input's data_dir to readable <split>.src/<split>.tgt files.")


def _pad(rows: list[list[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.full((len(rows), length), vocab.PAD_ID, np.int32)
    paddings = np.ones((len(rows), length), np.float32)
    for i, row in enumerate(rows):
        row = row[:length]
        ids[i, :len(row)] = row
        paddings[i, :len(row)] = 0.0
    return ids, paddings


def encode_split(data_dir: str, split: str, voc: vocab.Vocabulary, max_source_length: int,
                 max_target_length: int) -> SplitData:
    """Encodes all lines of `split`; over-long sources are truncated (EOS kept last)."""
    src_path, tgt_path = corpus.split_paths(os.path.expanduser(data_dir), split)
    sources, targets = _read_lines(src_path), _read_lines(tgt_path)
    if len(sources) != len(targets):
        raise ValueError(f"{src_path} has {len(sources)} lines but {tgt_path} has "
                         f"{len(targets)}; parallel files need one translation per line.")
    src_rows, tgt_in, tgt_out, fits = [], [], [], []
    for s, t in zip(sources, targets):
        s_ids, t_ids = voc.encode(s), voc.encode(t)
        fits.append(len(s_ids) + 1 <= max_source_length and len(t_ids) + 1 <= max_target_length)
        src_rows.append(s_ids[:max_source_length - 1] + [vocab.EOS_ID])
        tgt_in.append([vocab.BOS_ID] + t_ids)
        tgt_out.append(t_ids + [vocab.EOS_ID])
    src_ids, src_paddings = _pad(src_rows, max_source_length)
    tgt_ids, tgt_paddings = _pad(tgt_in, max_target_length)
    tgt_labels, _ = _pad(tgt_out, max_target_length)
    arrays = dict(src_ids=src_ids, src_paddings=src_paddings, tgt_ids=tgt_ids,
                  tgt_labels=tgt_labels, tgt_paddings=tgt_paddings,
                  tgt_weights=1.0 - tgt_paddings)
    return SplitData(arrays, sources, targets, np.array(fits, bool))


class ParallelTextInput(base_input_generator.BaseInputGenerator):
    """Batches of padded (source, target) sentencepiece ids from parallel text files."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("data_dir", DEFAULT_DATA_DIR,
                 "Directory of <split>.src / <split>.tgt and of the sentencepiece model.")
        p.Define("generate", "en_de_numbers",
                 "'en_de_numbers': write the generated corpus into data_dir if missing; '': "
                 "use your own files.")
        p.Define("split", "train", "'train', 'dev' or 'test'.")
        p.Define("vocab_size", 512, "Sentencepiece vocabulary size (a soft upper bound).")
        p.Define("max_source_length", 24, "Source pieces per example, EOS included.")
        p.Define("max_target_length", 24, "Target pieces per example, BOS/EOS included.")
        p.Define("bucket_lengths", None,
                 "Length buckets, ascending (e.g. [8, 16, 24]): a pair goes to the first bucket "
                 "holding its source and its target (EOS/BOS included) and is padded to that "
                 "length; the last must hold max_source_length and max_target_length. None: "
                 "every batch padded to max_source_length / max_target_length.")
        p.Define("bucket_batch_sizes", None,
                 "With bucket_lengths: the batch size of each bucket (e.g. [96, 48, 32] for "
                 "about 768 source tokens per batch); batch_size is then unused.")
        p.Define("pack", False,
                 "Pack consecutive pairs into rows of max_source_length / max_target_length "
                 "while they fit (greedy, deterministic), with segment ids and positions; the "
                 "network then needs layers.input_shapes(..., packed=True).")
        p.batch_size = 64
        return p

    def _validate(self) -> None:
        super()._validate()
        p = self.params
        if p.split not in corpus.SPLITS:
            raise ValueError(f"ParallelTextInput: split={p.split!r}; use one of {corpus.SPLITS}.")
        for name in ("vocab_size", "max_source_length", "max_target_length"):
            if not isinstance(p.Get(name), int) or p.Get(name) < 2:
                raise ValueError(f"ParallelTextInput: {name} must be an int >= 2, "
                                 f"got {p.Get(name)!r}.")
        if p.generate not in GENERATORS:
            raise ValueError(f"ParallelTextInput: generate={p.generate!r}; use 'en_de_numbers' "
                             "or '' (your own files).")
        if p.pack and p.bucket_lengths is not None:
            raise ValueError("ParallelTextInput: pack=True with bucket_lengths: packed rows are "
                             "filled to max_source_length / max_target_length; use one of them.")
        if p.bucket_lengths is not None or p.bucket_batch_sizes is not None:
            _check_buckets(p.bucket_lengths, p.bucket_batch_sizes,
                           max(p.max_source_length, p.max_target_length))

    def vocabulary(self) -> vocab.Vocabulary:
        """The joint vocabulary (generating the corpus and training it on first use)."""
        p = self.params
        return vocab.Vocabulary(prepare_data_dir(p.data_dir, p.generate, p.vocab_size))

    def load_split(self) -> SplitData:
        """All lines of this split, encoded and padded."""
        p = self.params
        return encode_split(p.data_dir, p.split, self.vocabulary(), p.max_source_length,
                            p.max_target_length)

    def _build_examples(self) -> tf.data.Dataset:
        p = self.params
        data = self.load_split()
        dropped = int((~data.fits).sum())
        if dropped:
            logging.warning("%s: %d of %d sentence pairs exceed max_source_length=%d or "
                            "max_target_length=%d and are skipped.", p.name, dropped,
                            len(data.fits), p.max_source_length, p.max_target_length)
        arrays = {k: v[data.fits] for k, v in data.arrays.items()}
        if not len(arrays["src_ids"]):
            raise ValueError(f"{p.name}: no sentence pair of split {p.split!r} fits "
                             f"max_source_length={p.max_source_length} and max_target_length="
                             f"{p.max_target_length}; raise them.")
        self._num_examples = len(arrays["src_ids"])
        if p.bucket_lengths:
            arrays = _bucketed(arrays, p.bucket_lengths)
        if p.pack:
            arrays = packing.pack(arrays, p.max_source_length, p.max_target_length)
        return tf.data.Dataset.from_tensor_slices(arrays)

    def _batch(self, ds: tf.data.Dataset) -> tf.data.Dataset:
        p = self.params
        if not p.bucket_lengths:
            return super()._batch(ds)
        lengths = tf.constant(p.bucket_lengths, tf.int64)
        sizes = tf.constant(p.bucket_batch_sizes, tf.int64)

        def batches_of_bucket(bucket: tf.Tensor, window: tf.data.Dataset) -> tf.data.Dataset:
            length = tf.gather(lengths, bucket)

            def trim(batch: dict) -> NestedMap:
                return NestedMap({k: v[:, :length] for k, v in batch.items() if k != "bucket"})

            return window.batch(tf.gather(sizes, bucket), drop_remainder=True).map(trim)

        return ds.group_by_window(key_func=lambda example: example["bucket"],
                                  reduce_func=batches_of_bucket,
                                  window_size_func=lambda bucket: tf.gather(sizes, bucket))

    def num_examples(self) -> int | None:
        return getattr(self, "_num_examples", None)

    def bucket_distribution(self) -> list[float]:
        """The share of the batches in each of bucket_lengths (pairs in the bucket / its batch
        size, over the split): how often each of the pipeline's input_buckets occurs, which
        --mode=plan and inspect_model weigh the buckets' step times by."""
        p = self.params
        if not p.bucket_lengths:
            raise ValueError(f"{p.name}: bucket_distribution needs bucket_lengths.")
        data = self.load_split()
        arrays = {k: v[data.fits] for k, v in data.arrays.items()}
        bucket = _bucketed(arrays, p.bucket_lengths)["bucket"]
        batches = [float((bucket == i).sum()) / size
                   for i, size in enumerate(p.bucket_batch_sizes)]
        return [b / sum(batches) for b in batches]


def _check_buckets(lengths: Any, batch_sizes: Any, longest: int) -> None:
    def ints(values: Any) -> bool:
        return (isinstance(values, (list, tuple)) and bool(values)
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                        for v in values))

    if not ints(lengths) or list(lengths) != sorted(set(lengths)):
        raise ValueError(f"ParallelTextInput: bucket_lengths={lengths!r} must be ascending ints "
                         ">= 1, e.g. [8, 16, 24].")
    if not ints(batch_sizes) or len(batch_sizes) != len(lengths):
        raise ValueError(f"ParallelTextInput: bucket_batch_sizes={batch_sizes!r} must give one "
                         f"batch size >= 1 for each of the {len(lengths)} bucket_lengths.")
    if lengths[-1] < longest:
        raise ValueError(f"ParallelTextInput: the last of bucket_lengths={list(lengths)} must "
                         f"hold max_source_length and max_target_length ({longest}); add a "
                         f"bucket of {longest}.")


def _bucketed(arrays: dict[str, np.ndarray], lengths: Sequence[int]) -> dict[str, np.ndarray]:
    """`arrays` padded to the longest bucket, with each pair's bucket index."""
    longest = lengths[-1]
    out = {}
    for name, values in arrays.items():
        pad = longest - values.shape[1]
        fill = 1.0 if name.endswith("paddings") else 0
        out[name] = np.pad(values, [(0, 0), (0, pad)], constant_values=fill)
    used = np.maximum((1.0 - out["src_paddings"]).sum(1), (1.0 - out["tgt_paddings"]).sum(1))
    out["bucket"] = np.searchsorted(np.asarray(lengths), used, side="left").astype(np.int64)
    return out


def bucket_shapes(lengths: Sequence[int], batch_sizes: Sequence[int]) -> list[NestedMap]:
    """The mini-batch shapes of bucketed batches: a pipeline's `input_buckets`.

    >>> [s.src_ids for s in bucket_shapes([8, 16], [32, 16])]
    [TensorShape([32, 8]), TensorShape([16, 16])]
    """
    return [layers.input_shapes(b, n, n) for n, b in zip(lengths, batch_sizes)]


def batch_for_decoding(arrays: dict[str, np.ndarray], start: int, batch_size: int
                       ) -> tuple[NestedMap, int]:
    """Source fields of lines [start, start + batch_size), the last batch padded by repetition.

    Returns (NestedMap(src_ids, src_paddings) with exactly batch_size rows, number of real rows).
    """
    n = len(arrays["src_ids"])
    idx = np.arange(start, min(start + batch_size, n))
    real = len(idx)
    idx = np.concatenate([idx, np.full(batch_size - real, idx[-1])]).astype(np.int64)
    return NestedMap(src_ids=tf.constant(arrays["src_ids"][idx]),
                     src_paddings=tf.constant(arrays["src_paddings"][idx])), real
