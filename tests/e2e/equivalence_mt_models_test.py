"""check_equivalence passes on every registered translation model at two (K, T) settings
(TransformerSmallBuckets, TransformerSmall's network on bucketed batches, at the first).

See equivalence_models_test.py for how GPipe's T(L, H, A) models are shrunk.
"""

from __future__ import annotations

import pytest
import tensorflow as tf
from absl.testing import parameterized
from equivalence_models_test import SETTINGS, CheckAllSettings, distinct_registered

pytestmark = pytest.mark.slow  # Several seconds and more: scheduled first.


class RegisteredMtModelsTest(tf.test.TestCase, parameterized.TestCase, CheckAllSettings):

    @parameterized.parameters(*distinct_registered("mt."))
    def test_passes_at_two_settings(self, name: str, same_as: tuple[str, ...]) -> None:
        if name == "mt.TransformerSmallBuckets":
            # TransformerSmall's network (checked at both settings) on one bucket's batch
            # shape: the first setting checks the shape.
            self.check_all_settings(name, same_as, SETTINGS[:1])
        else:
            self.check_all_settings(name, same_as)
