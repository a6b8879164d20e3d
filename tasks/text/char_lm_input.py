"""Character-level language-model batches from the project's generated sentences.

The text is `tasks.mt.corpus`' deterministic English -> German sentence pairs, one pair a
line (`"she buys two small pictures = sie kauft zwei kleine bilder"`), so nothing is
downloaded and every run sees the same text. Tokens are characters: id 0 is padding
(unused: the stream has none), the others the sorted characters of the whole corpus. Each
split's lines are joined into one stream and cut into windows of `seq_len + 1` characters;
an example is `token_ids` (the first `seq_len`), `padding_mask` (all ones) and `label`
(the next character at each position).

Example:
    >>> p = CharLMInput.Params().Set(split='dev', seq_len=16, batch_size=2, num_pairs=40)
    >>> batch = next(iter(p.Instantiate().dataset()))
    >>> batch.token_ids.shape.as_list(), batch.label.shape.as_list()
    ([2, 16], [2, 16])
    >>> decode(batch.token_ids[0, 1:], 40) == decode(batch.label[0, :-1], 40)
    True
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

from lingvo_lite.core import hyperparams
from lingvo_lite.tasks import base_input_generator
from tasks.mt import corpus

__all__ = ["CharLMInput", "corpus_text", "decode", "vocabulary"]

# Pairs per split of the generated corpus (`num_pairs` is the train split's; dev and test
# hold a tenth of it each).
DEFAULT_TRAIN_PAIRS = 4000


@functools.lru_cache(maxsize=8)
def corpus_text(num_pairs: int = DEFAULT_TRAIN_PAIRS) -> dict[str, str]:
    """Split -> the split's lines joined into one string ('english = german' a line)."""
    held_out = max(num_pairs // 10, 1)
    pairs = corpus.generate({"train": num_pairs, "dev": held_out, "test": held_out})
    return {split: "".join(f"{en} = {de}\n" for en, de in rows) for split, rows in pairs.items()}


@functools.lru_cache(maxsize=8)
def vocabulary(num_pairs: int = DEFAULT_TRAIN_PAIRS) -> tuple[str, ...]:
    """The token strings by id: padding, then the corpus' characters in sorted order."""
    return ("",) + tuple(sorted(set("".join(corpus_text(num_pairs).values()))))


def decode(ids: np.ndarray, num_pairs: int = DEFAULT_TRAIN_PAIRS) -> str:
    """The text of a sequence of token ids."""
    chars = vocabulary(num_pairs)
    return "".join(chars[int(i)] for i in ids)


class CharLMInput(base_input_generator.BaseInputGenerator):
    """Windows of the generated corpus' characters as next-character prediction examples."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.name = "char_lm"
        p.Define("split", "train", "'train', 'dev' or 'test'.")
        p.Define("seq_len", 64, "Characters per example (the model's sequence length).")
        p.Define("num_pairs", DEFAULT_TRAIN_PAIRS,
                 "Sentence pairs of the train split (dev and test: a tenth each).")
        return p

    def _validate(self) -> None:
        super()._validate()
        p = self.params
        if p.split not in corpus.SPLITS:
            raise ValueError(f"CharLMInput: split must be one of {corpus.SPLITS}, got "
                             f"{p.split!r}.")
        if not isinstance(p.seq_len, int) or p.seq_len < 1:
            raise ValueError(f"CharLMInput: seq_len must be an int >= 1, got {p.seq_len!r}.")

    def vocab_size(self) -> int:
        """Number of token ids (padding included)."""
        return len(vocabulary(self.params.num_pairs))

    def _windows(self) -> np.ndarray:
        p = self.params
        ids = {c: i for i, c in enumerate(vocabulary(p.num_pairs))}
        stream = np.array([ids[c] for c in corpus_text(p.num_pairs)[p.split]], np.int32)
        count = len(stream) // (p.seq_len + 1)
        return stream[:count * (p.seq_len + 1)].reshape(count, p.seq_len + 1)

    def num_examples(self) -> int:
        return len(self._windows())

    def _build_examples(self) -> tf.data.Dataset:
        windows = self._windows()
        return tf.data.Dataset.from_tensor_slices({
            "token_ids": windows[:, :-1], "label": windows[:, 1:],
            "padding_mask": np.ones_like(windows[:, :-1])})
