"""Packing several short sentence pairs into one row (ParallelTextInput's `pack`).

Padding every pair to `max_source_length` / `max_target_length` spends most positions on pad
tokens when sentences are short. Packing walks the pairs in the corpus order and appends each
to the current row while its source and its target still fit there (greedy next-fit), else
starts a new row: deterministic, so a resumed run sees the same rows. Each position records
its segment (1, 2, ... for the row's pairs; 0 for padding) and its position within the segment:
the Transformer layers keep attention inside a segment and restart the positional encodings
at each, and the loss, a mean over real target tokens, weighs every token as unpacked.

Example:
    >>> import numpy as np
    >>> ids = np.array([[5, 2, 0, 0], [6, 7, 2, 0]], np.int32)
    >>> pads = (ids == 0).astype(np.float32)
    >>> rows = pack(dict(src_ids=ids, src_paddings=pads, tgt_ids=ids, tgt_labels=ids,
    ...                  tgt_paddings=pads, tgt_weights=1 - pads), 6, 6)
    >>> rows["src_ids"].tolist(), rows["src_segment_ids"].tolist()
    ([[5, 2, 6, 7, 2, 0]], [[1, 1, 2, 2, 2, 0]])
    >>> rows["src_segment_pos"].tolist()
    [[0, 1, 0, 1, 2, 0]]
"""

from __future__ import annotations

import numpy as np

__all__ = ["pack"]

_SOURCE = ("src_ids", "src_paddings")
_TARGET = ("tgt_ids", "tgt_labels", "tgt_paddings", "tgt_weights")


def _rows(src_lengths: np.ndarray, tgt_lengths: np.ndarray, max_source_length: int,
          max_target_length: int) -> list[list[int]]:
    """The pairs of each row, by greedy next-fit in order."""
    rows: list[list[int]] = []
    used_src = used_tgt = 0
    for i, (s, t) in enumerate(zip(src_lengths, tgt_lengths)):
        if not rows or used_src + s > max_source_length or used_tgt + t > max_target_length:
            rows.append([])
            used_src = used_tgt = 0
        rows[-1].append(i)
        used_src += s
        used_tgt += t
    return rows


def pack(arrays: dict[str, np.ndarray], max_source_length: int,
         max_target_length: int) -> dict[str, np.ndarray]:
    """Rows of packed pairs from padded per-pair arrays (ParallelTextInput's fields).

    Returns the same fields, [rows, max_source_length] / [rows, max_target_length], plus
    src_segment_ids, src_segment_pos, tgt_segment_ids, tgt_segment_pos (int32).
    """
    src_len = (1.0 - arrays["src_paddings"]).sum(1).astype(int)
    tgt_len = (1.0 - arrays["tgt_paddings"]).sum(1).astype(int)
    if src_len.max(initial=0) > max_source_length or tgt_len.max(initial=0) > max_target_length:
        raise ValueError("pack: a pair is longer than max_source_length / max_target_length.")
    rows = _rows(src_len, tgt_len, max_source_length, max_target_length)
    out = {}
    for fields, lengths, width, side in ((_SOURCE, src_len, max_source_length, "src"),
                                         (_TARGET, tgt_len, max_target_length, "tgt")):
        for name in fields:
            fill = 1.0 if name.endswith("paddings") else 0
            out[name] = np.full((len(rows), width), fill, arrays[name].dtype)
        segment_ids = np.zeros((len(rows), width), np.int32)
        segment_pos = np.zeros((len(rows), width), np.int32)
        for r, pairs in enumerate(rows):
            start = 0
            for segment, i in enumerate(pairs, start=1):
                n = lengths[i]
                for name in fields:
                    out[name][r, start:start + n] = arrays[name][i, :n]
                segment_ids[r, start:start + n] = segment
                segment_pos[r, start:start + n] = np.arange(n)
                start += n
        out[f"{side}_segment_ids"] = segment_ids
        out[f"{side}_segment_pos"] = segment_pos
    return out
