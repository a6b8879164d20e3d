"""A joint sentencepiece vocabulary trained on a corpus' training text.

One model covers source and target, so source and target embeddings can share one table
(`share_embeddings`). Ids are fixed: 0 = <pad>, 1 = <unk>, 2 = <s> (BOS), 3 = </s> (EOS).
Training is single-threaded on the whole (unshuffled) text, hence deterministic; the model is
written once to `<data_dir>/spm_<vocab_size>.model` and reused.
"""

from __future__ import annotations

import io
import os

import sentencepiece as spm

__all__ = ["BOS_ID", "ensure_model", "EOS_ID", "model_path", "PAD_ID", "train_model", "Vocabulary"]

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3


def model_path(data_dir: str, vocab_size: int) -> str:
    return os.path.join(data_dir, f"spm_{vocab_size}.model")


def train_model(text_files: list[str], path: str, vocab_size: int) -> None:
    """Trains a unigram sentencepiece model on the lines of `text_files`; writes it to `path`.

    `vocab_size` is a soft upper bound (a small corpus may yield fewer pieces). The model is
    trained in memory and written atomically, so concurrent trainers never read a partial file.
    """
    for f in text_files:
        if not os.path.exists(f):
            raise FileNotFoundError(f"sentencepiece training text {f} does not exist.")
    lines = []
    for f in text_files:
        try:
            with open(f, encoding="utf-8") as fh:
                lines += [line.rstrip("\n") for line in fh if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            reason = getattr(e, "strerror", None) or str(e)
            raise ValueError(
                f"sentencepiece training text {f} cannot be read ({reason}); make it readable "
                f"UTF-8 text (e.g. chmod a+r {f}) or point the input's data_dir elsewhere."
            ) from None
    if not lines:
        raise ValueError(f"sentencepiece: the training text {text_files} is empty.")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
        model_type="bpe", character_coverage=1.0, hard_vocab_limit=False,
        pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, num_threads=1,
        shuffle_input_sentence=False, minloglevel=2)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(buf.getvalue())
    os.replace(tmp, path)


def ensure_model(data_dir: str, vocab_size: int, text_files: list[str]) -> str:
    """Path of the vocabulary model for `data_dir`, training it from `text_files` if missing."""
    path = model_path(data_dir, vocab_size)
    if not os.path.exists(path):
        train_model(text_files, path, vocab_size)
    return path


class Vocabulary:
    """Encodes text to ids and back with a trained sentencepiece model."""

    def __init__(self, path: str) -> None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"sentencepiece model {path} does not exist.")
        self.path = path
        self._sp = spm.SentencePieceProcessor(model_file=path)

    @property
    def size(self) -> int:
        """Number of pieces (ids are 0..size-1)."""
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Piece ids of `text` (no BOS/EOS)."""
        return self._sp.encode(text, out_type=int)

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, cut at the first EOS; padding, BOS and EOS are dropped."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i not in (PAD_ID, BOS_ID):
                out.append(i)
        return self._sp.decode(out)
