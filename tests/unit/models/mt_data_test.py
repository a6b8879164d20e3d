"""The generated corpus, the sentencepiece vocabulary and the padded batches."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf
from mt_bucket_data import SMALL

from tasks.mt import corpus, input_generator, vocab


def test_corpus_is_deterministic_and_splits_are_disjoint():
    a = corpus.generate(SMALL, seed=3)
    b = corpus.generate(SMALL, seed=3)
    assert a == b
    assert corpus.generate(SMALL, seed=4) != a
    sources = {s: {en for en, _ in a[s]} for s in corpus.SPLITS}
    for s in corpus.SPLITS:
        assert len(sources[s]) == SMALL[s]
    assert not sources["train"] & sources["dev"]
    assert not sources["train"] & sources["test"]
    assert not sources["dev"] & sources["test"]


@pytest.mark.parametrize("n, en, de", [
    (0, "zero", "null"), (1, "one", "eins"), (21, "twenty one", "ein und zwanzig"),
    (101, "one hundred one", "ein hundert eins"),
    (321, "three hundred twenty one", "drei hundert ein und zwanzig"),
    (7070, "seven thousand seventy", "sieben tausend siebzig"),
    (1984, "one thousand nine hundred eighty four",
     "ein tausend neun hundert vier und achtzig"),
])
def test_number_words(n, en, de):
    assert corpus.number_en(n) == en
    assert corpus.number_de(n) == de


def test_agreement_and_word_order_rules():
    assert corpus.ordinal_en(21) == "twenty first" and corpus.ordinal_en(30) == "thirtieth"
    assert corpus.ordinal_de_dative(21) == "ein und zwanzigsten"
    assert corpus.ordinal_de_dative(3) == "dritten"
    assert corpus.year_de(1984) == "neunzehn hundert vier und achtzig"
    pairs = dict(p for split in corpus.generate({"train": 3000, "dev": 0, "test": 0}).values()
                 for p in split)
    # Accusative singular: the article/ending follows the noun's gender.
    for en_end, de_end in (("one red table", "einen roten tisch"),
                           ("one red lamp", "eine rote lampe"),
                           ("one red book", "ein rotes buch")):
        hits = [de for en, de in pairs.items() if en.startswith("i see ") and en.endswith(en_end)
                and en.count(" ") == 4]
        assert all(de == f"ich sehe {de_end}" for de in hits)
    # Verb-second after a fronted adjunct.
    fronted = [(en, de) for en, de in pairs.items() if en.startswith("at ") and " i see " in en]
    assert fronted and all(" sehe ich " in de for _, de in fronted)


def test_write_corpus_once(tmp_path):
    d = str(tmp_path)
    assert corpus.write_corpus(d, SMALL, seed=1)
    src, tgt = corpus.split_paths(d, "dev")
    with open(src) as f:
        lines = f.read().splitlines()
    assert lines == [en for en, _ in corpus.generate(SMALL, seed=1)["dev"]]
    assert not corpus.write_corpus(d, SMALL, seed=1)  # Already there: not rewritten.


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("mt"))
    corpus.write_corpus(d, SMALL, seed=0)
    return d


def test_sentencepiece_round_trip_and_special_ids(data_dir):
    path = input_generator.prepare_data_dir(data_dir, "", 128)
    voc = vocab.Vocabulary(path)
    for split in corpus.SPLITS:
        src, tgt = corpus.split_paths(data_dir, split)
        for f in (src, tgt):
            with open(f, encoding="utf-8") as fh:
                for line in fh.read().splitlines()[:50]:
                    ids = voc.encode(line)
                    assert min(ids) > vocab.EOS_ID
                    assert voc.decode(ids + [vocab.EOS_ID, 7, 8]) == line
    assert voc.size <= 128


def test_vocabulary_training_is_deterministic(data_dir, tmp_path):
    text = list(corpus.split_paths(data_dir, "train"))
    a, b = str(tmp_path / "a.model"), str(tmp_path / "b.model")
    vocab.train_model(text, a, 128)
    vocab.train_model(text, b, 128)
    with open(a, "rb") as fa, open(b, "rb") as fb:
        assert fa.read() == fb.read()


def test_batches_are_padded_to_fixed_shapes(data_dir):
    p = input_generator.ParallelTextInput.Params().Set(
        data_dir=data_dir, generate="", split="dev", vocab_size=128, max_source_length=48,
        max_target_length=50, batch_size=16, shuffle=False, repeat=False)
    gen = p.Instantiate()
    voc = gen.vocabulary()
    batches = list(gen.dataset())
    assert len(batches) == 50 // 16  # drop_remainder.
    b = batches[0]
    for k in ("src_ids", "src_paddings"):
        assert b[k].shape == (16, 48)
    for k in ("tgt_ids", "tgt_labels", "tgt_paddings", "tgt_weights"):
        assert b[k].shape == (16, 50)
    with open(corpus.split_paths(data_dir, "dev")[1], encoding="utf-8") as f:
        first = f.readline().strip()
    pieces = voc.encode(first)
    n = len(pieces)
    np.testing.assert_array_equal(b.tgt_ids[0, :n + 1], [vocab.BOS_ID] + pieces)
    np.testing.assert_array_equal(b.tgt_labels[0, :n + 1], pieces + [vocab.EOS_ID])
    np.testing.assert_array_equal(b.tgt_paddings[0], [0.0] * (n + 1) + [1.0] * (49 - n))
    np.testing.assert_array_equal(b.tgt_weights + b.tgt_paddings, tf.ones_like(b.tgt_weights))
    assert voc.decode(b.tgt_labels[0].numpy()) == first


def test_missing_user_files_name_the_fix(tmp_path):
    p = input_generator.ParallelTextInput.Params().Set(data_dir=str(tmp_path), generate="")
    with pytest.raises(FileNotFoundError, match="train.src"):
        p.Instantiate().vocabulary()
    with pytest.raises(ValueError, match="generate"):
        input_generator.ParallelTextInput.Params().Set(generate="wmt").Instantiate()
    assert not os.listdir(tmp_path)
