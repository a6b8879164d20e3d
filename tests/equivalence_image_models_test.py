"""check_equivalence passes on the second half of the registered image models (two (K, T) each).

See equivalence_models_test.py for how GPipe's ImageNet AmoebaNets are shrunk.
"""

from __future__ import annotations

import tensorflow as tf
from absl.testing import parameterized
from equivalence_models_test import CheckAllSettings, registered


class RegisteredImageModelsTest(tf.test.TestCase, parameterized.TestCase, CheckAllSettings):

    @parameterized.parameters(*registered("image.")[4:])
    def test_passes_at_two_settings(self, name: str) -> None:
        self.check_all_settings(name)
