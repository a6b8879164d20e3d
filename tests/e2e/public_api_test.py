"""The declared public surface: every module's `__all__`, the packages' re-exports, cheap imports.

`lingvo_lite`, `lingvo_lite.layers`, `lingvo_lite.pipeline` and `lingvo_lite.training`
re-export their public names lazily (imported on first use); `lingvo_lite.keras` imports Keras
when imported. Every module declares `__all__` (`[]` for internal modules).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import subprocess
import sys
import types

import tensorflow as tf
from conftest import REPO

import lingvo_lite
import model_params
import tasks

PACKAGES = ("lingvo_lite", "lingvo_lite.core", "lingvo_lite.layers", "lingvo_lite.distributed",
            "lingvo_lite.pipeline", "lingvo_lite.pipeline.schedules",
            "lingvo_lite.pipeline.partition", "lingvo_lite.tasks", "lingvo_lite.analysis",
            "lingvo_lite.keras", "lingvo_lite.training")


def _all_modules() -> list[types.ModuleType]:
    modules = [importlib.import_module("trainer")]
    for package in (lingvo_lite, tasks, model_params):
        modules.append(package)
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            modules.append(importlib.import_module(info.name))
    return modules


class PublicApiTest(tf.test.TestCase):

    def test_every_module_declares_all_and_every_declared_name_exists(self):
        modules = _all_modules()
        self.assertGreater(len(modules), 80)
        missing = []
        for module in modules:
            if not hasattr(module, "__all__"):
                missing.append(module.__name__)
                continue
            self.assertIsInstance(module.__all__, list, module.__name__)
            self.assertLen(set(module.__all__), len(module.__all__), module.__name__)
            for name in module.__all__:
                self.assertIsInstance(name, str)
                self.assertFalse(name.startswith("_"), f"{module.__name__}.{name}")
                self.assertTrue(hasattr(module, name), f"{module.__name__}.{name}")
        self.assertEqual([], missing)

    def test_star_import_gives_exactly_the_declared_surface(self):
        for package in PACKAGES:
            namespace: dict = {}
            exec(f"from {package} import *", namespace)
            exported = {k for k in namespace if k != "__builtins__"}
            self.assertEqual(set(importlib.import_module(package).__all__), exported, package)

    def test_reexports_are_the_defining_modules_objects(self):
        for package_name in PACKAGES:
            package = importlib.import_module(package_name)
            for name in package.__all__:
                value = getattr(package, name)
                if isinstance(value, types.ModuleType):
                    self.assertTrue(value.__name__.startswith(package_name + "."), name)
                    self.assertEqual(name, value.__name__.rsplit(".", 1)[-1])
                    continue
                # Lazy packages name the defining module; classes and functions know theirs.
                home_name = getattr(package, "_EXPORTS", {}).get(name) or value.__module__
                home = importlib.import_module(home_name)
                self.assertIs(value, getattr(home, name), f"{package_name}.{name}")
                self.assertTrue(home_name.startswith(package_name + "."),
                                f"{package_name}.{name} comes from {home_name}")
                self.assertIn(name, home.__all__, f"{home.__name__}.__all__ lacks {name}")

    def test_the_readme_tour_surface(self):
        from lingvo_lite.keras import pipelined_model
        from lingvo_lite.pipeline import pipelining_layer

        self.assertIs(lingvo_lite.PipeliningLayer, pipelining_layer.PipeliningLayer)
        self.assertIs(lingvo_lite.pipeline.PipeliningLayer, pipelining_layer.PipeliningLayer)
        self.assertIs(lingvo_lite.PipelinedModel, pipelined_model.PipelinedModel)
        for name in ("Params", "NestedMap", "BaseLayer", "PipelinedTask", "SingleTaskModelParams",
                     "fprop_context", "model_registry", "devices"):
            self.assertIn(name, lingvo_lite.__all__)
        for name in ("ProjectionLayer", "FieldLayer", "FieldsLayer", "SoftmaxCrossEntropyLayer"):
            self.assertIn(name, lingvo_lite.layers.__all__)
        self.assertIn("fprop_context", dir(lingvo_lite))
        with self.assertRaisesRegex(AttributeError, "has no attribute 'NoSuchName'"):
            getattr(lingvo_lite, "NoSuchName")

    def test_the_guides_list_of_the_surface_is_the_code(self):
        with open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8") as f:
            text = f.read()
        listed = {package: re.findall(r"`(\w+)`", names) for package, names in re.findall(
            r"^- `(lingvo_lite[\w.]*)`: (.*?);$", text, flags=re.M | re.S)}
        self.assertEqual(sorted(PACKAGES), sorted(listed))
        for package, names in listed.items():
            self.assertEqual(importlib.import_module(package).__all__, names, package)

    def test_importing_the_packages_loads_no_tensorflow(self):
        # trainer.py checks its flags before TensorFlow loads; the re-exports must not load it.
        code = ("import sys, lingvo_lite, lingvo_lite.layers, lingvo_lite.pipeline, "
                "lingvo_lite.analysis, lingvo_lite.distributed, "
                "lingvo_lite.distributed.cluster_spec, lingvo_lite.training, "
                "lingvo_lite.training.options, lingvo_lite.tasks.model_registry\n"
                "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))")
        run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                             text=True, timeout=120, env={"PYTHONPATH": REPO, "PATH": ""})
        self.assertEqual(0, run.returncode, run.stderr)
        self.assertEqual("[]", run.stdout.strip())


if __name__ == "__main__":
    tf.test.main()
