"""Every Python block of the README and the guide (docs/*.md) runs as written in a fresh
interpreter from the repository root (their shell commands: readme_test.py)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow  # A TensorFlow start per block.

ROOT = pathlib.Path(REPO)


def python_blocks() -> list[tuple[str, str]]:
    blocks = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, code in enumerate(re.findall(r"```python\n(.*?)\n```", page.read_text(), re.S)):
            blocks.append((f"{page.relative_to(ROOT)}#{i}", code))
    return blocks


@pytest.mark.parametrize("name,code", python_blocks(), ids=[n for n, _ in python_blocks()])
def test_python_block_runs(name, code):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
