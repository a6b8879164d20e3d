"""One training step of a pipelined Keras model checked against the plain model: the loss and
every gradient (the keras-hub tests' check)."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from lingvo_lite.keras import PipelinedModel

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def assert_step_matches(model: keras.Model, pipelined: PipelinedModel, x, y,
                        relative: float = 0.0) -> float:
    """The pipelined loss and every gradient equal the plain model's; the max gradient diff.

    Each gradient within 2e-6, or within `relative` of its own largest element where that is
    more (gradients of a scale where 2e-6 is below float32's rounding of sums taken in
    another order).
    """
    model.compile(optimizer="sgd", loss=LOSS)
    pipelined.compile(optimizer="sgd", loss=LOSS)
    with tf.GradientTape() as tape:
        want_loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
    want = tape.gradient(want_loss, model.trainable_variables)
    got_loss, got = pipelined.loss_and_gradients(x, y)
    assert abs(float(got_loss) - float(want_loss)) < 1e-5
    assert len(got) == len(want) == len(model.trainable_variables)
    worst = 0.0
    for v, g, w in zip(model.trainable_variables, got, want):
        g, w = np.asarray(g), np.asarray(tf.convert_to_tensor(w))  # Embeddings: IndexedSlices.
        np.testing.assert_allclose(
            g, w, atol=max(2e-6, relative * float(np.abs(w).max(initial=0.0))), err_msg=v.path)
        worst = max(worst, float(np.abs(g - w).max()))
    return worst
