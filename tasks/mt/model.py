"""Translation with a pipelined encoder-decoder Transformer: training, decoding and BLEU.

Training and evaluation run the network as a PipeliningLayer (`PipelinedTask`): micro-batches,
re-materialisation and per-cell backward. Decoding runs the same layers (each on its cell's
device) outside the pipeline schedule: the source is encoded once, then the decoder and softmax
are recomputed on the growing target prefix at every search step (no key/value cache: simple and
exactly consistent with training, at O(T^2) cost, fine for the lengths of this task).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import sacrebleu
import tensorflow as tf

from lingvo_lite.core import fprop_context, hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.tasks import inference, pipelined_task
from tasks.mt import input_generator, layers, search, vocab

__all__ = ["corpus_bleu", "DecodeResult", "transformer_task_params", "TransformerMtTask"]

NETWORK_FIELDS = ("src_ids", "src_paddings", "tgt_ids", "tgt_paddings", "tgt_labels",
                  "tgt_weights")


def corpus_bleu(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU (sacrebleu's default 13a tokenisation), 0..100."""
    if len(hypotheses) != len(references):
        raise ValueError(f"corpus_bleu: {len(hypotheses)} hypotheses but {len(references)} "
                         "references.")
    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


@dataclasses.dataclass
class DecodeResult:
    """What `Decode` produced for one split: metrics, and one output line per sentence."""

    metrics: dict[str, float]
    hypotheses: list[str]
    references: list[str]
    sources: list[str]

    @property
    def lines(self) -> list[str]:
        """The hypotheses, one per input line (what `--mode=decode` writes to a file)."""
        return list(self.hypotheses)


def _decoder_params() -> hyperparams.Params:
    dp = hyperparams.Params()
    dp.Define("beam_size", 4, "Beam width; 1 = greedy search.")
    dp.Define("length_penalty", 0.6, "Alpha of the length penalty ((5 + len) / 6) ** alpha.")
    dp.Define("batch_size", 0, "Sentences decoded per batch; 0 = the input's batch_size.")
    return dp


class TransformerMtTask(pipelined_task.PipelinedTask):
    """Source -> target translation; `network.layers` come from `layers.transformer_layers`."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("decoder", _decoder_params(), "Decoding (search) params.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        kinds = [type(layer) for layer in self.network.layers]
        expected = (layers.EmbeddingInputLayer, layers.EncoderToDecoderLayer, layers.SoftmaxLayer)
        if (kinds[0] is not expected[0] or kinds[-1] is not expected[2]
                or kinds.count(expected[1]) != 1):
            raise ValueError(f"{self.path}: network.layers must be layers.transformer_layers(...) "
                             f"(embedding, encoders, encoder-to-decoder, decoders, softmax), got "
                             f"{[k.__name__ for k in kinds]}.")
        self._e2d = kinds.index(layers.EncoderToDecoderLayer)
        if self.params.decoder.beam_size < 1:
            raise ValueError(f"{self.path}: decoder.beam_size must be >= 1, got "
                             f"{self.params.decoder.beam_size}.")
        self._decode_fns: dict[Any, Any] = {}

    def NetworkInputs(self, input_batch: NestedMap) -> NestedMap:
        fields = NETWORK_FIELDS + tuple(k for k in layers.PACKED_FIELDS if k in input_batch)
        return NestedMap({k: input_batch[k] for k in fields})

    def TokenCounts(self, input_batch: NestedMap) -> tuple[Any, Any]:
        """Source and target positions of the batch, and those that are not padding."""
        positions = tf.size(input_batch.src_paddings) + tf.size(input_batch.tgt_paddings)
        padding = (tf.reduce_sum(input_batch.src_paddings)
                   + tf.reduce_sum(input_batch.tgt_paddings))
        return positions, tf.cast(positions, tf.float32) - padding

    # -- decoding ------------------------------------------------------------

    def _run(self, i: int, fn: Any, *args: Any) -> Any:
        """Runs fn (a method of layer i) on the device of layer i's cell."""
        net = self.network
        with tf.device(net.devices[net.partition.cell_of_layer(i)]):
            return fn(*args)

    def Encode(self, theta: NestedMap, src_ids: tf.Tensor,
               src_paddings: tf.Tensor) -> tf.Tensor:
        """Source ids [B, S] -> encoder output [B, S, D]."""
        net, th = self.network, theta.network.layers
        x = self._run(0, net.layers[0].EmbedSource, th[0], src_ids, src_paddings)
        state = NestedMap(x=x, src_paddings=src_paddings)
        for i in range(1, self._e2d):
            state = self._run(i, net.layers[i].FProp, th[i], state)
        return self._run(self._e2d, net.layers[self._e2d].EncoderOutput, th[self._e2d],
                         state.x, src_paddings)

    def DecoderLogProbs(self, theta: NestedMap, encoder_output: tf.Tensor,
                        src_paddings: tf.Tensor, tgt_ids: tf.Tensor) -> tf.Tensor:
        """Log-probabilities [B, T, V] of the next token at every position of tgt_ids [B, T]."""
        net, th = self.network, theta.network.layers
        y = self._run(0, net.layers[0].EmbedTarget, th[0], tgt_ids, None)
        state = NestedMap(x=y, encoder_output=encoder_output, src_paddings=src_paddings,
                          tgt_paddings=tf.zeros(tf.shape(tgt_ids), tf.float32))
        last = len(net.layers) - 1
        for i in range(self._e2d + 1, last):
            state = self._run(i, net.layers[i].FProp, th[i], state)
        logits = self._run(last, net.layers[last].Logits, th[last], state.x)
        return tf.nn.log_softmax(logits, axis=-1)

    def DecodeBatch(self, src_ids: tf.Tensor, src_paddings: tf.Tensor,
                    max_length: int, beam_size: int | None = None) -> NestedMap:
        """Translates a batch (eval mode); greedy when beam_size is 1.

        Returns search.greedy_search / beam_search's NestedMap (ids [B, max_length], ...).
        """
        dp = self.params.decoder
        beam_size = dp.beam_size if beam_size is None else beam_size
        theta = self.theta
        # A static batch size, or (a serving signature's [None, S] sources) a dynamic one.
        batch_size = src_ids.shape[0] if src_ids.shape[0] is not None else tf.shape(src_ids)[0]
        with fprop_context.fprop_context(training=False, updates=None):
            enc = self.Encode(theta, src_ids, src_paddings)
            if beam_size > 1:
                enc = tf.repeat(enc, beam_size, axis=0)
                src_paddings = tf.repeat(src_paddings, beam_size, axis=0)

            def log_prob_fn(prefix: tf.Tensor, t: tf.Tensor) -> tf.Tensor:
                logp = self.DecoderLogProbs(theta, enc, src_paddings, prefix)
                return tf.gather(logp, t, axis=1)

            if beam_size == 1:
                return search.greedy_search(log_prob_fn, batch_size, max_length, vocab.BOS_ID,
                                            vocab.EOS_ID, vocab.PAD_ID)
            return search.beam_search(log_prob_fn, batch_size, beam_size, max_length,
                                      vocab.BOS_ID, vocab.EOS_ID, vocab.PAD_ID,
                                      dp.length_penalty)

    def Decode(self, input_params: hyperparams.Params,
               max_sentences: int = 0) -> DecodeResult:
        """Translates every line of the split of `input_params` and scores it with BLEU.

        Args:
          input_params: ParallelTextInput params of the split (its files, vocabulary, lengths).
          max_sentences: decode only the first this many lines; 0 = all.

        Returns:
          DecodeResult with metrics {bleu, num_sentences} and the detokenised hypotheses.
        """
        gen = input_params.Instantiate()
        if not isinstance(gen, input_generator.ParallelTextInput):
            raise ValueError(f"Decode needs ParallelTextInput params, got {type(gen).__name__}.")
        voc = gen.vocabulary()
        data = gen.load_split()
        n = len(data.sources) if not max_sentences else min(max_sentences, len(data.sources))
        if n == 0:
            raise ValueError(f"Decode: split {gen.params.split!r} of {gen.params.data_dir} is "
                             "empty.")
        batch_size = self.params.decoder.batch_size or gen.params.batch_size
        max_length = gen.params.max_target_length
        key = (batch_size, max_length)
        if key not in self._decode_fns:
            self._decode_fns[key] = tf.function(
                lambda ids, pads: self.DecodeBatch(ids, pads, max_length).ids, autograph=False)
        decode_fn = self._decode_fns[key]
        arrays = {k: v[:n] for k, v in data.arrays.items()}
        hypotheses: list[str] = []
        for start in range(0, n, batch_size):
            batch, real = input_generator.batch_for_decoding(arrays, start, batch_size)
            ids = np.asarray(decode_fn(batch.src_ids, batch.src_paddings))
            hypotheses += [voc.decode(row) for row in ids[:real]]
        references = data.references[:n]
        metrics = {"bleu": corpus_bleu(hypotheses, references), "num_sentences": float(n)}
        return DecodeResult(metrics, hypotheses, references, data.sources[:n])


    # -- serving -------------------------------------------------------------

    def Inference(self) -> inference.InferenceGraph:
        """`serving_default`: source sentences -> their beam-search translations, as strings.

        Input `sentences`: string [B] (any B), raw text as in the corpus' `.src` files.
        Outputs: `translations` string [B] (detokenised, as `Decode` writes them) and `scores`
        float32 [B] (the chosen hypothesis' summed log-probability). Tokenisation runs in the
        graph with tensorflow-text's sentencepiece ops (the SavedModel's client must
        `import tensorflow_text` before loading it): the sentencepiece model of the train
        input's data_dir is embedded in their op (it takes the model as an attribute, not a
        file) and travels beside it as the asset `assets/spm_<vocab_size>.model`. A source is
        truncated to max_source_length - 1 pieces plus EOS, as the input generator does;
        translations have at most max_target_length pieces (the train input's lengths).
        """
        import tensorflow_text as tf_text

        inp = self.params.input
        if inp is None or not issubclass(inp.cls, input_generator.ParallelTextInput):
            raise ValueError(f"{self.path}: Inference() needs the train input's "
                             "ParallelTextInput params (its vocabulary and lengths).")
        path = vocab.model_path(os.path.expanduser(inp.data_dir), inp.vocab_size)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{self.path}: the sentencepiece model {path} does not "
                                    "exist; export from the machine and data_dir that trained "
                                    "the model.")
        with open(path, "rb") as f:
            tokenizer = tf_text.SentencepieceTokenizer(model=f.read(), out_type=tf.int32)
        max_source, max_target = inp.max_source_length, inp.max_target_length

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="sentences")])
        def serving_default(sentences: tf.Tensor) -> dict[str, tf.Tensor]:
            pieces = tokenizer.tokenize(sentences)[:, :max_source - 1]
            eos = tf.fill([tf.shape(sentences)[0], 1], tf.constant(vocab.EOS_ID, tf.int32))
            rows = tf.concat([pieces, eos], axis=1)
            src_ids = rows.to_tensor(default_value=vocab.PAD_ID, shape=[None, max_source])
            lengths = tf.cast(rows.row_lengths(), tf.int32)
            src_paddings = 1.0 - tf.sequence_mask(lengths, max_source, dtype=tf.float32)
            best = self.DecodeBatch(src_ids, src_paddings, max_target)
            # As vocab.Vocabulary.decode: cut at the first EOS, drop padding and BOS.
            ids = best.ids
            before_eos = tf.equal(
                tf.cumsum(tf.cast(tf.equal(ids, vocab.EOS_ID), tf.int32), axis=1,
                          exclusive=True), 0)
            keep = (before_eos & tf.not_equal(ids, vocab.EOS_ID)
                    & tf.not_equal(ids, vocab.PAD_ID) & tf.not_equal(ids, vocab.BOS_ID))
            translations = tokenizer.detokenize(tf.ragged.boolean_mask(ids, keep))
            return {"translations": translations, "scores": best.scores}

        return inference.InferenceGraph(
            signatures={"serving_default": serving_default},
            resources={"tokenizer": tokenizer,
                       "vocabulary_file": tf.saved_model.Asset(path)})


def transformer_task_params(
    name: str, vocab_size: int, model_dim: int, hidden_dim: int, num_heads: int,
    num_layers: int, batch_size: int, max_source_length: int, max_target_length: int,
    num_cells: int = 2, num_micro_batches: int = 2, atten_hidden_dim: int = 0,
    share_embeddings: bool = True, label_smoothing: float = 0.1, dropout_prob: float = 0.0,
    fprop_dtype: tf.DType | None = None,
) -> hyperparams.InstantiableParams:
    """Task params of a pipelined Transformer with `num_layers` encoder and decoder layers."""
    p = TransformerMtTask.Params().Set(name=name)
    p.network.Set(
        layers=layers.transformer_layers(
            vocab_size, model_dim, hidden_dim, num_heads, num_layers, num_layers,
            atten_hidden_dim=atten_hidden_dim, share_embeddings=share_embeddings,
            label_smoothing=label_smoothing, dropout_prob=dropout_prob,
            fprop_dtype=fprop_dtype),
        input_shapes=layers.input_shapes(batch_size, max_source_length, max_target_length),
        num_cells=num_cells, num_micro_batches=num_micro_batches)
    return p
