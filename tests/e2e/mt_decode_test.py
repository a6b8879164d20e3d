"""Greedy and beam search, BLEU, decode mode end to end, and the paper's 6B configuration."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import tensorflow as tf
import toy_mt
from toy_mt import run_trainer

from tasks.mt import model, search

PAD, BOS, EOS = 0, 1, 2


def markov_fn(table: np.ndarray):
    """log_prob_fn of a first-order Markov model: log P(next | previous token)."""
    logp = tf.constant(np.log(table), tf.float32)

    def fn(prefix, t):
        prev = tf.gather(prefix, t, axis=1)
        return tf.gather(logp, prev)

    return fn


def sequence_score(table: np.ndarray, tokens: list[int]) -> float:
    """Summed log-probability of tokens (up to and including the first EOS) after BOS."""
    score, prev = 0.0, BOS
    for tok in tokens:
        if tok == PAD:
            break
        score += np.log(table[prev, tok])
        prev = tok
        if tok == EOS:
            break
    return score


def trap_table() -> np.ndarray:
    """Greedy takes 'a' (0.6) but then faces a flat distribution; 'b' (0.4) ends surely."""
    a, b = 3, 4
    t = np.full((5, 5), 1e-6)
    t[BOS, a], t[BOS, b] = 0.6, 0.4
    t[a, [a, b, EOS]] = 1 / 3
    t[b, EOS] = 0.99
    t[EOS, EOS] = t[PAD, EOS] = 1.0
    return t / t.sum(axis=1, keepdims=True)


class SearchTest(tf.test.TestCase):

    def test_beam_one_equals_greedy(self):
        rng = np.random.default_rng(0)
        table = rng.dirichlet(np.full(9, 0.3), size=9)
        fn = markov_fn(table)
        greedy = search.greedy_search(fn, 6, 7, BOS, EOS, PAD)
        beam = search.beam_search(fn, 6, 1, 7, BOS, EOS, PAD)
        self.assertAllEqual(greedy.ids, beam.ids)
        self.assertAllClose(greedy.scores, beam.scores)
        for row, score in zip(greedy.ids.numpy(), greedy.scores.numpy()):
            self.assertAllClose(score, sequence_score(table, list(row)), rtol=1e-5)

    def test_beam_finds_better_hypothesis_than_greedy(self):
        table = trap_table()
        fn = markov_fn(table)
        greedy = search.greedy_search(fn, 1, 4, BOS, EOS, PAD)
        beam = search.beam_search(fn, 1, 3, 4, BOS, EOS, PAD, length_penalty_alpha=0.0)
        self.assertEqual(list(greedy.ids.numpy()[0][:1]), [3])
        self.assertEqual(list(beam.ids.numpy()[0]), [4, EOS, PAD, PAD])
        g = sequence_score(table, list(greedy.ids.numpy()[0]))
        b = sequence_score(table, list(beam.ids.numpy()[0]))
        self.assertGreater(b, g + 0.5)
        # The brute-force best finished sequence of length <= 4 is the beam's.
        best = max((sequence_score(table, list(s)), s)
                   for s in itertools.product(range(2, 5), repeat=4) if EOS in s)
        self.assertAllClose(b, best[0], rtol=1e-5)

    def test_length_penalty(self):
        self.assertAllClose(search.length_penalty(tf.constant([1, 7]), 0.6),
                            [1.0, 2.0 ** 0.6])


def test_bleu_identical_is_100_and_disjoint_is_0():
    refs = ["am ersten juni kauft sie zwei hundert elf kleine äpfel", "um halb acht sehe ich"]
    assert model.corpus_bleu(refs, refs) == pytest.approx(100.0)
    assert model.corpus_bleu(["x y z w v", "q r s t u"], refs) == pytest.approx(0.0)


# ---- End to end on a user's own files. -----------------------------------------------------

class TinyUserMt(toy_mt.ToyMt):
    """TransformerSmall, shrunk, on the user's own files (not registered)."""


def test_user_files_train_and_decode_end_to_end(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    toy_mt.write_toy_corpus(str(data))
    monkeypatch.setenv(toy_mt.DATA_DIR_ENV, str(data))
    logdir = str(tmp_path / "log")
    name = f"{__name__}.TinyUserMt"
    status, out, err = run_trainer(model=name, logdir=logdir, mode="train")
    assert status == 0, err
    assert os.path.exists(os.path.join(str(data), "spm_40.model"))
    status, out, err = run_trainer(model=name, logdir=logdir, mode="decode", eval_splits=("test",))
    assert status == 0, err
    assert "bleu" in out
    path = os.path.join(logdir, "decode_test", "hypotheses_4.txt")
    with open(path) as f:
        assert len(f.read().splitlines()) == 16  # Every line, also the last partial batch.
    assert os.listdir(os.path.join(logdir, "eval_test"))  # BLEU scalars for TensorBoard.


def test_decode_without_checkpoint_is_a_user_error(tmp_path):
    status, _, err = run_trainer(model="mt.TransformerSmall", logdir=str(tmp_path / "none"),
                                 mode="decode")
    assert status == 1 and "train first" in err


def test_inspect_model_128_layers_has_6b_params():
    status, out, err = run_trainer(model="mt.TransformerT64_16384_32", mode="inspect_model",
                                   inspect_num_cells=(8, 16, 128))
    assert status == 0, err
    assert "131 layers" in out  # Embedding, 64 encoder, hand-over, 64 decoder, softmax.
    total = [line for line in out.splitlines() if line.startswith("Total parameters")][0]
    n = int(total.split(":")[1].split("(")[0].replace(",", ""))
    assert 5.9e9 < n < 6.1e9
    for k in (8, 16, 128):
        assert f"Partition of 131 layers into {k} cells" in out
