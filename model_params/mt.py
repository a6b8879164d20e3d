"""Registered translation models: a small Transformer on generated data, and GPipe's T(L, H, A).

GPipe (Huang et al. 2019, Section 5) names its Transformers T(L, H, A): L encoder and L decoder
layers, feed-forward hidden dimension H and A attention heads, model dimension 1024 and a 64k
vocabulary. Its models are T(6, 8192, 16) (400M parameters), T(12, 16384, 32) and
T(24, 8192, 16) (1.3B each), T(32, 16384, 32) (3B) and T(64, 16384, 32), the 128-layer 6B
model, partitioned over 2, 4, 8 and 16 accelerators. The paper widens "the number of attention
heads (and # of attention channels)" with A; 64 channels per head (attention depth 64 * A)
reproduces all five of its parameter counts, so that is what these configurations use.
"""

from __future__ import annotations

from lingvo_lite.core import hyperparams
from lingvo_lite.tasks import learning_rate, model_registry, optimizers
from tasks.mt import input_generator, layers, model

__all__ = [
    "TransformerSmall",
    "TransformerSmallBuckets",
    "TransformerSmallPacked",
    "TransformerT12_16384_32",
    "TransformerT24_8192_16",
    "TransformerT32_16384_32",
    "TransformerT64_16384_32",
    "TransformerT6_8192_16",
]


@model_registry.register
class TransformerSmall(model_registry.SplitInputModelParams):
    """2+2-layer Transformer on the generated English->German corpus, pipelined over 2 cells."""

    DATA_DIR = input_generator.DEFAULT_DATA_DIR
    GENERATE = "en_de_numbers"
    VOCAB_SIZE = 512
    MAX_SOURCE_LENGTH = 16
    MAX_TARGET_LENGTH = 18
    BATCH_SIZE = 64
    EVAL_BATCH_SIZE = 100  # Divides the 500 dev and test sentences.
    MODEL_DIM = 128
    HIDDEN_DIM = 256
    NUM_HEADS = 4
    NUM_LAYERS = 2
    NUM_CELLS = 2
    NUM_MICRO_BATCHES = 2
    MAX_STEPS = 1000

    def split_input(self, split: str) -> hyperparams.Params:
        p = input_generator.ParallelTextInput.Params().Set(
            name=f"mt_{split}", data_dir=self.DATA_DIR, generate=self.GENERATE, split=split,
            vocab_size=self.VOCAB_SIZE, max_source_length=self.MAX_SOURCE_LENGTH,
            max_target_length=self.MAX_TARGET_LENGTH, batch_size=self.BATCH_SIZE)
        if split != "train":
            p.Set(shuffle=False, repeat=False, batch_size=self.EVAL_BATCH_SIZE)
        return p

    def Task(self) -> hyperparams.InstantiableParams:
        p = model.transformer_task_params(
            "transformer_small", self.VOCAB_SIZE, self.MODEL_DIM, self.HIDDEN_DIM,
            self.NUM_HEADS, self.NUM_LAYERS, self.BATCH_SIZE, self.MAX_SOURCE_LENGTH,
            self.MAX_TARGET_LENGTH, num_cells=self.NUM_CELLS,
            num_micro_batches=self.NUM_MICRO_BATCHES)
        p.random_seed = 1
        p.decoder.Set(beam_size=4, length_penalty=0.6)
        p.train.Set(
            learning_rate=2e-3, optimizer=optimizers.Adam.Params(),
            lr_schedule=learning_rate.CosineDecay.Params().Set(
                warmup_steps=100, total_steps=self.MAX_STEPS, final_factor=0.05),
            clip_gradient_norm_to_value=1.0, max_steps=self.MAX_STEPS, save_interval_steps=500,
            summary_interval_steps=20, log_interval_steps=100, eval_interval_steps=500)
        return p


@model_registry.register
class TransformerSmallBuckets(TransformerSmall):
    """TransformerSmall on length-bucketed batches: each pair padded to the first of 4 lengths
    that holds it, with about 1,150 positions per batch whatever the bucket."""

    BUCKET_LENGTHS = (8, 12, 16, 18)
    BUCKET_BATCH_SIZES = (144, 96, 72, 64)

    def split_input(self, split: str) -> hyperparams.Params:
        p = super().split_input(split)
        if split == "train":
            p.Set(bucket_lengths=list(self.BUCKET_LENGTHS),
                  bucket_batch_sizes=list(self.BUCKET_BATCH_SIZES))
        return p

    def Task(self) -> hyperparams.InstantiableParams:
        p = super().Task()
        shapes = input_generator.bucket_shapes(self.BUCKET_LENGTHS, self.BUCKET_BATCH_SIZES)
        # Memory is planned for the longest bucket; each bucket is traced once.
        p.network.Set(input_buckets=shapes, input_shapes=shapes[-1])
        return p


@model_registry.register
class TransformerSmallPacked(TransformerSmall):
    """TransformerSmall on packed rows: consecutive pairs share a row of 16 / 18 positions while
    they fit (segment ids keep them apart), 32 rows per batch."""

    BATCH_SIZE = 32

    def split_input(self, split: str) -> hyperparams.Params:
        p = super().split_input(split)
        if split == "train":
            p.Set(pack=True)
        return p

    def Task(self) -> hyperparams.InstantiableParams:
        p = super().Task()
        p.network.input_shapes = layers.input_shapes(
            self.BATCH_SIZE, self.MAX_SOURCE_LENGTH, self.MAX_TARGET_LENGTH, packed=True)
        return p


class _GPipeTransformer(model_registry.SplitInputModelParams):
    """GPipe's T(L, H, A) on the user's parallel text in DATA_DIR (64k sentencepiece vocab)."""

    NUM_LAYERS = 6  # L: encoder layers = decoder layers.
    HIDDEN_DIM = 8192  # H.
    NUM_HEADS = 16  # A.
    MODEL_DIM = 1024
    VOCAB_SIZE = 64000
    DATA_DIR = "~/mt_data"
    MAX_LENGTH = 128
    BATCH_SIZE = 256
    NUM_CELLS = 2
    NUM_MICRO_BATCHES = 16

    def split_input(self, split: str) -> hyperparams.Params:
        p = input_generator.ParallelTextInput.Params().Set(
            name=f"mt_{split}", data_dir=self.DATA_DIR, generate="", split=split,
            vocab_size=self.VOCAB_SIZE, max_source_length=self.MAX_LENGTH,
            max_target_length=self.MAX_LENGTH, batch_size=self.BATCH_SIZE)
        if split != "train":
            p.Set(shuffle=False, repeat=False)
        return p

    def Task(self) -> hyperparams.InstantiableParams:
        p = model.transformer_task_params(
            f"transformer_t{self.NUM_LAYERS}_{self.HIDDEN_DIM}_{self.NUM_HEADS}",
            self.VOCAB_SIZE, self.MODEL_DIM, self.HIDDEN_DIM, self.NUM_HEADS, self.NUM_LAYERS,
            self.BATCH_SIZE, self.MAX_LENGTH, self.MAX_LENGTH, num_cells=self.NUM_CELLS,
            num_micro_batches=self.NUM_MICRO_BATCHES, atten_hidden_dim=64 * self.NUM_HEADS,
            share_embeddings=True, label_smoothing=0.1, dropout_prob=0.1)
        p.train.Set(
            learning_rate=1.0, optimizer=optimizers.Adam.Params(),
            lr_schedule=learning_rate.TransformerSchedule.Params().Set(
                warmup_steps=4000, model_dim=self.MODEL_DIM),
            clip_gradient_norm_to_value=1.0, max_steps=500_000, save_interval_steps=5000,
            summary_interval_steps=100, log_interval_steps=100)
        return p


@model_registry.register
class TransformerT6_8192_16(_GPipeTransformer):  # noqa: N801 (the paper's T(L, H, A))
    """GPipe's T(6, 8192, 16): Transformer-Big-like baseline, ~400M parameters, 2 cells."""


@model_registry.register
class TransformerT12_16384_32(_GPipeTransformer):  # noqa: N801
    """GPipe's T(12, 16384, 32): the 1.3B-parameter wide model, 2 cells."""

    NUM_LAYERS = 12
    HIDDEN_DIM = 16384
    NUM_HEADS = 32


@model_registry.register
class TransformerT24_8192_16(_GPipeTransformer):  # noqa: N801
    """GPipe's T(24, 8192, 16): the 1.3B-parameter deep model, 4 cells."""

    NUM_LAYERS = 24
    NUM_CELLS = 4


@model_registry.register
class TransformerT32_16384_32(_GPipeTransformer):  # noqa: N801
    """GPipe's T(32, 16384, 32): 3B parameters, 8 cells."""

    NUM_LAYERS = 32
    HIDDEN_DIM = 16384
    NUM_HEADS = 32
    NUM_CELLS = 8


@model_registry.register
class TransformerT64_16384_32(_GPipeTransformer):  # noqa: N801
    """GPipe's T(64, 16384, 32): the 128-layer, 6B-parameter Transformer, 16 cells."""

    NUM_LAYERS = 64
    HIDDEN_DIM = 16384
    NUM_HEADS = 32
    NUM_CELLS = 16
