"""The README's fresh-machine commands are what CI runs and what the project provides."""

from __future__ import annotations

import os
import re
import unittest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def readme_commands() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return re.findall(r"```bash\n(.*?)\n```", f.read(), flags=re.S)[:2]


class ReadmeTest(unittest.TestCase):

    def test_ci_runs_the_readme_test_command_verbatim(self):
        main_command, test_command = readme_commands()
        self.assertIn("pytest", test_command)
        self.assertIn("trainer.py", main_command)
        with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
            ci = f.read()
        self.assertIn(test_command, ci)

    def test_main_command_names_a_registered_model(self):
        from lingvo_lite import model_registry

        main_command, _ = readme_commands()
        model = re.search(r"--model=(\S+)", main_command).group(1)
        self.assertIn(model, model_registry.list_models())

    def test_images_the_readme_shows_exist_and_are_small(self):
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", f.read())
        self.assertTrue(images)
        for path in images:
            full = os.path.join(ROOT, path)
            self.assertTrue(os.path.isfile(full), msg=path)
            self.assertLess(os.path.getsize(full), 300 * 1024, msg=path)
