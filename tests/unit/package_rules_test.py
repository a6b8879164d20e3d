"""The layering of lingvo_lite, stated as rules over its packages and checked on every file.

Packages, lowest first: `core` (Params, NestedMap, the base layer), `layers`, `distributed`
(the cluster), `pipeline` (the GPipe runtime), `tasks` (what a registered model is), `keras`
(PipelinedModel), `analysis` (prediction and observation: simulator, memory model, planner,
traces) and `training` (the trainer). Imports read from each file's syntax tree, including
imports inside functions. And the tests' own layout: `tests/unit/<package>/` mirrors the
packages, `tests/e2e/` holds what starts a process or trains a registered model.
"""

from __future__ import annotations

import ast
import os
import unittest

import lingvo_lite

ROOT = os.path.dirname(lingvo_lite.__file__)
PACKAGES = ("core", "layers", "distributed", "pipeline", "tasks", "keras", "analysis", "training")
RUNTIME = ("core", "layers", "distributed", "pipeline", "tasks", "keras")


def _modules() -> dict[str, str]:
    """Module name -> path, for every Python file of the library."""
    modules = {}
    for directory, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(directory, name), os.path.dirname(ROOT))
                module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
                modules[module] = os.path.join(directory, name)
    return modules


MODULES = _modules()


def _imports(path: str) -> list[tuple[str, str | None]]:
    """(module, imported name or None) for every import in the file."""
    with open(path) as f:
        tree = ast.parse(f.read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.module, alias.name) for alias in node.names]
    return found


def _imported_modules(path: str) -> set[str]:
    """The lingvo_lite modules a file imports (`from package import module` counts as module)."""
    out = set()
    for module, name in _imports(path):
        if name and f"{module}.{name}" in MODULES:
            out.add(f"{module}.{name}")
        elif module in MODULES:
            out.add(module)
    return out


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in PACKAGES) else None


GRAPH = {m: _imported_modules(p) for m, p in MODULES.items()}


class PackageRulesTest(unittest.TestCase):

    def test_every_module_lives_in_a_package(self):
        top = [m for m in MODULES if m.count(".") == 1 and _package(m) is None]
        self.assertEqual([], top)

    def test_no_package_imports_a_package_above_it(self):
        upward = []
        for module, imported in GRAPH.items():
            own = _package(module)
            if own is None:  # lingvo_lite/__init__.py re-exports from every level.
                continue
            for other in imported:
                theirs = _package(other)
                if theirs and PACKAGES.index(theirs) > PACKAGES.index(own):
                    upward.append(f"{module} ({own}) imports {other} ({theirs})")
        self.assertEqual([], upward)

    def test_the_runtime_never_imports_analysis(self):
        offending = [f"{m} imports {o}" for m, imported in GRAPH.items()
                     if _package(m) in RUNTIME for o in imported if _package(o) == "analysis"]
        self.assertEqual([], offending)

    def test_nothing_imports_training(self):
        offending = [f"{m} imports {o}" for m, imported in GRAPH.items()
                     if _package(m) not in (None, "training")
                     for o in imported if _package(o) == "training"]
        self.assertEqual([], offending)

    def test_no_import_circle(self):
        # Package __init__s re-export lazily; they are not edges a module's import follows.
        edges = {m: {o for o in imported if not MODULES[o].endswith("__init__.py")}
                 for m, imported in GRAPH.items() if not MODULES[m].endswith("__init__.py")}
        circles = []
        state: dict[str, int] = {}

        def visit(module: str, stack: list[str]) -> None:
            state[module] = 1
            for other in sorted(edges.get(module, ())):
                if state.get(other) == 1:
                    circles.append(" -> ".join(stack[stack.index(other):] + [module, other]))
                elif other not in state:
                    visit(other, stack + [module])
            state[module] = 2

        for module in sorted(edges):
            if module not in state:
                visit(module, [])
        self.assertEqual([], circles)

    def test_no_private_name_is_used_from_another_module(self):
        private = []
        for path in MODULES.values():
            rel = os.path.relpath(path, ROOT)
            aliases = {}  # Local name -> the lingvo_lite module it is bound to.
            for module, name in _imports(path):
                if not module.startswith("lingvo_lite"):
                    continue
                if name and f"{module}.{name}" not in MODULES and name.startswith("_"):
                    private.append(f"{rel} imports {module}.{name}")
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    for alias in node.names:
                        if f"{node.module}.{alias.name}" in MODULES:
                            aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id in aliases and node.attr.startswith("_")
                        and not node.attr.startswith("__")):
                    private.append(f"{rel} uses {aliases[node.value.id]}.{node.attr}")
        self.assertEqual([], sorted(set(private)))


if __name__ == "__main__":
    unittest.main()


class TestLayoutTest(unittest.TestCase):

    def test_every_test_file_is_in_a_tier_and_unit_tests_mirror_the_packages(self):
        tests = os.path.join(os.path.dirname(ROOT), "tests")
        mirrors = set(PACKAGES) | {"models", "bench"}  # The repository's tasks/ and bench/.
        misplaced = []
        for directory, _, files in os.walk(tests):
            rel = os.path.relpath(directory, tests).split(os.sep)
            for name in files:
                if not name.endswith("_test.py"):
                    continue
                in_e2e = rel == ["e2e"]
                in_unit = rel[0] == "unit" and (len(rel) == 1 or (len(rel) == 2
                                                                  and rel[1] in mirrors))
                if not (in_e2e or in_unit):
                    misplaced.append(os.path.join(*rel, name))
        self.assertEqual([], misplaced)
