"""A character language model as a KerasTask that also serves greedy text continuation.

`CharLMTask` is a `KerasTask` (its network a causal LM over `char_lm_input`'s characters,
inputs `token_ids` and `padding_mask`, output next-character logits [B, L, V]) whose
`Inference()` adds `generate` to the plain model's `serving_default`: a prompt -> its greedy
continuation, decoded in the graph with the vocabulary of the train input (a lookup table in the
SavedModel, so clients send and receive text).
"""

from __future__ import annotations

import tensorflow as tf

from lingvo_lite.keras import KerasTask
from lingvo_lite.tasks import inference
from tasks.text import char_lm_input

__all__ = ["CharLMTask", "END_OF_LINE"]

# A continuation stops after this character (the corpus has one sentence pair a line).
END_OF_LINE = "\n"


class CharLMTask(KerasTask):
    """A KerasTask on CharLMInput windows that serves `generate` (see `Inference`)."""

    def Inference(self) -> inference.InferenceGraph:
        """`serving_default` (the plain model's logits, KerasTask's) and `generate`.

        `generate`: input `prompts` string [B] (any B, each 1 to L - 1 characters of the
        corpus' vocabulary, L the model's sequence length); output `continuations` string [B]:
        the characters the model picks one at a time by arg-max after its prompt, up to and
        excluding the first end of line, or until prompt and continuation fill L characters.
        A prompt that is empty, too long or holds a character the model does not know fails
        the call (InvalidArgumentError naming the problem).
        """
        graph = super().Inference()
        inp = self.params.input
        if inp is None or not issubclass(inp.cls, char_lm_input.CharLMInput):
            raise ValueError(f"{self.path}: Inference() needs the train input's CharLMInput "
                             "params (its vocabulary).")
        chars = char_lm_input.vocabulary(inp.num_pairs)
        ids = {c: i for i, c in enumerate(chars)}
        if END_OF_LINE not in ids:
            raise ValueError(f"{self.path}: the vocabulary has no end of line to stop at.")
        eol = ids[END_OF_LINE]
        table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(chars[1:]), tf.range(1, len(chars), dtype=tf.int32)),
            default_value=-1)
        id_to_char = tf.constant(chars)
        specs = inference.keras_input_specs(self)
        seq_len = specs["token_ids"].shape[1]

        def next_ids(buf: tf.Tensor, lengths: tf.Tensor) -> tf.Tensor:
            """The arg-max character after each row's first `lengths` tokens."""
            feed = {"token_ids": tf.cast(buf, specs["token_ids"].dtype),
                    "padding_mask": tf.ones_like(buf, specs["padding_mask"].dtype)}
            logits = inference.keras_predictions(self, feed)  # [B, L, V]; causal.
            last = tf.gather(logits, lengths - 1, axis=1, batch_dims=1)
            return tf.argmax(last, axis=-1, output_type=tf.int32)

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="prompts")])
        def generate(prompts: tf.Tensor) -> dict[str, tf.Tensor]:
            prompt_ids = table.lookup(tf.strings.unicode_split(prompts, "UTF-8"))
            lengths = tf.cast(prompt_ids.row_lengths(), tf.int32)
            checks = [
                tf.debugging.assert_non_negative(
                    prompt_ids.flat_values, message="generate: a prompt holds a character "
                    "that is not in the model's vocabulary"),
                tf.debugging.assert_positive(lengths, message="generate: a prompt is empty"),
                tf.debugging.assert_less(lengths, seq_len, message=(
                    f"generate: a prompt is longer than {seq_len - 1} characters")),
            ]
            with tf.control_dependencies(checks):
                buf = prompt_ids.to_tensor(default_value=0, shape=[None, seq_len])
            start = lengths
            finished = tf.greater_equal(lengths, seq_len)

            def step(buf, lengths, finished):
                token = next_ids(buf, lengths)
                write = tf.logical_not(finished)
                at = tf.one_hot(lengths, seq_len, on_value=True, off_value=False)
                buf = tf.where(at & write[:, None], token[:, None], buf)
                lengths = lengths + tf.cast(write, tf.int32)
                finished = finished | tf.equal(token, eol) | tf.greater_equal(lengths, seq_len)
                return buf, lengths, finished

            buf, lengths, _ = tf.while_loop(
                lambda buf, lengths, finished: tf.logical_not(tf.reduce_all(finished)), step,
                (buf, lengths, finished), maximum_iterations=seq_len)
            positions = tf.range(seq_len)[None, :]
            new = (positions >= start[:, None]) & (positions < lengths[:, None])
            new &= tf.not_equal(buf, eol)  # Only the last new character can be the end of line.
            continuation = tf.ragged.boolean_mask(tf.gather(id_to_char, buf), new)
            return {"continuations": tf.strings.reduce_join(continuation, axis=-1)}

        graph.signatures["generate"] = generate
        graph.resources["vocabulary_table"] = table
        return graph
