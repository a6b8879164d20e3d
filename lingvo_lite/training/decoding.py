"""`--mode=decode`: restore the latest checkpoint, run the task's `Decode` on each eval split.

A task supports decoding by defining `Decode(input_params)` returning an object with
`metrics` (name -> float, e.g. BLEU) and `lines` (one output line per input sentence). For each
split the metrics are written as TensorBoard scalars under `<logdir>/eval_<split>/` and the lines
to `<logdir>/decode_<split>/hypotheses_<step>.txt`, with the metrics beside them in
`metrics_<step>.txt`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TextIO

from lingvo_lite.training import model_config

__all__: list[str] = []

Job = Callable[[], int]


def decode_subdir(split: str) -> str:
    return f"decode_{split}"


def prepare_decode(config: model_config.ModelConfig, logdir: str, eval_splits: dict,
                   out: TextIO, err: TextIO) -> Job:
    """Setup of --mode=decode: build the task, restore the newest intact checkpoint."""
    from lingvo_lite.training import checkpointer

    task = config.task_params.Instantiate()
    if not callable(getattr(task, "Decode", None)):
        raise ValueError(f"--mode=decode: the task of model {config.name} "
                         f"({type(task).__name__}) has no Decode method; use --mode=eval.")
    if not checkpointer.candidate_checkpoints(logdir):
        raise FileNotFoundError(
            f"no checkpoint in {checkpointer.checkpoint_dir(logdir)}, train first "
            f"(--mode=train with the same --logdir).")

    def warn(msg: str) -> None:
        print(f"trainer.py: warning: {msg}", file=err, flush=True)

    ckpt = checkpointer.Checkpointer(logdir, task.checkpoint_variables(), warn=warn)
    latest = ckpt.restore_latest()
    step = checkpointer.checkpoint_step(latest)

    def job() -> int:
        from lingvo_lite.training import loop, summaries

        print(f"Decoding with {latest} (global step {step}).", file=out, flush=True)
        writers = summaries.SummaryWriters(logdir)
        try:
            for split, params in eval_splits.items():
                result = task.Decode(params)
                path = write_decode_results(logdir, split, step, result.metrics, result.lines,
                                            writers)
                print(f"decode {split} @ step {step}: hypotheses in {path}\n"
                      + loop.format_metrics(result.metrics).rstrip(), file=out, flush=True)
        finally:
            writers.close()
        return 0

    return job


def write_decode_results(logdir: str, split: str, step: int, metrics: dict[str, float],
                         lines: list[str], writers: object) -> str:
    """Writes metrics (TensorBoard eval_<split>/ and a text file) and the lines; returns the path.

    `writers` is a `summaries.SummaryWriters`.
    """
    from lingvo_lite.training import loop

    writers.scalars(loop.eval_subdir(split), step, metrics)
    writers.flush()
    directory = os.path.join(logdir, decode_subdir(split))
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"hypotheses_{step}.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)
    with open(os.path.join(directory, f"metrics_{step}.txt"), "w") as f:
        f.write(loop.format_metrics(metrics))
    return path
