"""Does the pipeline compute what the plain Keras model computes, on this batch?

`check_equivalence(pipelined, x, y)` takes one training step's loss and gradients both ways, the
pipelined ones (`PipelinedModel.loss_and_gradients`) and the plain model's own (Keras'
`compute_loss` under a tape, on the same variables; the plain call's state changes, e.g.
batch-norm statistics and dropout seeds, undone afterwards), and reports every weight whose
gradient differs by more than float32 sums in another order explain. Run it before training
with T > 1 on a model with layers that couple a batch's examples: batch norm (each
micro-batch normalised with its own moments, as GPipe does), or a custom layer that takes a
statistic over the batch (an expert capacity counted over the batch, a batch mean): such
layers compute per micro-batch, and this is how to see it.

Example:
    >>> import keras, numpy as np
    >>> from lingvo_lite.core import devices
    >>> from lingvo_lite.keras import PipelinedModel
    >>> _ = devices.configure_logical_cpus(2)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name='first'),
    ...                           keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    >>> pipelined = PipelinedModel(model, num_cells=2, num_micro_batches=2)
    >>> pipelined.compile(optimizer='sgd', loss='mse')
    >>> x, y = np.random.rand(8, 4).astype('float32'), np.random.rand(8, 2).astype('float32')
    >>> report = check_equivalence(pipelined, x, y)
    >>> report.equivalent, report.differing[0][0].endswith('first/kernel')
    (False, True)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["EquivalenceReport", "check_equivalence"]

# Float32 gradients summed over micro-batches in another order differ by a few units of
# roundoff of their scale (measured: below 1e-6 relative on every tested model).
RELATIVE_TOLERANCE = 1e-4
ABSOLUTE_TOLERANCE = 1e-6


@dataclasses.dataclass
class EquivalenceReport:
    """The pipelined step against the plain model's: loss difference and differing weights."""

    loss: float
    plain_loss: float
    # (variable path, max abs gradient difference, the plain gradient's max magnitude).
    differing: list[tuple[str, float, float]]
    num_variables: int

    @property
    def equivalent(self) -> bool:
        return not self.differing and abs(self.loss - self.plain_loss) <= ABSOLUTE_TOLERANCE + (
            RELATIVE_TOLERANCE * abs(self.plain_loss))

    def __str__(self) -> str:
        head = (f"loss {self.loss:.7g} (plain {self.plain_loss:.7g}); "
                f"{len(self.differing)} of {self.num_variables} gradients differ")
        rows = [f"  {path}: max abs diff {diff:.3g} (its scale {scale:.3g})"
                for path, diff, scale in self.differing]
        return "\n".join([head, *rows])


def check_equivalence(pipelined: Any, x: Any, y: Any, sample_weight: Any = None
                      ) -> EquivalenceReport:
    """One step's loss and gradients of a compiled `PipelinedModel` against its plain model.

    Nothing is trained; the plain call's state changes are undone.
    """
    plain = pipelined.plain
    got_loss, got = pipelined.loss_and_gradients(x, y, sample_weight)
    plain.compile(optimizer=pipelined.optimizer, **pipelined.plain_compile_settings)
    state = [v.numpy() for v in plain.non_trainable_variables]
    try:
        with tf.GradientTape() as tape:
            want_loss = plain.compute_loss(x=x, y=y, y_pred=plain(x, training=True),
                                           sample_weight=sample_weight)
        want = tape.gradient(want_loss, plain.trainable_variables)
    finally:
        for v, value in zip(plain.non_trainable_variables, state):
            v.assign(value)
    differing = []
    for v, g, w in zip(plain.trainable_variables, got, want):
        w = np.zeros(v.shape) if w is None else np.asarray(tf.convert_to_tensor(w))
        g = np.asarray(tf.convert_to_tensor(g))
        scale = float(np.abs(w).max(initial=0.0))
        diff = float(np.abs(g - w).max(initial=0.0))
        if diff > ABSOLUTE_TOLERANCE + RELATIVE_TOLERANCE * scale:
            differing.append((v.path, diff, scale))
    return EquivalenceReport(float(got_loss), float(want_loss), differing,
                             len(plain.trainable_variables))
