"""A toy translation task on files written by the test, shared by the end-to-end tests that
train, decode and export it through trainer.py's runner in-process (tests/e2e/mt_decode_test.py,
tests/e2e/export_test.py)."""

from __future__ import annotations

import io
import os

import numpy as np

from lingvo_lite.tasks import model_registry
from lingvo_lite.training import options, runner
from tasks.mt import input_generator, model

WORDS = ["red", "blue", "green", "cat", "dog", "big", "small", "old"]
DATA_DIR_ENV = "TOY_MT_DATA_DIR"


def write_toy_corpus(directory: str) -> None:
    """A toy 'translation': the source words reversed and upper-cased."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 200), ("dev", 16), ("test", 16)):
        src = [" ".join(rng.choice(WORDS, size=rng.integers(2, 5))) for _ in range(n)]
        with open(os.path.join(directory, f"{split}.src"), "w") as f:
            f.writelines(s + "\n" for s in src)
        with open(os.path.join(directory, f"{split}.tgt"), "w") as f:
            f.writelines(" ".join(reversed(s.upper().split())) + "\n" for s in src)


class ToyMt(model_registry.SingleTaskModelParams):
    """A 1+1-layer Transformer (K=2, T=2, beam 2) on the files of $TOY_MT_DATA_DIR; a test
    subclasses it (not registered) and names it to the runner as `<module>.<class>`."""

    MAX_STEPS = 4

    def _input(self, split: str):
        p = input_generator.ParallelTextInput.Params().Set(
            name=split, data_dir=os.environ[DATA_DIR_ENV], generate="", split=split,
            vocab_size=40, max_source_length=12, max_target_length=12, batch_size=16)
        if split != "train":
            p.Set(shuffle=False, repeat=False, batch_size=8)
        return p

    def Train(self):
        return self._input("train")

    def Dev(self):
        return self._input("dev")

    def Test(self):
        return self._input("test")

    def Task(self):
        p = model.transformer_task_params("tiny", 40, 16, 32, 2, 1, 16, 12, 12, num_cells=2,
                                          num_micro_batches=2)
        p.decoder.beam_size = 2
        steps = self.MAX_STEPS
        p.train.Set(learning_rate=1e-2, max_steps=steps, save_interval_steps=steps,
                    log_interval_steps=steps // 2, summary_interval_steps=steps // 2)
        return p


def run_trainer(**kwargs) -> tuple[int, str, str]:
    """runner.main in-process with trainer.py's options; (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    status = runner.main(options.RunOptions(**kwargs), out=out, err=err)
    return status, out.getvalue(), err.getvalue()
