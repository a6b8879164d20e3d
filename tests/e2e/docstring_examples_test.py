"""The runnable examples in the public entry points' docstrings run and print what they say.

They run in a fresh interpreter, as a user's would: the pipeline example configures its own
logical devices before any TensorFlow op, and the registry example's model stays out of this
test session's registry.
"""

from __future__ import annotations

import doctest
import importlib
import json
import subprocess
import sys

import tensorflow as tf
from conftest import REPO

# module -> the objects whose docstrings must hold an example ('' is the module's own).
# In run order: the pipeline example first, before anything else runs a TensorFlow op.
ENTRY_POINTS = {
    "lingvo_lite.pipeline.pipelining_layer": ["PipeliningLayer"],
    "lingvo_lite": [""],
    "lingvo_lite.layers": [""],
    "lingvo_lite.pipeline": [""],
    "lingvo_lite.analysis": [""],
    "lingvo_lite.tasks.model_registry": ["", "SplitInputModelParams"],
    "lingvo_lite.training": [""],
    "lingvo_lite.training.runner": ["main"],
    "lingvo_lite.core.dotted_path": ["split"],
}

_RUNNER = """
import doctest, importlib, json, sys
results = {}
for name in json.loads(sys.argv[1]):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    results[name] = [result.attempted, result.failed]
print("RESULTS " + json.dumps(results))
"""


class DocstringExamplesTest(tf.test.TestCase):

    def test_each_entry_point_has_an_example(self):
        parser = doctest.DocTestParser()
        for module_name, objects in ENTRY_POINTS.items():
            module = importlib.import_module(module_name)
            for obj_name in objects:
                doc = (getattr(module, obj_name) if obj_name else module).__doc__ or ""
                self.assertNotEmpty(parser.get_examples(doc), f"{module_name} {obj_name}")

    def test_examples_run_in_a_fresh_interpreter(self):
        run = subprocess.run(
            [sys.executable, "-c", _RUNNER, json.dumps(list(ENTRY_POINTS))], cwd=REPO,
            capture_output=True, text=True, timeout=540,
            env={"PYTHONPATH": REPO, "PATH": "", "TF_CPP_MIN_LOG_LEVEL": "2"})
        self.assertEqual(0, run.returncode, run.stderr[-3000:])
        lines = [line for line in run.stdout.splitlines() if line.startswith("RESULTS ")]
        self.assertLen(lines, 1, run.stdout[-3000:])
        results = json.loads(lines[0][len("RESULTS "):])
        for name in ENTRY_POINTS:
            attempted, failed = results[name]
            self.assertGreater(attempted, 0, name)
            self.assertEqual(0, failed, f"{name}:\n{run.stdout[-6000:]}")


if __name__ == "__main__":
    tf.test.main()
