"""One tiny keras-hub task model per family, built from a config with random weights.

A helper for tools/keras_hub_family_probe.py (and tests that want these models): every
`FamilySpec` builds its model seeded (two `build()` calls give identical weights), with
`preprocessor=None`, and gives the per-example input shapes PipelinedModel takes, a batch
of inputs and labels, and the loss. Vocabulary 64, 2 layers, hidden 16 (or the smallest
each family's constraints allow), sequence 8, small images, 3 classes, dropout 0.
Nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import keras
import numpy as np

VOCAB, SEQ, CLASSES = 64, 8, 3

Batch = tuple[Any, np.ndarray]


@dataclass(frozen=True)
class FamilySpec:
    """A keras-hub family's tiny task model, its inputs, labels and loss."""

    name: str
    kind: str  # "causal_lm", "text_classifier", "image_classifier" or "seq2seq_lm".
    build: Callable[[], keras.Model]
    input_shape: dict[str, tuple[int, ...]] | tuple[int, ...]
    batch: Callable[..., Batch]
    loss: keras.losses.Loss


def _hub() -> Any:
    import keras_hub  # Imported on use: the module imports where keras-hub is missing.

    return keras_hub.models


def _logits_loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _seeded(seed: int, make: Callable[[Any], keras.Model]) -> Callable[[], keras.Model]:
    def build() -> keras.Model:
        keras.utils.set_random_seed(seed)
        return make(_hub())

    return build


def _mask(n: int, pad_from: int = 6) -> np.ndarray:
    mask = np.ones((n, SEQ), "int32")
    mask[::2, pad_from:] = 0  # Padded examples: the padding mask matters.
    return mask


def _next_ids(ids: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Per-token next ids: the sequence shifted left, a random id after the last token."""
    last = rng.integers(1, VOCAB, (ids.shape[0], 1)).astype("int32")
    return np.concatenate([ids[:, 1:], last], axis=1).astype("int32")


def token_batch(n: int, seed: int = 0) -> Batch:
    """Causal LM inputs (token ids, padding mask) and the next id of every token."""
    rng = np.random.default_rng(seed)
    mask = _mask(n)
    ids = rng.integers(1, VOCAB, (n, SEQ)).astype("int32") * mask
    return {"token_ids": ids, "padding_mask": mask}, _next_ids(ids, rng)


def classifier_batch(keys: tuple[str, ...]) -> Callable[..., Batch]:
    """Text classifier inputs named `keys` (of token_ids, segment_ids, padding_mask)."""

    def batch(n: int, seed: int = 0) -> Batch:
        rng = np.random.default_rng(seed)
        mask = _mask(n, pad_from=5)
        segments = np.zeros((n, SEQ), "int32")
        segments[:, 4:] = 1
        every = {"token_ids": rng.integers(1, VOCAB, (n, SEQ)).astype("int32") * mask,
                 "segment_ids": segments * mask, "padding_mask": mask}
        return {k: every[k] for k in keys}, rng.integers(0, CLASSES, n).astype("int32")

    return batch


def seq2seq_batch(n: int, seed: int = 0) -> Batch:
    """Encoder and decoder token ids and masks; the decoder's next id of every token."""
    rng = np.random.default_rng(seed)
    enc_mask, dec_mask = _mask(n, pad_from=5), _mask(n, pad_from=6)
    enc = rng.integers(1, VOCAB, (n, SEQ)).astype("int32") * enc_mask
    dec = rng.integers(1, VOCAB, (n, SEQ)).astype("int32") * dec_mask
    x = {"encoder_token_ids": enc, "encoder_padding_mask": enc_mask,
         "decoder_token_ids": dec, "decoder_padding_mask": dec_mask}
    return x, _next_ids(dec, rng)


def image_batch(size: int) -> Callable[..., Batch]:
    """Normal images of `size` x `size` x 3 and class ids."""

    def batch(n: int, seed: int = 0) -> Batch:
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(n, size, size, 3)).astype("float32")
        return x, rng.integers(0, CLASSES, n).astype("int32")

    return batch


_LM_SHAPES = {"token_ids": (SEQ,), "padding_mask": (SEQ,)}
_SEQ2SEQ_SHAPES = {"encoder_token_ids": (SEQ,), "encoder_padding_mask": (SEQ,),
                   "decoder_token_ids": (SEQ,), "decoder_padding_mask": (SEQ,)}


def _causal_lm(name: str, seed: int, **config: Any) -> FamilySpec:
    def make(models: Any) -> keras.Model:
        backbone = getattr(models, f"{name}Backbone")(vocabulary_size=VOCAB, num_layers=2,
                                                      **config)
        return getattr(models, f"{name}CausalLM")(backbone=backbone, preprocessor=None)

    return FamilySpec(name, "causal_lm", _seeded(seed, make), dict(_LM_SHAPES), token_batch,
                      _logits_loss())


def _text_classifier(name: str, seed: int, keys: tuple[str, ...], task: dict[str, Any],
                     **config: Any) -> FamilySpec:
    def make(models: Any) -> keras.Model:
        backbone = getattr(models, f"{name}Backbone")(vocabulary_size=VOCAB, num_layers=2,
                                                      **config)
        return getattr(models, f"{name}TextClassifier")(
            backbone=backbone, num_classes=CLASSES, preprocessor=None, **task)

    return FamilySpec(name, "text_classifier", _seeded(seed, make),
                      {k: (SEQ,) for k in keys}, classifier_batch(keys), _logits_loss())


def _image_classifier(name: str, seed: int, size: int, task: dict[str, Any] | None = None,
                      shape_arg: str = "image_shape", **config: Any) -> FamilySpec:
    def make(models: Any) -> keras.Model:
        backbone = getattr(models, f"{name}Backbone")(**{shape_arg: (size, size, 3)},
                                                      **config)
        return getattr(models, f"{name}ImageClassifier")(
            backbone=backbone, num_classes=CLASSES, preprocessor=None, **(task or {}))

    return FamilySpec(name, "image_classifier", _seeded(seed, make), (size, size, 3),
                      image_batch(size), _logits_loss())


def _seq2seq_lm(name: str, seed: int, **config: Any) -> FamilySpec:
    def make(models: Any) -> keras.Model:
        backbone = getattr(models, f"{name}Backbone")(vocabulary_size=VOCAB, num_layers=2,
                                                      **config)
        return getattr(models, f"{name}Seq2SeqLM")(backbone=backbone, preprocessor=None)

    return FamilySpec(name, "seq2seq_lm", _seeded(seed, make), dict(_SEQ2SEQ_SHAPES),
                      seq2seq_batch, _logits_loss())


# Attention with 2 query heads of 8 and 1 key/value head (grouped-query families).
_GQA = {"num_query_heads": 2, "num_key_value_heads": 1, "hidden_dim": 16,
        "intermediate_dim": 32}
_TEXT = ("token_ids", "padding_mask")
_TEXT_SEGMENTS = ("token_ids", "segment_ids", "padding_mask")


def families() -> list[FamilySpec]:
    """Every family's spec, in the order CausalLM, TextClassifier, ImageClassifier,
    Seq2SeqLM."""
    return [
        # --- CausalLM ---
        _causal_lm("GPT2", 101, num_heads=2, hidden_dim=16, intermediate_dim=32, dropout=0.0,
                   max_sequence_length=SEQ),
        _causal_lm("GPTNeoX", 102, num_heads=2, hidden_dim=16, intermediate_dim=32,
                   dropout=0.0, max_sequence_length=SEQ),
        _causal_lm("Llama", 103, **_GQA),
        _causal_lm("Llama3", 104, **_GQA),
        _causal_lm("Mistral", 105, **_GQA),
        _causal_lm("Mixtral", 106, **_GQA, num_experts=4, top_k=2),
        _causal_lm("Gemma", 107, **_GQA, head_dim=8),
        _causal_lm("Gemma3", 108, **_GQA, head_dim=8, image_size=16, vision_encoder=None),
        _causal_lm("Qwen", 109, **_GQA),
        _causal_lm("Qwen3", 110, **_GQA, head_dim=8),
        _causal_lm("QwenMoe", 111, **_GQA, moe_intermediate_dim=16,
                   shared_expert_intermediate_dim=32, num_experts=4, top_k=2),
        _causal_lm("Qwen3Moe", 112, **_GQA, head_dim=8, moe_intermediate_dim=16,
                   num_experts=4, top_k=2),
        _causal_lm("Phi3", 113, **_GQA),
        _causal_lm("OPT", 114, num_heads=2, hidden_dim=16, intermediate_dim=32, dropout=0.0,
                   max_sequence_length=SEQ),
        _causal_lm("Bloom", 115, num_heads=2, hidden_dim=16, intermediate_dim=32),
        _causal_lm("Falcon", 116, num_attention_heads=2, hidden_dim=16, intermediate_dim=32),
        _causal_lm("SmolLM3", 117, hidden_dim=16, intermediate_dim=32, num_attention_heads=2,
                   num_key_value_heads=1, attention_bias=False, attention_dropout=0.0,
                   rope_layer_enabled_list=[True, True], layer_types=["attention"] * 2,
                   mlp_bias=False, layer_norm_epsilon=1e-5, max_position_embeddings=SEQ,
                   rope_theta=10000.0, partial_rotary_factor=1.0),
        # --- TextClassifier ---
        _text_classifier("Bert", 201, _TEXT_SEGMENTS, {"dropout": 0.0}, num_heads=2,
                         hidden_dim=16, intermediate_dim=32, dropout=0.0,
                         max_sequence_length=SEQ),
        _text_classifier("Roberta", 202, _TEXT, {"dropout": 0.0}, num_heads=2, hidden_dim=16,
                         intermediate_dim=32, dropout=0.0, max_sequence_length=SEQ),
        _text_classifier("DistilBert", 203, _TEXT, {"dropout": 0.0}, num_heads=2,
                         hidden_dim=16, intermediate_dim=32, dropout=0.0,
                         max_sequence_length=SEQ),
        _text_classifier("Albert", 204, _TEXT_SEGMENTS, {"dropout": 0.0}, num_heads=2,
                         embedding_dim=8, hidden_dim=16, intermediate_dim=32, dropout=0.0,
                         max_sequence_length=SEQ),
        _text_classifier("DebertaV3", 205, _TEXT, {"dropout": 0.0}, num_heads=2,
                         hidden_dim=16, intermediate_dim=32, dropout=0.0,
                         max_sequence_length=SEQ, bucket_size=4),
        _text_classifier("XLMRoberta", 206, _TEXT, {"dropout": 0.0}, num_heads=2,
                         hidden_dim=16, intermediate_dim=32, dropout=0.0,
                         max_sequence_length=SEQ),
        _text_classifier("FNet", 207, ("token_ids", "segment_ids"), {"dropout": 0.0},
                         hidden_dim=16, intermediate_dim=32, dropout=0.0,
                         max_sequence_length=SEQ),
        # --- ImageClassifier ---
        _image_classifier("ResNet", 301, 16, input_conv_filters=[64],
                          input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 16],
                          stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2],
                          block_type="basic_block", use_pre_activation=True),
        _image_classifier("EfficientNet", 302, 16, shape_arg="input_shape",
                          stackwise_width_coefficients=[1.0, 1.0],
                          stackwise_depth_coefficients=[1.0, 1.0],
                          stackwise_kernel_sizes=[3, 3], stackwise_num_repeats=[1, 1],
                          stackwise_input_filters=[8, 8], stackwise_output_filters=[8, 16],
                          stackwise_expansion_ratios=[1, 2],
                          stackwise_squeeze_and_excite_ratios=[0.0, 0.25],
                          stackwise_strides=[1, 2], stackwise_block_types=["fused", "unfused"],
                          dropout=0.0, num_features=16),
        _image_classifier("MobileNet", 303, 32, task={"num_features": 16},
                          stackwise_expansion=[[16], [32]], stackwise_num_blocks=[1, 1],
                          stackwise_num_filters=[[8], [16]], stackwise_kernel_size=[[3], [3]],
                          stackwise_num_strides=[[2], [2]],
                          stackwise_se_ratio=[[None], [0.25]],
                          stackwise_activation=[["relu"], ["hard_swish"]],
                          stackwise_padding=[[1], [1]], output_num_filters=16,
                          depthwise_filters=8, depthwise_stride=2, depthwise_residual=False,
                          last_layer_filter=16, input_num_filters=8),
        _image_classifier("DenseNet", 304, 32, stackwise_num_repeats=[1, 1],
                          growth_rate=8),
        _image_classifier("VGG", 305, 16,
                          task={"pooling": "flatten", "pooling_hidden_dim": 16},
                          stackwise_num_repeats=[1, 1], stackwise_num_filters=[8, 16]),
        _image_classifier("ViT", 306, 16, patch_size=4, num_layers=2, num_heads=2,
                          hidden_dim=16, mlp_dim=32),
        _image_classifier("DeiT", 307, 16, patch_size=4, num_layers=2, num_heads=2,
                          hidden_dim=16, intermediate_dim=32),
        _image_classifier("SwinTransformer", 308, 32, embed_dim=16, depths=[1, 1],
                          num_heads=[2, 2], window_size=4, patch_size=4, mlp_ratio=2.0,
                          drop_path=0.0),
        _image_classifier("CSPNet", 309, 32, stem_filters=8, stem_kernel_size=3,
                          stem_strides=1, stackwise_depth=[1, 1], stackwise_strides=[1, 2],
                          stackwise_num_filters=[8, 16], block_type="dark_block",
                          stage_type="dark"),
        _image_classifier("Xception", 310, 32, stackwise_conv_filters=[[8, 16], [16, 16]],
                          stackwise_pooling=[True, False]),
        _image_classifier("MiT", 311, 32, layerwise_depths=[1, 1], num_layers=2,
                          layerwise_num_heads=[1, 2], layerwise_sr_ratios=[2, 1],
                          max_drop_path_rate=0.0, layerwise_patch_sizes=[7, 3],
                          layerwise_strides=[4, 2], hidden_dims=[8, 16]),
        _image_classifier("HGNetV2", 312, 32, depths=[1, 1], embedding_size=8,
                          hidden_sizes=[16, 32], stem_channels=[3, 8, 8], hidden_act="relu",
                          use_learnable_affine_block=False,
                          stackwise_stage_filters=[(8, 8, 16, 1, 1, 3), (16, 8, 32, 1, 1, 3)],
                          apply_downsample=[False, True],
                          use_lightweight_conv_block=[False, False]),
        # --- Seq2SeqLM ---
        _seq2seq_lm("T5", 401, num_heads=2, hidden_dim=16, intermediate_dim=32,
                    key_value_dim=8, dropout=0.0),
        _seq2seq_lm("Bart", 402, num_heads=2, hidden_dim=16, intermediate_dim=32, dropout=0.0,
                    max_sequence_length=SEQ),
    ]


def family(name: str) -> FamilySpec:
    """The spec of the family called `name` (case-insensitive)."""
    for spec in families():
        if spec.name.lower() == name.lower():
            return spec
    raise KeyError(f"no keras-hub family {name!r}; known: "
                   f"{', '.join(s.name for s in families())}")
