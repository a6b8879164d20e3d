"""A keras-hub GPT-2 (built from a config, random weights) trained by trainer.py, pipelined.

Needs the `keras-hub` extra (`pip install -e .[keras-hub]`); keras_hub is imported only when
the model is built, so listing the models works without it.
"""

from __future__ import annotations

from typing import Any

import keras

from lingvo_lite.core import hyperparams
from lingvo_lite.keras import functional_network_params
from lingvo_lite.tasks import learning_rate, model_registry, optimizers
from tasks.text import char_lm, char_lm_input

__all__ = ["GPT2CharLM", "gpt2_causal_lm"]


def gpt2_causal_lm(vocabulary_size: int, seq_len: int, num_layers: int = 2,
                   hidden_dim: int = 64, num_heads: int = 4) -> keras.Model:
    """A small keras-hub GPT2CausalLM from its config (nothing downloaded; no dropout)."""
    try:
        import keras_hub
    except ImportError:
        raise ImportError("keras_gpt2 needs keras-hub: pip install -e .[keras-hub]") from None
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary_size, num_layers=num_layers, num_heads=num_heads,
        hidden_dim=hidden_dim, intermediate_dim=4 * hidden_dim, dropout=0.0,
        max_sequence_length=seq_len)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


@model_registry.register
class GPT2CharLM(model_registry.SplitInputModelParams):
    """A small keras-hub GPT-2 on the generated sentences, one character a token (K=2, T=2);
    exported, it serves a prompt's greedy continuation (`generate`, tasks/text/char_lm.py)."""

    SEQ_LEN = 64
    BATCH_SIZE = 16
    MAX_STEPS = 1000

    def split_input(self, split: str) -> hyperparams.Params:
        p = char_lm_input.CharLMInput.Params().Set(
            name=f"char_lm_{split}", split=split, seq_len=self.SEQ_LEN,
            batch_size=self.BATCH_SIZE)
        if split != "train":
            p.Set(shuffle=False, repeat=False)
        return p

    def network_inputs(self) -> dict[str, Any]:
        """One example's shape of each input of the model (keras-hub's are dynamic)."""
        return {"token_ids": (self.SEQ_LEN,), "padding_mask": (self.SEQ_LEN,)}

    def Task(self) -> hyperparams.InstantiableParams:
        vocab = len(char_lm_input.vocabulary())
        p = char_lm.CharLMTask.Params().Set(name="gpt2_char_lm", label_field="label",
                                   input_fields={k: k for k in self.network_inputs()})
        p.network = functional_network_params(
            lambda: gpt2_causal_lm(vocab, self.SEQ_LEN), input_shape=self.network_inputs(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            sparse_accuracy=True, num_cells=2, num_micro_batches=2,
            cost_batch_size=self.BATCH_SIZE, name="network")
        p.random_seed = 1
        p.train.Set(
            learning_rate=3e-3, optimizer=optimizers.Adam.Params(),
            lr_schedule=learning_rate.CosineDecay.Params().Set(
                warmup_steps=20, total_steps=self.MAX_STEPS, final_factor=0.1),
            max_steps=self.MAX_STEPS, save_interval_steps=250, summary_interval_steps=10,
            log_interval_steps=100, eval_interval_steps=500)
        return p
