"""keras-hub ResNetImageClassifier (batch norm, skip connections across the cut) and
ViTImageClassifier (its ViTPatchingAndEmbedding's config carries derived entries its
constructor refuses: rebuilt without them, checked by layer_config), built from a config,
pipelined by PipelinedModel against the plain keras-hub model with the same weights.

Needs the `keras-hub` extra; the import guard only keeps the rest of the suite running
where it is missing.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

from keras_steps import LOSS, assert_step_matches  # noqa: E402

from lingvo_lite.keras import PipelinedModel  # noqa: E402

pytestmark = pytest.mark.slow  # Several seconds and more: scheduled first.


def resnet_classifier() -> keras.Model:
    keras.utils.set_random_seed(12)
    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 16],
        stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block",
        use_pre_activation=True, image_shape=(16, 16, 3))
    return keras_hub.models.ResNetImageClassifier(backbone=backbone, num_classes=3,
                                                  preprocessor=None)


def test_resnet_classifier_step_matches_plain():
    # Batch norm: exact at T=1 (with T>1 each micro-batch is normalised with its own
    # moments, as in GPipe).
    model = resnet_classifier()  # The plain reference; the pipeline trains its own twin.
    pipelined = PipelinedModel(resnet_classifier(), num_cells=2, num_micro_batches=1)
    x = np.random.default_rng(3).normal(size=(8, 16, 16, 3)).astype("float32")
    assert_step_matches(model, pipelined, x, np.arange(8) % 3)
    assert "pool1_pool" in pipelined.partition_report(8)  # A skip connection across the cut.


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_resnet_classifier_fit_matches_plain(optimizer):
    model = resnet_classifier()  # The plain reference; the pipeline trains its own twin.
    pipelined = PipelinedModel(resnet_classifier(), num_cells=2, num_micro_batches=1)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 3, 16).astype("int32")
    model.compile(optimizer=optimizer, loss=LOSS)
    pipelined.compile(optimizer=optimizer, loss=LOSS)
    pipelined.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(pipelined.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=5e-5)


def vit_classifier() -> keras.Model:
    """ViT: patching and embedding, then every transformer block inside one ViTEncoder
    layer (an opaque node), a class-token slice and the head."""
    keras.utils.set_random_seed(13)
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(16, 16, 3), patch_size=4, num_layers=2, num_heads=2, hidden_dim=16,
        mlp_dim=32)
    return keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=3,
                                               preprocessor=None)


@pytest.mark.parametrize("num_micro_batches", [1, 4])
def test_vit_classifier_step_matches_plain(num_micro_batches):
    model = vit_classifier()  # The plain reference; the pipeline trains its own twin.
    pipelined = PipelinedModel(vit_classifier(), num_cells=2, num_micro_batches=num_micro_batches)
    pipe = pipelined.pipeline
    assert pipe.num_cells == 2
    assert pipe.partition.cell_of_layer(len(pipe.layers) - 3) == 1
    x = np.random.default_rng(4).normal(size=(8, 16, 16, 3)).astype("float32")
    assert_step_matches(model, pipelined, x, np.arange(8) % 3)


def deit_classifier() -> keras.Model:
    """DeiT: keras-hub 0.32's DeiTEncoder.get_config() reads an attribute it never set."""
    keras.utils.set_random_seed(14)
    backbone = keras_hub.models.DeiTBackbone(
        image_shape=(16, 16, 3), patch_size=4, num_layers=1, num_heads=2, hidden_dim=8,
        intermediate_dim=16)
    return keras_hub.models.DeiTImageClassifier(backbone=backbone, num_classes=3,
                                                preprocessor=None)


def test_layer_without_a_working_config_runs_as_the_users_object():
    # The pipeline runs the model's own layer objects: no config round trip is needed.
    model = deit_classifier()
    pipelined = PipelinedModel(deit_classifier(), num_cells=2, num_micro_batches=2)
    x = np.random.default_rng(4).normal(size=(8, 16, 16, 3)).astype("float32")
    # Its gradients reach 10 (the class token's): 8 float32 eps of that scale (oneDNN off,
    # measured 4.6e-7 of it there).
    assert_step_matches(model, pipelined, x, np.arange(8) % 3, relative=1e-6)
    # Overriding its settings needs the config: refused in one line.
    encoder = next(p for p in pipelined.pipeline.params.layers if p.name.endswith("encoder"))
    overridden = encoder.Copy()
    overridden.keras_layer = dict(encoder.keras_layer, config={"name": "renamed"})
    with pytest.raises(ValueError) as raised:
        overridden.Instantiate()
    message = str(raised.value)
    assert "\n" not in message, message
    assert message.startswith("PipelinedModel: Keras layer 'deit_encoder' (DeiTEncoder) cannot "
                              "be serialized: get_config() raised"), message
