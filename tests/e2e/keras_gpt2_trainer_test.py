"""The registered keras-hub GPT-2 (model_params/keras_gpt2.py) through trainer.py's runner.

One step of the task (K=2, T=2) against the plain keras-hub GPT2CausalLM with the same
weights on the same batch (Keras' own loss and gradients under a tape); then a few
training steps that lower the loss, an evaluation, a checkpoint and a resume.

Needs the `keras-hub` extra; the import guard only keeps the rest of the suite running
where it is missing.
"""

from __future__ import annotations

import glob
import io
import os
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

keras_hub = pytest.importorskip("keras_hub")

from lingvo_lite.core import fprop_context  # noqa: E402
from lingvo_lite.core.nested_map import NestedMap  # noqa: E402
from lingvo_lite.keras import functional  # noqa: E402
from lingvo_lite.keras.graph_layer import GraphNodeLayer  # noqa: E402
from lingvo_lite.tasks import model_registry  # noqa: E402
from lingvo_lite.training import options, runner  # noqa: E402
from model_params import keras_gpt2  # noqa: E402
from tasks.text import char_lm_input  # noqa: E402

pytestmark = pytest.mark.slow  # Several seconds and more: scheduled first.

MODEL = "keras_gpt2.GPT2CharLM"


def _main(**kwargs) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = runner.main(options.RunOptions(**kwargs), out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def _scalars(directory: str, tag: str) -> dict[int, float]:
    values = {}
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for v in event.summary.value:
                if v.tag == tag:
                    values[event.step] = float(tf.make_ndarray(v.tensor))
    return values


def test_task_step_matches_plain_keras():
    params = model_registry.get_params(MODEL)
    task = params.Model().Instantiate()
    batch = NestedMap(next(iter(params.Train().Instantiate().dataset())))
    with fprop_context.fprop_context(training=True):
        out, grads = task.ComputeLossAndGrads(task.theta, batch)
    # The plain model with the task's weights: node by node, in the traced order.
    model = keras_gpt2.gpt2_causal_lm(len(char_lm_input.vocabulary()), params.SEQ_LEN)
    plan = functional.trace_model(model, params.network_inputs())
    pipe = task.network
    position = {id(leaf): i for i, leaf in enumerate(task.theta.network.Flatten())}
    flat_grads = grads.network.Flatten()
    pairs = {}
    for node, layer in zip(plan.nodes, pipe.layers):
        if isinstance(layer, GraphNodeLayer):
            for plain_var, var in zip(node.layer.variables, layer.keras_layer.variables):
                plain_var.assign(var.value)
                pairs[id(plain_var)] = var.value
    x = {"token_ids": batch.token_ids, "padding_mask": batch.padding_mask}
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with tf.GradientTape() as tape:
        want_loss = model.compute_loss(x=x, y=batch.label, y_pred=model(x, training=True))
    want = tape.gradient(want_loss, model.trainable_variables)
    np.testing.assert_allclose(float(out.loss), float(want_loss), rtol=1e-5)
    assert len(pairs) == len(model.variables)
    assert len(want) == len(flat_grads)
    for v, w in zip(model.trainable_variables, want):
        got = flat_grads[position[id(pairs[id(v)])]]
        np.testing.assert_allclose(got, tf.convert_to_tensor(w), atol=1e-5, err_msg=v.path)


def test_trains_evaluates_and_resumes():
    logdir = tempfile.mkdtemp()
    status, out, err = _main(model=MODEL, logdir=logdir, mode="train_and_eval", max_steps=20,
                             eval_splits=("dev",),
                             model_params_override="train.summary_interval_steps : 1")
    assert status == 0, err
    assert "eval dev @ step 20" in out
    losses = _scalars(os.path.join(logdir, "train"), "loss")
    first = np.mean([losses[s] for s in (1, 2, 3)])
    last = np.mean([losses[s] for s in (18, 19, 20)])
    assert first > 3.3 and last < first - 0.4, (first, last)  # ln(36) = 3.58 at the start.
    assert 20 in _scalars(os.path.join(logdir, "eval_dev"), "loss")
    status, out, err = _main(model=MODEL, logdir=logdir, mode="train", max_steps=22)
    assert status == 0, err
    assert "Resuming training from step 20 to step 22." in out


def test_lm_head_is_costed_as_a_matmul():
    from lingvo_lite.layers.composite import chain_meta

    params = model_registry.get_params(MODEL)
    p = params.Task().network
    metas = chain_meta(p.layers, p.input_shapes)
    head = next(i for i, layer in enumerate(p.layers) if layer.name.endswith("token_embedding_1"))
    vocab, hidden = len(char_lm_input.vocabulary()), 64
    assert metas[head].flops == 2 * params.BATCH_SIZE * params.SEQ_LEN * hidden * vocab
