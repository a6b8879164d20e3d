"""Checkpoints of a task (weights, optimizer slots, global step) and of its input position.

A checkpoint is a `tf.train.Checkpoint` with two entries:
  - `model`: the task's `checkpoint_variables()` dict (keys independent of the partition, so a
    run may resume with another `num_cells`);
  - `iterator`: the training `tf.data` iterator, so a resumed run continues with the batch after
    the last one trained on (training only; evaluation restores `model` alone).
They live in `<logdir>/checkpoints/ckpt-<global step>`, managed by `tf.train.CheckpointManager`.

Integrity. TensorFlow writes a checkpoint's data into a temporary directory, moves it into place,
writes the `.index`, and only then atomically replaces the `checkpoint` state file that names the
latest checkpoint; a crash mid-save therefore leaves the previous checkpoint as the latest. After
every save this module also fsyncs the files and writes `ckpt-<step>.manifest.json` (sizes and
SHA-256 of every file, written to a temporary name and renamed): the commit record of a whole,
durable checkpoint. At restore, checkpoints are tried newest first: one whose files do not match
its manifest, or whose restore fails (TensorFlow's per-tensor CRCs), is reported and skipped, and
the previous one is used. Damaged checkpoints are moved to `checkpoints/damaged/` at the first save
of the resumed run (never deleted), and the good ones are never deleted before a newer good one
exists (the manager deletes only the oldest beyond `max_to_keep` >= 1).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from lingvo_lite.training import interrupts

CHECKPOINT_SUBDIR = "checkpoints"
DAMAGED_SUBDIR = "damaged"
GLOBAL_STEP_KEY = "model/global_step/.ATTRIBUTES/VARIABLE_VALUE"
MANIFEST_SUFFIX = ".manifest.json"
_CKPT_RE = re.compile(r"^ckpt-(\d+)$")
# What reading a damaged checkpoint raises: TF's DataLoss/NotFound/..., or a short read.
_READ_ERRORS = (tf.errors.OpError, IndexError, OSError, EOFError)


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


def write_manifest(prefix: str) -> str:
    """Fsyncs the checkpoint's files, then atomically writes its manifest; returns its path."""
    files = checkpoint_files(prefix)
    entries = {}
    for path in files:
        _fsync(path)
        entries[os.path.basename(path)] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    manifest = {"checkpoint": os.path.basename(prefix), "files": entries}
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

    A checkpoint without a manifest (a crash between TensorFlow's save and the manifest) is not
    reported here: its restore is still checked by TensorFlow's per-tensor checksums.
    """
    if not os.path.exists(prefix + ".index"):
        return f"{prefix}.index is missing"
    path = manifest_path(prefix)
    if not os.path.exists(path):
        if not glob.glob(glob.escape(prefix) + ".data-?????-of-?????"):
            return f"{prefix} has no data file"
        return None
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


def _state_paths(directory: str) -> list[str]:
    """Checkpoints the `checkpoint` state file lists (empty if it is missing or unreadable)."""
    try:
        state = tf.train.get_checkpoint_state(directory)
    except (tf.errors.OpError, ValueError, OSError):  # A garbled state file: scan instead.
        return []
    if state is None:
        return []
    paths = list(state.all_model_checkpoint_paths) or [state.model_checkpoint_path]
    return [p if os.path.isabs(p) else os.path.join(directory, p) for p in paths if p]


def candidate_checkpoints(logdir: str) -> list[str]:
    """Checkpoint prefixes to try at restore, newest (highest step) first.

    Those the state file lists, plus any `ckpt-N` with a manifest (in case the state file is lost):
    a `ckpt-N` in neither may be a save that crashed halfway and is ignored.
    """
    directory = checkpoint_dir(logdir)
    if not os.path.isdir(directory):
        return []
    prefixes = set(_state_paths(directory))
    for path in glob.glob(os.path.join(glob.escape(directory), "ckpt-*" + MANIFEST_SUFFIX)):
        prefixes.add(path[: -len(MANIFEST_SUFFIX)])
    return sorted(prefixes, key=_prefix_step, reverse=True)


def latest_checkpoint(logdir: str) -> str | None:
    """Path prefix of the newest checkpoint in `logdir` whose files are intact, or None."""
    for prefix in candidate_checkpoints(logdir):
        if find_damage(prefix) is None:
            return prefix
    return None


class Checkpointer:
    """Saves and restores one run's checkpoints.

    Args:
      logdir: the run's log directory.
      variables: name -> variable, normally `task.checkpoint_variables()`.
      iterator: the training input iterator to save with the weights, or None.
      max_to_keep: how many checkpoints to keep (>= 1).
      warn: called with a one-line message for each damaged checkpoint skipped at restore.
    """

    def __init__(self, logdir: str, variables: dict[str, tf.Variable], iterator: Any = None,
                 max_to_keep: int = 5, warn: Callable[[str], None] | None = None) -> None:
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"train.max_checkpoints_to_keep={max_to_keep!r} must be an int >= 1 "
                             "(the newest checkpoint is always kept).")
        self._logdir = logdir
        items: dict[str, Any] = {"model": dict(variables)}
        if iterator is not None:
            items["iterator"] = iterator
        self._checkpoint = tf.train.Checkpoint(**items)
        self._partial = iterator is None
        self._manager: tf.train.CheckpointManager | None = None
        self._max_to_keep = max_to_keep
        self._last_saved_step: int | None = None
        self._warn = warn or (lambda msg: None)
        self.damaged: list[str] = []  # Damaged checkpoints skipped by the last restore_latest.
        self._good: list[str] = []  # Intact checkpoints older than (and including) the restored.

    @property
    def directory(self) -> str:
        return checkpoint_dir(self._logdir)

    def _get_manager(self) -> tf.train.CheckpointManager:
        # Created lazily: the manager creates its directory, and setup must not touch the logdir.
        if self._manager is None:
            if self.damaged:
                self._set_aside_damaged()
            self._manager = tf.train.CheckpointManager(
                self._checkpoint, self.directory, max_to_keep=self._max_to_keep,
                checkpoint_name="ckpt")
        return self._manager

    def _set_aside_damaged(self) -> None:
        """Moves damaged checkpoints to `damaged/` and lists only the good ones as the state."""
        target = os.path.join(self.directory, DAMAGED_SUBDIR)
        os.makedirs(target, exist_ok=True)
        for prefix in self.damaged:
            for path in checkpoint_files(prefix) + [manifest_path(prefix)]:
                if os.path.exists(path):
                    os.replace(path, os.path.join(target, os.path.basename(path)))
        good = sorted(self._good, key=_prefix_step)
        tf.compat.v1.train.update_checkpoint_state(
            self.directory, good[-1], all_model_checkpoint_paths=good)
        self.damaged = []

    def restore_latest(self) -> str | None:
        """Restores the newest intact checkpoint, if any; returns its path.

        Damaged checkpoints (see the module docstring) are skipped with a warning.

        Raises:
          ValueError: the checkpoint does not hold a variable of this model (the params
            changed), or every checkpoint in the directory is damaged.
        """
        candidates = candidate_checkpoints(self._logdir)
        self.damaged = []
        for i, path in enumerate(candidates):
            reason = find_damage(path)
            if reason is None:
                try:
                    self.restore(path)
                except _READ_ERRORS as e:
                    first = " ".join(str(e).split())[:200]
                    reason = f"reading it failed ({type(e).__name__}: {first})"
                else:
                    self._good = candidates[i:]
                    return path
            self.damaged.append(path)
            self._warn(f"checkpoint {path} is damaged: {reason}. Falling back to the previous "
                       "checkpoint; the damaged one will be moved to "
                       f"{os.path.join(self.directory, DAMAGED_SUBDIR)}.")
        if self.damaged:
            raise ValueError(
                f"every checkpoint in {self.directory} is damaged ({len(self.damaged)} tried, "
                "see the warnings); move that directory aside to train from scratch, or restore "
                "it from a backup.")
        return None

    def restore(self, path: str) -> None:
        """Restores `path`; every variable of the model must be found in it."""
        try:
            status = self._checkpoint.restore(path)
            status.assert_existing_objects_matched()
        except (AssertionError, ValueError) as e:
            first = str(e).strip().splitlines()[0][:300]
            raise ValueError(
                f"Checkpoint {path} does not match this model ({first}). Were the model params "
                "changed? Use a new --logdir, or the params the run was started with "
                "(see params.txt in the logdir).") from None
        if self._partial:
            status.expect_partial()
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
        write_manifest(path)
        for stale in glob.glob(os.path.join(glob.escape(self.directory),
                                            "ckpt-*" + MANIFEST_SUFFIX)):
            if not os.path.exists(stale[: -len(MANIFEST_SUFFIX)] + ".index"):
                os.remove(stale)
        self._last_saved_step = step
        return path
