"""A trained PipelinedModel, out: `save` writes a `.keras` file that plain Keras loads in a
process where lingvo-lite cannot be imported, `export` a SavedModel that TensorFlow alone
serves, and `PipelinedModel.load_model` resumes training from the file (optimizer state
included) to the weights of an uninterrupted plain Keras run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from lingvo_lite.keras import PipelinedModel

TOL = 2e-5

# Run in a fresh interpreter where the project's packages cannot be imported.
WITHOUT_LINGVO_LITE = """
import sys
sys.modules.update({name: None for name in ("lingvo_lite", "tasks", "model_params")})
try:
    import lingvo_lite  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("lingvo_lite is importable")
import numpy as np
"""


def run_without_lingvo_lite(code: str, tmp_path) -> None:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", WITHOUT_LINGVO_LITE + textwrap.dedent(code)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def functional_model() -> keras.Model:
    keras.utils.set_random_seed(51)
    inp = keras.Input((6,), name="features")
    h = keras.layers.Dense(16, activation="tanh", name="h1")(inp)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.Dense(16, activation="tanh", name="h2")(h)
    skip = keras.layers.Dense(16, name="skip")(inp)
    return keras.Model(inp, keras.layers.Dense(3, name="out")(keras.layers.Add()([h, skip])))


def layer_stack() -> list[keras.layers.Layer]:
    keras.utils.set_random_seed(52)
    return [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]


def data(n: int = 16):
    rng = np.random.default_rng(12)
    return rng.normal(size=(n, 6)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def pipelined_of(kind: str) -> PipelinedModel:
    if kind == "functional":
        return PipelinedModel(functional_model(), num_cells=2, num_micro_batches=2)
    return PipelinedModel(layer_stack(), input_shape=(6,), num_cells=2, num_micro_batches=2)


def plain_of(kind: str) -> keras.Model:
    if kind == "functional":
        return functional_model()
    return keras.Sequential([keras.Input((6,)), *layer_stack()])


def trained(kind: str, optimizer: str, tmp_path) -> tuple[PipelinedModel, np.ndarray, np.ndarray]:
    """A pipelined model after one epoch, its data, and the inputs saved for a subprocess."""
    x, y = data()
    pipelined = pipelined_of(kind)
    pipelined.compile(optimizer=optimizer, loss="mse")
    pipelined.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    np.save(tmp_path / "x.npy", x)
    return pipelined, x, y


@pytest.mark.parametrize("kind", ["functional", "stack"])
def test_saved_file_loads_in_plain_keras_and_resumes_training(kind, tmp_path):
    pipelined, x, y = trained(kind, "adam", tmp_path)
    path = str(tmp_path / "trained.keras")
    pipelined.save(path)
    run_without_lingvo_lite(f"""
        import keras
        model = keras.saving.load_model({path!r})
        np.save("predicted.npy", model.predict(np.load("x.npy"), verbose=0))
        """, tmp_path)
    np.testing.assert_allclose(np.load(tmp_path / "predicted.npy"),
                               pipelined.predict(x, verbose=0), atol=1e-5)
    # Resumed from the file, Adam's moments and step count included: the weights of one
    # uninterrupted plain run of both epochs.
    resumed = PipelinedModel.load_model(path, num_cells=2, num_micro_batches=2)
    resumed.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    plain = plain_of(kind)
    plain.compile(optimizer="adam", loss="mse")
    plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(resumed.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=TOL)


@pytest.mark.parametrize("kind", ["functional", "stack"])
def test_exported_saved_model_serves_without_lingvo_lite(kind, tmp_path):
    pipelined, x, _ = trained(kind, "sgd", tmp_path)
    pipelined.export(str(tmp_path / "served"), verbose=False)
    run_without_lingvo_lite("""
        import tensorflow as tf
        served = tf.saved_model.load("served")
        out = served.signatures["serving_default"](tf.constant(np.load("x.npy")))
        np.save("served.npy", next(iter(out.values())).numpy())
        """, tmp_path)
    np.testing.assert_allclose(np.load(tmp_path / "served.npy"),
                               pipelined.predict(x, verbose=0), atol=1e-5)
