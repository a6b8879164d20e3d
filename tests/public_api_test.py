"""The declared public surface: every module's `__all__`, the packages' re-exports, cheap imports.

`lingvo_lite`, `lingvo_lite.layers`, `lingvo_lite.pipeline` and `lingvo_lite.training`
re-export their public names lazily (imported on first use); `lingvo_lite.keras` imports Keras
when imported. Every module declares `__all__` (`[]` for internal modules).
"""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import subprocess
import sys
import types
import unittest

import tensorflow as tf
from conftest import REPO

import lingvo_lite
import model_params
import tasks

PACKAGES = ("lingvo_lite", "lingvo_lite.layers", "lingvo_lite.distributed", "lingvo_lite.pipeline",
            "lingvo_lite.analysis",
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
                    self.assertEqual(f"{package_name}.{name}", value.__name__)
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

    def test_importing_the_packages_loads_no_tensorflow(self):
        # trainer.py checks its flags before TensorFlow loads; the re-exports must not load it.
        code = ("import sys, lingvo_lite, lingvo_lite.layers, lingvo_lite.pipeline, "
                "lingvo_lite.analysis, lingvo_lite.distributed, "
                "lingvo_lite.distributed.cluster_spec, lingvo_lite.training, "
                "lingvo_lite.training.options, lingvo_lite.model_registry\n"
                "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))")
        run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                             text=True, timeout=120, env={"PYTHONPATH": REPO, "PATH": ""})
        self.assertEqual(0, run.returncode, run.stderr)
        self.assertEqual("[]", run.stdout.strip())


if __name__ == "__main__":
    tf.test.main()


# The layout in docs/architecture.md: each module of the library and the level it belongs to.
_LEVELS = ("params", "layers", "distributed", "pipeline", "tasks", "analysis", "trainer")
_LEVEL_OF_MODULE = {
    "hyperparams": "params", "nested_map": "params", "dotted_path": "params", "_lazy": "params",
    "progress": "params",
    "base_layer": "layers", "layer_memory": "layers", "weight_params": "layers",
    "fprop_context": "layers",
    "devices": "layers", "colocation": "layers", "layers": "layers",
    "distributed": "distributed", "pipeline": "pipeline", "analysis": "analysis",
    "base_task": "tasks", "pipelined_task": "tasks", "base_input_generator": "tasks",
    "optimizers": "tasks", "sharded_optimizer": "tasks", "learning_rate": "tasks",
    "warm_start": "tasks", "inference": "tasks",
    "model_registry": "tasks", "keras": "tasks",
    "training": "trainer",
}


def _level(module_name: str) -> str | None:
    parts = module_name.split(".")
    if parts[0] != "lingvo_lite" or len(parts) < 2:
        return None
    return _LEVEL_OF_MODULE[parts[1]]


def _imported_names(path: str) -> list[str]:
    """Every module (and `module.name`) a file imports, read from its syntax tree."""
    with open(path) as f:
        tree = ast.parse(f.read())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def _library_files(skip_init: bool = False) -> list[tuple[str, str]]:
    """(path, path relative to lingvo_lite/) of every Python file of the library."""
    root = os.path.dirname(lingvo_lite.__file__)
    return [(os.path.join(d, n), os.path.relpath(os.path.join(d, n), root))
            for d, _, files in os.walk(root) for n in files
            if n.endswith(".py") and not (skip_init and n == "__init__.py")]


class LayeringTest(unittest.TestCase):

    def test_no_module_imports_from_a_level_above_its_own(self):
        upward = []
        # Package __init__s only name their exports (lazily).
        for path, rel in _library_files(skip_init=True):
            module = "lingvo_lite." + rel[:-3].replace(os.sep, ".")
            own = _LEVELS.index(_level(module))
            for imported in _imported_names(path):
                level = _level(imported)
                if level is not None and _LEVELS.index(level) > own:
                    upward.append(f"{module} ({_LEVELS[own]}) imports {imported} ({level})")
        self.assertEqual([], upward)

    def test_the_runtime_never_imports_analysis(self):
        # Two houses: what a training step needs, and prediction/observation on top of it.
        offending = [rel for path, rel in _library_files()
                     if rel.split(os.sep)[0] not in ("analysis", "training")
                     and any(n.startswith("lingvo_lite.analysis")
                             for n in _imported_names(path))]
        self.assertEqual([], offending)
