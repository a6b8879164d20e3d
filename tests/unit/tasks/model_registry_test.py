"""The model registry: names relative to the declared model packages, lookup and listing."""

from __future__ import annotations

import os
import sys
import tempfile
import textwrap
import unittest

from lingvo_lite.tasks import model_registry

MODEL_MODULE = textwrap.dedent('''
    from lingvo_lite.tasks import base_input_generator, base_task, model_registry


    @model_registry.register
    class {name}(model_registry.SplitInputModelParams):
        """{doc}"""

        SPLITS = ("train", "dev")

        def split_input(self, split):
            return base_input_generator.BaseInputGenerator.Params().Set(name=split)

        def Task(self):
            return base_task.BaseTask.Params().Set(name="{name}")
''')


class ModelRegistryTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        # A package `zoo_<pid>` on disk: zoo/small.py and zoo/deep/nested.py, imported by no one.
        cls.root = tempfile.mkdtemp()
        cls.package = f"zoo_{os.getpid()}"
        files = {
            "__init__.py": "",
            "small.py": MODEL_MODULE.format(name="Small", doc="A small model."),
            "deep/__init__.py": "",
            "deep/nested.py": MODEL_MODULE.format(name="Nested", doc="Nested one level down."),
        }
        for path, text in files.items():
            full = os.path.join(cls.root, cls.package, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w") as f:
                f.write(text)
        sys.path.insert(0, cls.root)
        model_registry.add_model_package(cls.package)

    @classmethod
    def tearDownClass(cls):
        sys.path.remove(cls.root)

    def test_declared_package_is_remembered_once(self):
        model_registry.add_model_package(self.package)
        self.assertEqual(1, model_registry.model_packages().count(self.package))

    def test_lookup_imports_the_declared_package_and_names_are_relative_to_it(self):
        cls = model_registry.get_class("small.Small")
        self.assertEqual(f"{self.package}.small", cls.__module__)
        self.assertEqual("A small model.", model_registry.list_models()["small.Small"])

    def test_nested_modules_keep_their_path_below_the_package(self):
        # pkgutil lists the package's top-level modules; a nested one registers once imported.
        __import__(f"{self.package}.deep.nested")
        self.assertIn("deep.nested.Nested", model_registry.list_models())

    def test_split_input_gives_the_declared_splits_only(self):
        model = model_registry.get_params("small.Small")
        self.assertEqual(["train", "dev"], [model.Input(s).name for s in ("train", "dev")])
        self.assertEqual("train", model.Model().input.name)
        with self.assertRaisesRegex(NotImplementedError, "Small has no Test split"):
            model.Test()
        with self.assertRaisesRegex(ValueError, "Unknown split 'eval'"):
            model.Input("eval")

    def test_unknown_name_suggests_close_ones(self):
        with self.assertRaisesRegex(KeyError, "Did you mean: small.Small"):
            model_registry.get_class("small.Smal")

    def test_registering_another_class_under_a_taken_name_is_an_error(self):
        model_registry.get_class("small.Small")

        class Small(model_registry.SingleTaskModelParams):
            pass

        Small.__module__ = f"{self.package}.small"
        Small.__qualname__ = "Other"
        with self.assertRaisesRegex(ValueError, "already registered"):
            model_registry.register(Small)


if __name__ == "__main__":
    unittest.main()
