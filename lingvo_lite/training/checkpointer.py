"""Checkpoints of a task (weights, optimizer slots, global step) and of its input position.

A checkpoint is a `tf.train.Checkpoint` with two entries:
  - `model`: the task's `checkpoint_variables()` dict (keys independent of the partition, so a
    run may resume with another `num_cells`);
  - `iterator`: the training `tf.data` iterator, so a resumed run continues with the batch after
    the last one trained on (training only; evaluation restores `model` alone).
They live in `<logdir>/checkpoints/ckpt-<global step>`, managed by `tf.train.CheckpointManager`.

Integrity. TensorFlow writes a checkpoint's data into a temporary directory (`ckpt-N_temp/`),
moves it into place and writes the `.index` last. After every save this module fsyncs the files
and writes `ckpt-<step>.manifest.json` (sizes and SHA-256 of every file, written to a temporary
name and renamed): the commit record of a whole, durable checkpoint. It also records what the saved
input position depends on (`"input": {"batch_size": N}`): a resume with another batch size is
refused with advice (`InputPositionMismatchError`) instead of failing inside tf.data.

Discovery. Checkpoints are found from their files (`candidate_checkpoints`: every `ckpt-N` with a
manifest or an `.index`), never from TensorFlow's `checkpoint` state file, which is only a cache:
the first save of a run rewrites it from the checkpoints on disk (with their times, so that
CheckpointManager deletes the oldest beyond `max_to_keep` again after a fallback).

Restore. Checkpoints are tried newest first: one whose files do not match its manifest, whose
restore fails (TensorFlow's per-tensor CRCs; a checkpoint without a manifest is read in full
first), or that holds another model's variables while an older one fits this model, is reported
and skipped, and the previous one is used. At the first save of the resumed run the skipped ones
are moved to a new `checkpoints/damaged/ckpt-N/` (`ckpt-N.2/`, ... when that step was set aside
before; never deleted), and leftovers of interrupted saves (`ckpt-N_temp/`, manifest
temporaries, data shards without an `.index`) are deleted. Good checkpoints are never deleted
before a newer good one exists (the manager deletes only the oldest beyond `max_to_keep` >= 1).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from lingvo_lite.training import interrupts

__all__: list[str] = []

CHECKPOINT_SUBDIR = "checkpoints"
DAMAGED_SUBDIR = "damaged"
GLOBAL_STEP_KEY = "model/global_step/.ATTRIBUTES/VARIABLE_VALUE"
MANIFEST_SUFFIX = ".manifest.json"
INDEX_SUFFIX = ".index"
_CKPT_RE = re.compile(r"^ckpt-(\d+)$")
# Leftovers of interrupted saves: TensorFlow's shard directory and our manifest's temporary file.
_LEFTOVER_RE = re.compile(r"^ckpt-\d+(_temp|\.manifest\.json\.tmp-\d+)$")
_DATA_RE = re.compile(r"^(ckpt-\d+)\.data-\d{5}-of-\d{5}$")
# What reading a damaged checkpoint raises: TF's DataLoss/NotFound/..., or a short read.
_READ_ERRORS = (tf.errors.OpError, IndexError, OSError, EOFError)
# TensorFlow's error restoring a weight-sized Adam step count `t` into today's scalar one.
_OLD_ADAM_STEP_COUNT = re.compile(
    r"incompatible tensor with shape \([^)]+\) when attempting to restore variable with "
    r"shape \(\) and name \S+\.t:0")


def checkpoint_dir(logdir: str) -> str:
    return os.path.join(logdir, CHECKPOINT_SUBDIR)


def checkpoint_step(path: str) -> int:
    """The global step stored in a checkpoint (read from the file; nothing is built)."""
    return int(tf.train.load_variable(path, GLOBAL_STEP_KEY))


def _prefix_step(prefix: str) -> int:
    m = _CKPT_RE.match(os.path.basename(prefix))
    return int(m.group(1)) if m else -1


def checkpoint_files(prefix: str) -> list[str]:
    """The files of checkpoint `prefix`: its `.index` and `.data-*` shards (those that exist)."""
    files = sorted(glob.glob(glob.escape(prefix) + ".data-?????-of-?????"))
    index = prefix + ".index"
    return ([index] if os.path.exists(index) else []) + files


def manifest_path(prefix: str) -> str:
    return prefix + MANIFEST_SUFFIX


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(prefix: str, input_info: dict[str, Any] | None = None) -> str:
    """Fsyncs the checkpoint's files, then atomically writes its manifest; returns its path.

    `input_info` (e.g. `{"batch_size": 16}`) describes the input whose position the checkpoint
    holds; `restore` compares it with the current input.
    """
    files = checkpoint_files(prefix)
    entries = {}
    for path in files:
        _fsync(path)
        entries[os.path.basename(path)] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    manifest = {"checkpoint": os.path.basename(prefix), "files": entries}
    if input_info:
        manifest["input"] = dict(input_info)
    path = manifest_path(prefix)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(os.path.dirname(path))
    return path


def find_damage(prefix: str) -> str | None:
    """Why checkpoint `prefix` is damaged (missing, truncated or altered files), or None.

    A checkpoint without a manifest (a crash between TensorFlow's save and the manifest, or a
    lost manifest) is checked by reading every tensor, which verifies TensorFlow's per-tensor
    checksums (and catches the partial `.index` of an interrupted save).
    """
    if not os.path.exists(prefix + INDEX_SUFFIX):
        return f"{prefix}.index is missing"
    path = manifest_path(prefix)
    if not os.path.exists(path):
        if not glob.glob(glob.escape(prefix) + ".data-?????-of-?????"):
            return f"{prefix} has no data file"
        return _read_every_tensor(prefix)
    try:
        with open(path) as f:
            entries = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest {path} is unreadable ({e})"
    directory = os.path.dirname(prefix)
    for name, entry in sorted(entries.items()):
        file = os.path.join(directory, name)
        if not os.path.exists(file):
            return f"{file} is missing"
        size = os.path.getsize(file)
        if size != entry["size"]:
            return f"{file} has {size} bytes, {entry['size']} were written"
        if _sha256(file) != entry["sha256"]:
            return f"{file} does not match the checksum written with it"
    return None


def _read_error(e: BaseException) -> str:
    first = " ".join(str(e).split())[:200]
    return f"reading it failed ({type(e).__name__}: {first})"


def _read_every_tensor(prefix: str) -> str | None:
    """Why reading checkpoint `prefix` fails (a checksum, a short file), or None."""
    try:
        reader = tf.train.load_checkpoint(prefix)
        for name, dtype in reader.get_variable_to_dtype_map().items():
            if dtype != tf.variant:  # An iterator's state: not readable here, checked at restore.
                reader.get_tensor(name)
    except (*_READ_ERRORS, ValueError) as e:
        return _read_error(e)
    return None


def candidate_checkpoints(logdir: str) -> list[str]:
    """Checkpoint prefixes to try at restore, newest (highest step) first.

    Found from the files themselves: every `ckpt-N` with a manifest or an `.index`. The
    `checkpoint` state file is not read (it is a cache that the first save rewrites), so a lost or
    garbled one loses nothing. An interrupted save leaves at most a partial `.index` (TensorFlow
    writes it last), which `find_damage` reports.
    """
    directory = checkpoint_dir(logdir)
    if not os.path.isdir(directory):
        return []
    prefixes = set()
    for name in os.listdir(directory):
        for suffix in (MANIFEST_SUFFIX, INDEX_SUFFIX):
            if name.endswith(suffix) and _CKPT_RE.match(name[: -len(suffix)]):
                prefixes.add(os.path.join(directory, name[: -len(suffix)]))
    return sorted(prefixes, key=_prefix_step, reverse=True)


def latest_checkpoint(logdir: str) -> str | None:
    """Path prefix of the newest checkpoint in `logdir` whose files are intact, or None."""
    for prefix in candidate_checkpoints(logdir):
        if find_damage(prefix) is None:
            return prefix
    return None


class CheckpointMismatchError(ValueError):
    """A checkpoint does not hold every variable of this model (another model's checkpoint)."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail  # TensorFlow's first line, for a warning.


class InputPositionMismatchError(ValueError):
    """A checkpoint's input position was saved with other input params (e.g. batch size).

    Raised by `Checkpointer.restore`; the message says how to go on (see docs/recovery.md,
    "Resuming and recovery").
    """


def _manifest_input(prefix: str) -> dict[str, Any] | None:
    """The `input` entry of a checkpoint's manifest, or None (no manifest, or an older one)."""
    try:
        with open(manifest_path(prefix)) as f:
            info = json.load(f).get("input")
    except (OSError, ValueError, AttributeError):
        return None
    return info if isinstance(info, dict) else None


class Checkpointer:
    """Saves and restores one run's checkpoints.

    Args:
      logdir: the run's log directory.
      variables: name -> variable, normally `task.checkpoint_variables()`.
      iterator: the training input iterator to save with the weights, or None.
      max_to_keep: how many checkpoints to keep (>= 1).
      warn: called with a one-line message for each unusable checkpoint skipped at restore and
        for each one moved aside at the first save.
      input_info: what the iterator's position depends on, e.g. `{"batch_size": 16}`; written
        to each manifest, and a checkpoint saved with other values is not restored.
      restore_input_position: False restores the weights only and starts the iterator from its
        beginning (`--reset_input_position`).
    """

    def __init__(self, logdir: str, variables: dict[str, tf.Variable], iterator: Any = None,
                 max_to_keep: int = 5, warn: Callable[[str], None] | None = None,
                 input_info: dict[str, Any] | None = None,
                 restore_input_position: bool = True) -> None:
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"train.max_checkpoints_to_keep={max_to_keep!r} must be an int >= 1 "
                             "(the newest checkpoint is always kept).")
        self._logdir = logdir
        items: dict[str, Any] = {"model": dict(variables)}
        if iterator is not None:
            items["iterator"] = iterator
        self._checkpoint = tf.train.Checkpoint(**items)
        self._input_info = dict(input_info or {}) if iterator is not None else {}
        # Restores the weights alone when the input position is not wanted.
        self._restore_checkpoint = (self._checkpoint if restore_input_position or iterator is None
                                    else tf.train.Checkpoint(model=dict(variables)))
        self._partial = self._restore_checkpoint is not self._checkpoint or iterator is None
        self.restored_input_position = False  # Whether the last restore set the iterator.
        self._manager: tf.train.CheckpointManager | None = None
        self._max_to_keep = max_to_keep
        self._last_saved_step: int | None = None
        self._warn = warn or (lambda msg: None)
        # Unusable (damaged or another model's) checkpoints skipped by the last restore_latest.
        self.damaged: list[str] = []
        self._good: list[str] = []  # Checkpoints older than (and including) the restored one.

    @property
    def directory(self) -> str:
        return checkpoint_dir(self._logdir)

    def _get_manager(self) -> tf.train.CheckpointManager:
        # Created lazily: the manager creates its directory, and setup must not touch the logdir.
        if self._manager is None:
            if os.path.isdir(self.directory):
                for prefix in self.damaged:
                    self._quarantine(prefix)
                self.damaged = []
                self._remove_leftovers()
                self._rebuild_state()
            self._manager = tf.train.CheckpointManager(
                self._checkpoint, self.directory, max_to_keep=self._max_to_keep,
                checkpoint_name="ckpt")
        return self._manager

    def _quarantine(self, prefix: str) -> None:
        """Moves an unusable checkpoint's files to a new `damaged/ckpt-N[.k]/` (never deleted)."""
        files = [p for p in checkpoint_files(prefix) + [manifest_path(prefix)]
                 if os.path.exists(p)]
        if not files:
            return
        base = os.path.join(self.directory, DAMAGED_SUBDIR, os.path.basename(prefix))
        target, copy = base, 1
        while os.path.exists(target):  # The same step may be set aside more than once.
            copy += 1
            target = f"{base}.{copy}"
        os.makedirs(target)
        for path in files:
            os.replace(path, os.path.join(target, os.path.basename(path)))
        self._warn(f"moved the unusable checkpoint {prefix} ({len(files)} files) to {target}.")

    def _remove_leftovers(self) -> None:
        """Deletes what interrupted saves left: `ckpt-N_temp/`, manifest temporaries, and data
        shards of a save that never wrote its `.index` (nor a manifest)."""
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            data = _DATA_RE.match(name)
            if data:
                prefix = os.path.join(self.directory, data.group(1))
                if (os.path.exists(prefix + INDEX_SUFFIX)
                        or os.path.exists(manifest_path(prefix))):
                    continue
            elif not _LEFTOVER_RE.match(name):
                continue
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)

    def _rebuild_state(self) -> None:
        """Rewrites the `checkpoint` state file from the checkpoints found on disk.

        The state is only a cache (see candidate_checkpoints), but CheckpointManager reads it: a
        garbled one would make every save fail, and paths listed without timestamps are never
        deleted. Listing every good checkpoint with its time lets the manager delete the oldest
        beyond max_to_keep again.
        """
        state = os.path.join(self.directory, "checkpoint")
        good = sorted(self._good, key=_prefix_step)
        if not good:
            if os.path.exists(state):
                os.remove(state)
            return
        times = []
        for prefix in good:
            files = [f for f in (prefix + INDEX_SUFFIX, manifest_path(prefix)) if os.path.exists(f)]
            times.append(min((os.path.getmtime(f) for f in files), default=time.time()))
        # TensorFlow marks this function deprecated (for CheckpointManager users) and would
        # print a 3-line warning on every resume; rewriting the manager's state is the point.
        from tensorflow.python.util import deprecation

        with deprecation.silence():
            tf.compat.v1.train.update_checkpoint_state(
                self.directory, good[-1], all_model_checkpoint_paths=good,
                all_model_checkpoint_timestamps=times, last_preserved_timestamp=min(times) - 1.0)

    def restore_latest(self) -> str | None:
        """Restores the newest usable checkpoint, if any; returns its path.

        Damaged checkpoints (see the module docstring), and another model's checkpoints when an
        older one fits this model, are skipped with a warning; the first save moves them aside.

        Raises:
          ValueError: no checkpoint holds every variable of this model (the params changed), or
            every checkpoint in the directory is damaged.
        """
        candidates = candidate_checkpoints(self._logdir)
        skipped: list[tuple[str, str]] = []  # (path, "is damaged: why"), newest first.
        mismatch: CheckpointMismatchError | None = None
        self.damaged = []
        for i, path in enumerate(candidates):
            reason = find_damage(path)
            if reason is None:
                try:
                    self.restore(path)
                except _READ_ERRORS as e:
                    reason = _read_error(e)
                except CheckpointMismatchError as e:
                    mismatch = mismatch or e
                    skipped.append((path, f"is unusable: it does not match this model "
                                          f"({e.detail})"))
                    continue
                else:
                    for old, why in skipped:
                        self._warn(f"checkpoint {old} {why}. Falling back to the previous "
                                   "checkpoint; this one will be moved to "
                                   f"{os.path.join(self.directory, DAMAGED_SUBDIR)}.")
                    self.damaged = [old for old, _ in skipped]
                    self._good = candidates[i:]
                    return path
            skipped.append((path, f"is damaged: {reason}"))
        if mismatch is not None:
            raise mismatch  # Most likely the params changed: nothing here fits this model.
        if skipped:
            for old, why in skipped:
                self._warn(f"checkpoint {old} {why}.")
            raise ValueError(
                f"every checkpoint in {self.directory} is damaged ({len(skipped)} tried, "
                "see the warnings); move that directory aside to train from scratch, or restore "
                "it from a backup.")
        return None

    def restore(self, path: str) -> None:
        """Restores `path`; every variable of the model must be found in it.

        Raises:
          CheckpointMismatchError: it lacks a variable of this model or holds another shape.
        """
        saved_input = _manifest_input(path)
        if not self._partial and saved_input is not None:
            for key, value in sorted(self._input_info.items()):
                if key in saved_input and saved_input[key] != value:
                    raise InputPositionMismatchError(
                        f"checkpoint {path} holds the input position of input.{key}="
                        f"{saved_input[key]!r}, but this run has input.{key}={value!r}: a saved "
                        f"position only fits the input it was saved with. Resume with input.{key}"
                        f"={saved_input[key]!r}, or start a new run with a new --logdir, or keep "
                        "the weights and restart the input from its beginning with "
                        "--reset_input_position.")
        try:
            status = self._restore_checkpoint.restore(path)
            status.assert_existing_objects_matched()
        except (AssertionError, ValueError) as e:
            first = str(e).strip().splitlines()[0][:300]
            if _OLD_ADAM_STEP_COUNT.search(str(e)):
                raise CheckpointMismatchError(
                    f"Checkpoint {path} keeps Adam's step count per weight element, as "
                    "lingvo-lite did before its optimizers updated weights in place "
                    "(2026-11-25); this version keeps one per weight and cannot resume it. Use "
                    "a new --logdir, or the lingvo-lite version that wrote it.", first) from None
            if not self._partial and not any(
                    name.startswith("iterator/") for name, _ in tf.train.list_variables(path)):
                raise InputPositionMismatchError(
                    f"checkpoint {path} holds no input position (a multi-client cluster run "
                    "keeps each task's under <logdir>/input_positions/; a TPU run keeps "
                    "none). Resume it as it was run (the same TF_CONFIG tasks), or here with "
                    "--reset_input_position (its weights, the input from its "
                    "beginning).") from None
            raise CheckpointMismatchError(
                f"Checkpoint {path} does not match this model ({first}). Were the model params "
                "changed? Use a new --logdir, or the params the run was started with "
                "(see params.txt in the logdir).", first) from None
        if self._partial:
            status.expect_partial()
        self.restored_input_position = not self._partial
        self._last_saved_step = checkpoint_step(path)

    def save(self, step: int) -> str | None:
        """Saves checkpoint `ckpt-<step>` unless that step is already saved; returns its path.

        The manifest is written after TensorFlow has completed the save (see the module
        docstring); manifests of checkpoints the manager deleted are removed.
        """
        if step == self._last_saved_step:
            return None
        manager = self._get_manager()
        path = manager.save(checkpoint_number=step)
        interrupts.maybe_signal_self(f"saving:{step}")
        write_manifest(path, self._input_info)
        for stale in glob.glob(os.path.join(glob.escape(self.directory),
                                            "ckpt-*" + MANIFEST_SUFFIX)):
            if not os.path.exists(stale[: -len(MANIFEST_SUFFIX)] + INDEX_SUFFIX):
                os.remove(stale)
        self._last_saved_step = step
        return path
