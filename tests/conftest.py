"""Test-session setup that must run before TensorFlow executes any op.

Logical CPU devices and thread pools can only be configured before the runtime
initialises, so this runs at import time of the test session. Eight logical
devices let the pipeline tests place up to K=8 cells on distinct devices.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from lingvo_lite import devices  # noqa: E402

devices.configure_logical_cpus(8)

from lingvo_lite import model_registry  # noqa: E402

# As trainer.py does: the repository's registered models live in model_params/.
model_registry.add_model_package("model_params")

import tensorflow as tf  # noqa: E402

# tf.test.TestCase carries TF1's `test_session` context helper, which pytest would
# collect as a test and report as skipped.
tf.test.TestCase.test_session = None
