"""Greedy and beam search over any autoregressive model, in TensorFlow graph ops.

Both searches call `log_prob_fn(prefix_ids, t)`: `prefix_ids` [N, L] int32 holds BOS in column 0
and the tokens chosen so far in columns 1..t (PAD after them); it returns float32 log-probabilities
[N, V] of the token at output position t. The model may look at the whole buffer as long as it is
causal (a Transformer decoder recomputed on the buffer is). Searches run `L` steps in a
`tf.while_loop`; an unfinished sequence never emits PAD, and after EOS it only emits PAD, at no
cost.

Beam search keeps `beam_size` hypotheses per example ranked by their summed log-probability and
returns, per example, the one with the best length-normalised score
`score / ((5 + length) / 6) ** alpha` (Wu et al. 2016's length penalty; length counts the EOS).
With beam_size 1 it is exactly greedy search.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from lingvo_lite.core.nested_map import NestedMap

__all__ = ["beam_search", "greedy_search", "length_penalty"]

LogProbFn = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]
_NEG = -1e9  # Log-probability of an excluded choice: finite, so sums never produce NaN.


def _write_column(buf: tf.Tensor, t: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
    """buf [..., L] with column t set to values [...]; a no-op when t >= L."""
    mask = tf.cast(tf.one_hot(t, tf.shape(buf)[-1], dtype=tf.int32), tf.bool)
    return tf.where(mask, values[..., tf.newaxis], buf)


def _initial_buffer(n: int, max_length: int, bos_id: int, pad_id: int) -> tf.Tensor:
    buf = tf.fill([n, max_length], tf.constant(pad_id, tf.int32))
    return _write_column(buf, tf.constant(0), tf.fill([n], tf.constant(bos_id, tf.int32)))


def _no_pad(logp: tf.Tensor, pad_id: int) -> tf.Tensor:
    """An unfinished hypothesis never emits PAD (it only marks finished ones)."""
    is_pad = tf.equal(tf.range(tf.shape(logp)[-1]), pad_id)
    return tf.where(is_pad, _NEG, logp)


def length_penalty(lengths: tf.Tensor, alpha: float) -> tf.Tensor:
    """((5 + length) / 6) ** alpha."""
    return tf.pow((5.0 + tf.cast(lengths, tf.float32)) / 6.0, alpha)


def greedy_search(log_prob_fn: LogProbFn, batch_size: int, max_length: int, bos_id: int,
                  eos_id: int, pad_id: int = 0) -> NestedMap:
    """Picks the most likely token at every step.

    Returns:
      NestedMap(ids [B, max_length] int32: output tokens, EOS then PAD once finished;
                scores [B] float32: summed log-probabilities of the emitted tokens, EOS included;
                lengths [B] int32: tokens up to and including EOS).
    """
    def body(t, buf, out, scores, finished):
        logp = _no_pad(tf.cast(log_prob_fn(buf, t), tf.float32), pad_id)
        tok = tf.argmax(logp, axis=-1, output_type=tf.int32)
        tok = tf.where(finished, pad_id, tok)
        step = tf.gather(logp, tok, batch_dims=1)
        scores += tf.where(finished, 0.0, step)
        out = _write_column(out, t, tok)
        buf = _write_column(buf, t + 1, tok)
        finished = tf.logical_or(finished, tf.equal(tok, eos_id))
        return t + 1, buf, out, scores, finished

    init = (tf.constant(0), _initial_buffer(batch_size, max_length, bos_id, pad_id),
            tf.fill([batch_size, max_length], tf.constant(pad_id, tf.int32)),
            tf.zeros([batch_size]), tf.zeros([batch_size], tf.bool))
    _, _, out, scores, _ = tf.while_loop(lambda t, *_: t < max_length, body, init)
    lengths = tf.reduce_sum(tf.cast(tf.not_equal(out, pad_id), tf.int32), axis=-1)
    return NestedMap(ids=out, scores=scores, lengths=lengths)


def beam_search(log_prob_fn: LogProbFn, batch_size: int, beam_size: int, max_length: int,
                bos_id: int, eos_id: int, pad_id: int = 0,
                length_penalty_alpha: float = 0.6) -> NestedMap:
    """Beam search; `log_prob_fn` sees N = batch_size * beam_size rows, example-major.

    Row b * beam_size + k is beam k of example b, so per-example model state (e.g. the encoder
    output) must be repeated beam_size times with `tf.repeat(x, beam_size, axis=0)`.

    Returns:
      NestedMap(ids [B, max_length], scores [B] (summed log-probs), lengths [B] of the best
      hypothesis by length-normalised score, and beam_ids [B, K, max_length], beam_scores [B, K]
      of all final hypotheses).
    """
    if beam_size < 1:
        raise ValueError(f"beam_search: beam_size must be >= 1, got {beam_size}.")
    B, K, L = batch_size, beam_size, max_length

    def body(t, buf, out, scores, finished):
        logp = tf.reshape(tf.cast(log_prob_fn(tf.reshape(buf, [B * K, L]), t), tf.float32),
                          [B, K, -1])
        logp = _no_pad(logp, pad_id)
        vocab = tf.shape(logp)[-1]
        # A finished hypothesis may only continue with PAD, at no cost.
        pad_only = tf.where(tf.equal(tf.range(vocab), pad_id), 0.0, _NEG)
        logp = tf.where(finished[:, :, tf.newaxis], pad_only, logp)
        cand = tf.reshape(scores[:, :, tf.newaxis] + logp, [B, -1])  # [B, K * V]
        scores, flat = tf.math.top_k(cand, k=K)
        parent = flat // vocab
        tok = flat % vocab
        out = _write_column(tf.gather(out, parent, batch_dims=1), t, tok)
        buf = _write_column(tf.gather(buf, parent, batch_dims=1), t + 1, tok)
        finished = tf.logical_or(tf.gather(finished, parent, batch_dims=1),
                                 tf.equal(tok, eos_id))
        return t + 1, buf, out, scores, finished

    buf = tf.reshape(_initial_buffer(B * K, L, bos_id, pad_id), [B, K, L])
    # Only beam 0 is live at the start, so the first step does not pick K copies of one token.
    scores = tf.tile(tf.concat([[0.0], tf.fill([K - 1], _NEG)], 0)[tf.newaxis], [B, 1])
    init = (tf.constant(0), buf, tf.fill([B, K, L], tf.constant(pad_id, tf.int32)), scores,
            tf.zeros([B, K], tf.bool))
    _, _, out, scores, _ = tf.while_loop(lambda t, *_: t < L, body, init)
    lengths = tf.reduce_sum(tf.cast(tf.not_equal(out, pad_id), tf.int32), axis=-1)  # [B, K]
    best = tf.argmax(scores / length_penalty(lengths, length_penalty_alpha), axis=-1,
                     output_type=tf.int32)
    return NestedMap(ids=tf.gather(out, best, batch_dims=1),
                     scores=tf.gather(scores, best, batch_dims=1),
                     lengths=tf.gather(lengths, best, batch_dims=1),
                     beam_ids=out, beam_scores=scores)
