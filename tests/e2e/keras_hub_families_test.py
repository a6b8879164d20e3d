"""Every keras-hub 0.32 task family (tests/keras_hub_families.py: one tiny model of each,
built from a config) pipelined by PipelinedModel at K=2 against the plain keras-hub model:
one step's loss and every gradient, or the one-line refusal. The status of each family is
the table in docs/keras_hub.md, which this test checks row by row.

No `input_shape` is given: the pipeline takes the shapes from the first batch, as Keras does.
Batch-norm models run at T=1 (at T>1 each micro-batch is normalised with its own moments, as
in GPipe); the others at T=2.
"""

from __future__ import annotations

import pathlib
import re

import pytest

keras_hub = pytest.importorskip("keras_hub")

from conftest import REPO, refusal  # noqa: E402
from keras_hub_families import families  # noqa: E402
from keras_steps import assert_step_matches  # noqa: E402

from lingvo_lite.keras import PipelinedModel  # noqa: E402

pytestmark = pytest.mark.slow  # Several seconds and more: scheduled first.

TABLE = pathlib.Path(REPO) / "docs" / "keras_hub.md"
EXACT = "exact at T=2"
EXACT_T1 = "exact at T=1 (batch norm: per micro-batch at T>1, as GPipe)"
REFUSED_AUX_LOSS = "refused: the router's load-balancing loss (add_loss over the whole batch)"


def documented_status() -> dict[str, str]:
    """Family -> status from the table in docs/keras_hub.md."""
    rows = re.findall(r"^\| `(\w+)` \| (\w+) \| (.+?) \|$", TABLE.read_text(), re.MULTILINE)
    return {name: status for name, _, status in rows}


def uses_batch_norm(model) -> bool:
    import keras
    return any(isinstance(layer, keras.layers.BatchNormalization)
               for layer in model._flatten_layers(include_self=False, recursive=True))


def test_the_table_lists_every_family_once():
    names = [spec.name for spec in families()]
    assert sorted(documented_status()) == sorted(names) and len(names) == 38


@pytest.mark.parametrize("spec", families(), ids=lambda spec: spec.name)
def test_family_trains_as_plain_keras_or_is_refused(spec):
    expected = documented_status()[spec.name]
    model = spec.build()  # The plain reference; the pipeline trains its own twin.
    batch_norm = uses_batch_norm(model)
    pipelined = PipelinedModel(spec.build(), num_cells=2,
                               num_micro_batches=1 if batch_norm else 2)
    x, y = spec.batch(8)
    if expected.startswith("refused"):  # When the first batch plans it (token ids of any length).
        pipelined.compile(optimizer="sgd", loss=spec.loss)
        message = refusal(lambda: pipelined.loss_and_gradients(x, y))
        assert "adds a loss in its call (add_loss)" in message
        assert expected == REFUSED_AUX_LOSS
        return
    # Gradients reach 10 in some families: within 2e-6 or 1e-6 of each one's scale.
    assert_step_matches(model, pipelined, x, y, relative=1e-6)
    assert expected == (EXACT_T1 if batch_norm else EXACT)
