"""Every command the README and the guide (docs/*.md) show runs as written in a fresh clone
(after the README's first command).

What is checked, per command (fenced `bash`/`sh` blocks, indented command blocks and inline
commands in backticks):
- it runs without activating anything: every program is `.venv/bin/...` (or the first
  command's `python3 -m venv`), never a bare `python`, `pip` or `tensorboard`;
- trainer.py commands name flags trainer.py defines and models that are registered; the other
  scripts exist and define the flags the pages pass them (`python -c` and `python -` take
  their code inline or from a here-document, whose lines are the program's input, not commands);
- the quick ones run verbatim (only /tmp logdirs moved into a temporary directory) and exit 0:
  list_models, inspect_params, inspect_model. What the trainer prints runs as printed: the
  command `--mode=plan` chooses (for a small model, 2 steps) and the `tensorboard` command.

Not run here, and why:
- the first command (a venv, `pip install` from PyPI and 400 training steps, about 2 minutes)
  and the second (the whole suite: this test is part of it). CI runs both as a fresh clone
  does (`.ci/run`); the first command's promise that a rerun re-evaluates is checked below on a
  tiny model;
- `--mode=plan` for AmoebaNetD_6_416 (10 s on an idle machine, 110 s with three other jobs on
  the 2 cores) and `--mode=check_equivalence` at K=4, T=4 (1-3 minutes): the plan mode runs
  above on a small model, check_equivalence in tests/e2e/equivalence_test.py;
- the trainings of AmoebaNetDigits, ResNetDigits and TransformerSmall (minutes each), the
  `--profile_steps` run and `tools/tensorboard_screenshot.py` (needs Chromium), and the
  benchmarks (`bench/*.py`: minutes to hours): their flags are checked;
- the mesh and two-process commands: `tests/e2e/multiprocess_test.py` runs them as written;
- the TPU command: needs a TPU;
- docs/export.md's blocks: `tests/e2e/export_test.py` runs them in order, as written.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import unittest

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow  # Several seconds and more: scheduled first.

ROOT = REPO
VENV = ".venv/bin/"


def pages() -> list[str]:
    """README.md and every page of the guide (docs/*.md), relative to the repository root."""
    docs = sorted(n for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    return ["README.md"] + [os.path.join("docs", n) for n in docs]


def page_text(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def _readme() -> str:
    return page_text("README.md")


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", _readme(), flags=re.S)[:2]


def _drop_heredocs(lines: list[str]) -> list[str]:
    """The lines of a shell block without here-document bodies (a program's input, not
    commands): `cmd <<'EOF'` keeps `cmd`, the lines up to `EOF` go."""
    out: list[str] = []
    end = None
    for line in lines:
        if end is not None:
            if line.strip() == end:
                end = None
            continue
        heredoc = re.search(r"<<-?\s*(['\"]?)(\w+)\1", line)
        if heredoc:
            end = heredoc.group(2)
            line = line[:heredoc.start()]
        out.append(line)
    return out


def _join_continuations(lines: list[str]) -> list[str]:
    out: list[str] = []
    pending = ""
    for line in _drop_heredocs(lines):
        line = line.strip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    return [c for c in out if c]


_PROGRAM = r"(?:\.venv/bin/|python3? |pip |tensorboard |bash |sh )"


def _split_fences(text: str) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(language, lines) of every fenced block, and the lines outside them."""
    blocks: list[tuple[str, list[str]]] = []
    outside: list[str] = []
    current: tuple[str, list[str]] | None = None
    for line in text.splitlines():
        fence = re.match(r"^\s*```(\w*)\s*$", line)
        if fence and current is None:
            current = (fence.group(1), [])
        elif fence:
            blocks.append(current)
            current = None
        elif current is not None:
            current[1].append(line)
        else:
            outside.append(line)
    return blocks, outside


def all_commands(text: str | None = None) -> list[str]:
    """Every shell command line of a page (continuations joined); without one, of README.md and
    every page of docs/."""
    if text is None:
        return [c for page in pages() for c in all_commands(page_text(page))]
    blocks, outside = _split_fences(text)
    commands: list[str] = []
    for lang, lines in blocks:
        if lang in ("bash", "sh"):
            commands += _join_continuations(lines)
    block: list[str] = []
    for line in outside + [""]:  # Indented (4 spaces) command blocks.
        if line.startswith("    ") and (block or re.match(r"    " + _PROGRAM, line)):
            block.append(line)
        elif block:
            commands += _join_continuations(block)
            block = []
    for span in re.findall(r"`([^`]+)`", "\n".join(outside)):
        span = " ".join(span.split())
        if re.match(_PROGRAM, span) and " " in span:
            commands.append(span)
    return commands


def _programs(command: str) -> list[list[str]]:
    """The simple commands of a line (split at &&, ||, ;, |, &), without leading assignments."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out: list[list[str]] = []
    words: list[str] = []
    for token in list(lexer) + [";"]:
        if token in ("&&", "||", ";", "|", "&"):
            while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                words = words[1:]
            if words:
                out.append(words)
            words = []
        else:
            words.append(token)
    return out


def _trainer_flags() -> set[str]:
    with open(os.path.join(ROOT, "trainer.py"), encoding="utf-8") as f:
        source = f.read()
    return set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", source)) | {"helpfull"}


def _script_flags(path: str) -> set[str]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return set(re.findall(r"add_argument\(\s*\"--(\w+)\"", f.read()))


def _flags(words: list[str]) -> list[str]:
    return [w[2:].split("=", 1)[0] for w in words if w.startswith("--")]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    return env


def _run(command: str, tmp: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs a README command as written: only .venv/bin/python -> this interpreter (the same
    program in a fresh clone's venv) and /tmp/... -> a temporary directory."""
    # /tmp first: the interpreter's own path may lie under /tmp (a clone there).
    script = re.sub(r"/tmp/", tmp.rstrip("/") + "/", command)
    script = script.replace(VENV + "python", shlex.quote(sys.executable))
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


class ReadmeTest(unittest.TestCase):

    def test_ci_runs_the_readme_test_command_verbatim(self):
        main_command, test_command = readme_commands()
        self.assertIn("pytest", test_command)
        self.assertIn("trainer.py", main_command)
        with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
            ci = f.read()
        self.assertIn(test_command, ci)

    def test_main_command_names_a_registered_model(self):
        from lingvo_lite.tasks import model_registry

        main_command, _ = readme_commands()
        model = re.search(r"--model=(\S+)", main_command).group(1)
        self.assertIn(model, model_registry.list_models())

    def test_images_the_pages_show_exist_and_are_small(self):
        shown = 0
        for page in pages():
            for path in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page_text(page)):
                full = os.path.join(ROOT, os.path.dirname(page), path)
                self.assertTrue(os.path.isfile(full), msg=f"{page}: {path}")
                self.assertLess(os.path.getsize(full), 300 * 1024, msg=f"{page}: {path}")
                shown += 1
        self.assertTrue(shown)

    def test_every_page_is_searched_for_commands(self):
        self.assertIn("README.md", pages())
        self.assertIn(os.path.join("docs", "export.md"), pages())
        # A here-document is a program's input, not commands.
        self.assertEqual([".venv/bin/python -", "echo done"],
                         all_commands("```bash\n.venv/bin/python - <<'EOF'\nimport os\nEOF\n"
                                      "echo done\n```\n"))

    def test_every_command_runs_without_activating_the_venv(self):
        commands = all_commands()
        self.assertGreater(len(commands), 20)
        for command in commands:
            for words in _programs(command):
                program = words[0]
                ok = (program.startswith(VENV) or program == "wait"
                      or words[:3] == ["python3", "-m", "venv"])
                self.assertTrue(ok, msg=f"{program!r} needs an activated venv: {command}")
                if program.startswith(VENV):
                    self.assertTrue(os.path.exists(os.path.join(ROOT, program))
                                    or not os.path.isdir(os.path.join(ROOT, ".venv")),
                                    msg=f"{program} is not installed: {command}")

    def test_every_command_names_existing_flags_scripts_and_models(self):
        from lingvo_lite.tasks import model_registry

        trainer_flags = _trainer_flags()
        models = set(model_registry.list_models())
        checked = 0
        for command in all_commands():
            for words in _programs(command):
                # -m: a module; -c and -: code given inline or on stdin (a here-document).
                if not words[0].endswith("python") or len(words) < 2 or words[1] in ("-m", "-c",
                                                                                     "-"):
                    continue
                script = words[1]
                self.assertTrue(os.path.isfile(os.path.join(ROOT, script)), msg=command)
                known = (trainer_flags if script == "trainer.py" else _script_flags(script))
                for flag in _flags(words):
                    self.assertIn(flag, known, msg=f"--{flag} is not a flag of {script}: "
                                                   f"{command}")
                for word in words:
                    if word.startswith("--model=") and script == "trainer.py":
                        self.assertIn(word.split("=", 1)[1], models, msg=command)
                checked += 1
        self.assertGreater(checked, 15)

    def test_quick_commands_run_as_written(self):
        quick = [c for c in all_commands()
                 if "trainer.py" in c and "TF_CONFIG" not in c
                 and re.search(r"--mode=(list_models|inspect_params|inspect_model)", c)]
        modes = {re.search(r"--mode=(\w+)", c).group(1) for c in quick}
        self.assertEqual({"list_models", "inspect_params", "inspect_model"}, modes)
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
        for command in quick:
            proc = _run(command, tmp)
            self.assertEqual(0, proc.returncode, msg=f"{command}\n{proc.stderr[-3000:]}")
            self.assertNotIn("Traceback", proc.stdout + proc.stderr, msg=command)
        # Overrides the README shows apply to their model (checked without training).
        for command in all_commands():
            for words in _programs(command):
                overrides = [w for w in words if w.startswith("--model_params_override=")]
                models = [w for w in words if w.startswith("--model=")]
                if words[1:2] == ["trainer.py"] and overrides and models:
                    proc = subprocess.run(
                        [sys.executable, "trainer.py", *models, *overrides,
                         "--mode=inspect_params"], cwd=ROOT, env=_env(), capture_output=True,
                        text=True, timeout=600)
                    self.assertEqual(0, proc.returncode, msg=f"{command}\n{proc.stderr}")


class PrintedCommandsTest(unittest.TestCase):
    """What the trainer tells the user to run, run as printed; a rerun re-evaluates."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

    def _trainer(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "trainer.py", *args], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=600)

    def test_plan_command_and_tensorboard_command_run_as_printed(self):
        plan = self._trainer("--mode=plan", "--model=tests.testdata_models.TinyMlp",
                             "--plan_devices=2", "--plan_memory_per_device=1GiB")
        self.assertEqual(0, plan.returncode, msg=plan.stderr[-3000:])
        printed = plan.stdout.split("Run the chosen plan with:\n", 1)[1].splitlines()[0].strip()
        self.assertTrue(printed.startswith(
            os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT)
            else sys.executable), msg=printed)
        # As printed, but in a temporary logdir and for 2 steps instead of the model's 400.
        logdir = re.search(r"--logdir=(\S+)", printed).group(1)
        command = printed.replace(f"--logdir={logdir}", f"--logdir={self.tmp}/plan") + \
            " --max_steps=2"
        run = subprocess.run(["bash", "-c", command], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=600)
        self.assertEqual(0, run.returncode, msg=run.stdout[-2000:] + run.stderr[-3000:])
        self.assertIn("Done: global step 2", run.stdout)
        watch = re.search(r"^Watch it with: (.*)$", run.stdout, flags=re.M).group(1)
        self.assertTrue(watch.startswith(os.path.join(os.path.dirname(printed.split()[0]),
                                                      "tensorboard ")), msg=watch)
        inspect = subprocess.run(["bash", "-c", watch + " --inspect"], cwd=ROOT, env=_env(),
                                 capture_output=True, text=True, timeout=300)
        self.assertEqual(0, inspect.returncode, msg=inspect.stderr[-3000:])
        self.assertIn("loss", inspect.stdout + inspect.stderr)

    def test_rerunning_a_finished_train_and_eval_evaluates_again(self):
        args = ["--model=tests.testdata_models.TinyMlp", f"--logdir={self.tmp}/run",
                "--mode=train_and_eval", "--eval_splits=dev,test", "--max_steps=2"]
        first = self._trainer(*args)
        self.assertEqual(0, first.returncode, msg=first.stderr[-3000:])
        again = self._trainer(*args)
        self.assertEqual(0, again.returncode, msg=again.stderr[-3000:])
        self.assertIn("Already at global step 2 >= max_steps=2", again.stdout)
        self.assertIn("eval dev @ step 2", again.stdout)
        self.assertIn("eval test @ step 2", again.stdout)


if __name__ == "__main__":
    unittest.main()
