"""Tests of `trainer.py --mode=export`: SavedModels served without lingvo-lite.

`setUpClass` trains one tiny run of each task family in-process (image: AmoebaNetDigits; Keras:
ResNetDigits at K=4; translation: a tiny Transformer on a toy corpus; character LM:
GPT2CharLM), exports each, and serves every export in ONE subprocess whose imports of
`lingvo_lite`, `tasks` and `model_params` fail (checked inside it): TensorFlow and
tensorflow-text only. Each exported signature's outputs are compared with the in-process,
pipelined model restored from the same checkpoint as eval/decode restore it (its own forward,
decode and greedy loop, not the export code). A K=1 checkpoint of the K=4 run's weights
(written variable by variable from `tf.train.load_variable`) must export identical outputs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import tensorflow as tf
import toy_mt
from conftest import REPO, launch_trainer
from toy_mt import run_trainer

from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.training import checkpointer, model_config, options
from tasks.image import input_generator as image_input
from tasks.text import char_lm_input

pytestmark = pytest.mark.slow  # Several seconds and more: scheduled first.

BLOCKED = ("lingvo_lite", "tasks", "model_params")
class TinyMt(toy_mt.ToyMt):
    MAX_STEPS = 40


def _export_path(logdir: str) -> str:
    (step,) = os.listdir(os.path.join(logdir, "export"))
    return os.path.join(logdir, "export", step)


def _restored_task(name: str, logdir: str, **fields):
    """The task as trained (pipelined), with the newest checkpoint restored as eval does."""
    config = model_config.build_model_config(options.RunOptions(model=name, mode="eval",
                                                                logdir=logdir))
    model_config.set_pipeline_fields(config.task_params, **fields)
    task = config.task_params.Instantiate()
    checkpointer.Checkpointer(logdir, task.checkpoint_variables()).restore_latest()
    return task


def _pipelined_forward(task, inputs: NestedMap) -> NestedMap:
    """The pipelined network's eval forward (micro-batches, cells on their devices)."""
    with fprop_context.fprop_context(training=False, updates=None):
        return task.network.FProp(task.theta.network, inputs)


_SERVE = r"""
import importlib.abc, json, os, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, Blocked())
sys.path = [p for p in sys.path if p and os.path.abspath(p) != REPO]
result = {"importable": []}
for name in BLOCKED:
    try:
        __import__(name)
        result["importable"].append(name)
    except ImportError:
        pass
import numpy as np
import tensorflow as tf
import tensorflow_text  # noqa: F401  (the translation model's sentencepiece ops)

with open(sys.argv[1]) as f:
    requests = json.load(f)
for key, req in requests.items():
    loaded = tf.saved_model.load(req["dir"])
    fn = loaded.signatures[req["signature"]]
    feed = {k: tf.constant(np.array(v["value"], dtype=v["dtype"]))
            for k, v in req["inputs"].items()}
    outputs = fn(**feed)
    result[key] = {k: v.numpy().tolist() if v.dtype != tf.string else
                   [s.decode("utf-8") for s in v.numpy().tolist()] for k, v in outputs.items()}
    result[key + "/signatures"] = sorted(loaded.signatures)
print(json.dumps(result))
"""


def _serve_without_lingvo(requests: dict, tmp: str) -> dict:
    """Runs each request {key: {dir, signature, inputs}} in one isolated subprocess."""
    path = os.path.join(tmp, "requests.json")
    with open(path, "w") as f:
        json.dump(requests, f)
    script = f"BLOCKED = {BLOCKED!r}\nREPO = {REPO!r}\n" + _SERVE
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    proc = subprocess.run([sys.executable, "-I", "-c", script, path], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _request(directory: str, signature: str, **inputs: np.ndarray) -> dict:
    return {"dir": directory, "signature": signature,
            "inputs": {k: {"dtype": str(v.dtype) if v.dtype.kind != "U" else "str",
                           "value": v.tolist()} for k, v in inputs.items()}}


def _write_k1_copy(name: str, source_logdir: str, target_logdir: str) -> str:
    """A K=1 checkpoint of the weights of `source_logdir`'s newest checkpoint, each variable
    read by name with tf.train.load_variable and saved by the trainer's Checkpointer."""
    source = checkpointer.latest_checkpoint(source_logdir)
    config = model_config.build_model_config(options.RunOptions(model=name, mode="eval",
                                                                logdir=target_logdir))
    model_config.set_pipeline_fields(config.task_params, num_cells=1, num_micro_batches=1)
    task = config.task_params.Instantiate()
    variables = task.checkpoint_variables()
    for key, var in variables.items():
        escaped = key.replace(".", "..").replace("/", ".S")
        var.assign(tf.train.load_variable(source, f"model/{escaped}/.ATTRIBUTES/VARIABLE_VALUE"))
    return checkpointer.Checkpointer(target_logdir, variables).save(
        checkpointer.checkpoint_step(source))


def _greedy_continuations(task, prompts: list[str], seq_len: int) -> list[str]:
    """Greedy continuation of each prompt by the pipelined GPT-2, one step at a time in numpy:
    stop after an end of line (not included) or when the window is full."""
    chars = char_lm_input.vocabulary(task.params.input.num_pairs)
    ids = {c: i for i, c in enumerate(chars)}
    batch = 16  # The pipeline's batch (2 micro-batches); the prompts fill the first rows.
    buf = np.zeros([batch, seq_len], np.int32)
    lengths = np.ones([batch], np.int64)
    for r, prompt in enumerate(prompts):
        buf[r, :len(prompt)] = [ids[c] for c in prompt]
        lengths[r] = len(prompt)
    start = lengths.copy()
    finished = np.zeros([batch], bool)
    finished[len(prompts):] = True

    @tf.function
    def logits_of(token_ids):
        inputs = NestedMap(token_ids=token_ids, padding_mask=tf.ones_like(token_ids))
        return _pipelined_forward(task, inputs).predictions

    while not finished.all():
        logits = logits_of(tf.constant(buf)).numpy()
        for r in np.flatnonzero(~finished):
            token = int(np.argmax(logits[r, lengths[r] - 1]))
            buf[r, lengths[r]] = token
            lengths[r] += 1
            finished[r] = chars[token] == "\n" or lengths[r] == seq_len
    return ["".join(chars[i] for i in buf[r, start[r]:lengths[r]]).rstrip("\n")
            for r in range(len(prompts))]


class ExportTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.root = tempfile.mkdtemp(prefix="export_test_")
        # The one trainer.py process: a refusal, running while the rest trains.
        cls.cli_refusal = launch_trainer(  # TensorFlow's start-up lines hidden as for users.
            "--model=tests.testdata_models.TinyMlp", f"--logdir={cls.root}/tiny_mlp",
            "--mode=export", env={"TF_CPP_MIN_LOG_LEVEL": None})
        cls.dirs = {name: os.path.join(cls.root, name)
                    for name in ("image", "keras_k4", "keras_k1", "mt", "char_lm")}
        d = cls.dirs
        cls.results = {}
        for key, kw in (
                ("image", dict(model="image.AmoebaNetDigits", max_steps=2)),
                ("keras_k4", dict(model="keras_digits.ResNetDigits", max_steps=2, num_cells=4)),
                ("char_lm", dict(model="keras_gpt2.GPT2CharLM", max_steps=2))):
            cls.results[key] = run_trainer(logdir=d[key], mode="train", **kw)
            cls.results[key + "/export"] = run_trainer(logdir=d[key], mode="export", **kw)
        _write_k1_copy("keras_digits.ResNetDigits", d["keras_k4"], d["keras_k1"])
        cls.results["keras_k1/export"] = run_trainer(
            model="keras_digits.ResNetDigits", logdir=d["keras_k1"], mode="export", num_cells=1)
        mt_data = os.path.join(cls.root, "mt_data")
        os.makedirs(mt_data)
        toy_mt.write_toy_corpus(mt_data)
        os.environ[toy_mt.DATA_DIR_ENV] = mt_data
        mt_name = f"{__name__}.TinyMt"
        cls.results["mt"] = run_trainer(model=mt_name, logdir=d["mt"], mode="train")
        cls.results["mt/export"] = run_trainer(model=mt_name, logdir=d["mt"], mode="export")
        cls.results["mt/decode"] = run_trainer(model=mt_name, logdir=d["mt"], mode="decode",
                                               eval_splits=("test",))
        for key, (status, _, err) in cls.results.items():
            assert status == 0, f"{key}: {err[-3000:]}"
        cls.exports = {k: _export_path(v) for k, v in d.items()}
        cls.inputs = cls._inputs(mt_data)
        cls.served = _serve_without_lingvo(cls._requests(), cls.root)
        cls.cli_out, cls.cli_err = cls.cli_refusal.communicate(timeout=600)

    @classmethod
    def tearDownClass(cls) -> None:
        os.environ.pop(toy_mt.DATA_DIR_ENV, None)
        shutil.rmtree(cls.root, ignore_errors=True)
        super().tearDownClass()

    @classmethod
    def _inputs(cls, mt_data: str) -> dict:
        dev = next(iter(image_input.DigitsInput.Params().Set(
            split="dev", image_size=16, batch_size=40, shuffle=False, repeat=False)
            .Instantiate().dataset()))
        images = dev.image.numpy()
        with open(os.path.join(mt_data, "test.src")) as f:
            sources = f.read().splitlines()
        small_dev = next(iter(image_input.DigitsInput.Params().Set(
            split="dev", image_size=8, batch_size=40, shuffle=False, repeat=False)
            .Instantiate().dataset()))
        text = char_lm_input.corpus_text()["dev"].splitlines()
        prompts = [p for p in (line.split("= ")[0] + "= " for line in text) if len(p) < 40][:3]
        prompts += ["the", "sie "]
        windows = next(iter(char_lm_input.CharLMInput.Params().Set(
            split="dev", seq_len=64, batch_size=16, shuffle=False, repeat=False)
            .Instantiate().dataset()))
        return {"images": images, "images_uint8": (images[:8] * 255).round().astype(np.uint8),
                "digits_8x8": small_dev.image.numpy(), "sources": sources,
                "prompts": prompts, "token_ids": windows.token_ids.numpy()}

    @classmethod
    def _requests(cls) -> dict:
        e, x = cls.exports, cls.inputs
        return {
            "image": _request(e["image"], "serving_default", images=x["images"]),
            "image_uint8": _request(e["image"], "serving_uint8", images=x["images_uint8"]),
            "keras_k4": _request(e["keras_k4"], "serving_default", image=x["digits_8x8"]),
            "keras_k1": _request(e["keras_k1"], "serving_default", image=x["digits_8x8"]),
            # As `Decode` batches the split: 8 sentences a call.
            "mt_0": _request(e["mt"], "serving_default", sentences=np.array(x["sources"][:8])),
            "mt_1": _request(e["mt"], "serving_default", sentences=np.array(x["sources"][8:])),
            "char_lm": _request(e["char_lm"], "generate", prompts=np.array(x["prompts"])),
            "char_lm_logits": _request(e["char_lm"], "serving_default",
                                       token_ids=x["token_ids"],
                                       padding_mask=np.ones_like(x["token_ids"])),
        }

    def test_the_serving_process_cannot_import_lingvo_lite(self):
        self.assertEqual([], self.served["importable"])

    def test_exports_go_to_logdir_export_step_with_the_signatures(self):
        self.assertEqual(os.path.join(self.dirs["image"], "export", "2"), self.exports["image"])
        self.assertEqual(["serving_default", "serving_uint8"], self.served["image/signatures"])
        self.assertEqual(["generate", "serving_default"], self.served["char_lm/signatures"])
        _, out, _ = self.results["image/export"]
        self.assertIn("serving_uint8: (images uint8[?,?,?,1]) -> (classes int32[?,5], "
                      "probabilities float32[?,5])", out)
        # Only the model's weights: no optimizer slots, no global step.
        names = [n for n, _ in tf.train.list_variables(
            os.path.join(self.exports["image"], "variables", "variables"))]
        self.assertFalse([n for n in names if "optimizer" in n or "global_step" in n])

    def _check_top_k(self, logits: np.ndarray, served: dict) -> None:
        probabilities = tf.nn.softmax(logits.astype(np.float32)).numpy()
        classes = np.array(served["classes"])
        top = np.sort(probabilities, axis=-1)[:, ::-1][:, :5]
        self.assertAllClose(top, served["probabilities"], rtol=1e-5, atol=1e-6)
        self.assertAllClose(np.take_along_axis(probabilities, classes, axis=1),
                            served["probabilities"], rtol=1e-5, atol=1e-6)
        clear = top[:, 0] - top[:, 1] > 1e-4  # Top-1 where no near-tie can swap the order.
        self.assertGreater(clear.sum(), 20)
        self.assertAllEqual(np.argmax(probabilities, -1)[clear], classes[clear, 0])

    def test_image_top_k_equals_the_pipelined_eval_forward(self):
        task = _restored_task("image.AmoebaNetDigits", self.dirs["image"])
        images = self.inputs["images"]
        out = _pipelined_forward(task, NestedMap(image=tf.constant(images),
                                                 label=tf.zeros([len(images)], tf.int32)))
        self._check_top_k(out.logits.numpy(), self.served["image"])
        # uint8 images: as the input generators convert integer images.
        floats = tf.image.convert_image_dtype(self.inputs["images_uint8"], tf.float32)
        out = _pipelined_forward(task, NestedMap(image=floats, label=tf.zeros([8], tf.int32)))
        probabilities = tf.nn.softmax(out.logits).numpy()
        served = self.served["image_uint8"]
        self.assertAllClose(np.take_along_axis(probabilities, np.array(served["classes"]), 1),
                            served["probabilities"], rtol=1e-5, atol=1e-6)

    def test_keras_signature_equals_the_pipelined_k4_forward(self):
        task = _restored_task("keras_digits.ResNetDigits", self.dirs["keras_k4"], num_cells=4)
        self.assertEqual(4, task.network.num_cells)
        out = _pipelined_forward(task, NestedMap(x=tf.constant(self.inputs["digits_8x8"])))
        self.assertAllClose(out.predictions.numpy(), self.served["keras_k4"]["output_0"],
                            rtol=1e-5, atol=1e-5)

    def test_k4_and_k1_checkpoints_of_the_same_weights_export_identical_outputs(self):
        k4 = checkpointer.latest_checkpoint(self.dirs["keras_k4"])
        k1 = checkpointer.latest_checkpoint(self.dirs["keras_k1"])
        weights = [n for n, _ in tf.train.list_variables(k1) if n.startswith("model/model")]
        self.assertGreater(len(weights), 20)
        for name in weights:
            self.assertAllEqual(tf.train.load_variable(k4, name), tf.train.load_variable(k1, name))
        self.assertAllEqual(np.array(self.served["keras_k4"]["output_0"]),
                            np.array(self.served["keras_k1"]["output_0"]))

    def test_translations_equal_the_in_process_decode(self):
        step = os.path.basename(self.exports["mt"])
        with open(os.path.join(self.dirs["mt"], "decode_test", f"hypotheses_{step}.txt")) as f:
            decoded = f.read().splitlines()
        served = self.served["mt_0"]["translations"] + self.served["mt_1"]["translations"]
        self.assertEqual(decoded, served)
        self.assertTrue(any(len(t.split()) >= 2 for t in served), msg=served)
        self.assertEqual(["spm_40.model"], os.listdir(os.path.join(self.exports["mt"], "assets")))

    def test_character_lm_continuations_equal_the_in_process_greedy_loop(self):
        task = _restored_task("keras_gpt2.GPT2CharLM", self.dirs["char_lm"])
        expected = _greedy_continuations(task, self.inputs["prompts"], seq_len=64)
        self.assertEqual(expected, self.served["char_lm"]["continuations"])
        self.assertTrue(any(self.served["char_lm"]["continuations"]))
        out = _pipelined_forward(task, NestedMap(
            token_ids=tf.constant(self.inputs["token_ids"]),
            padding_mask=tf.ones_like(self.inputs["token_ids"])))
        self.assertAllClose(out.predictions.numpy(), self.served["char_lm_logits"]["output_0"],
                            rtol=1e-5, atol=1e-5)

    def test_task_without_inference_is_refused_in_one_line(self):
        self.assertEqual(1, self.cli_refusal.returncode)
        lines = self.cli_err.strip().splitlines()
        self.assertEqual(1, len(lines), msg=self.cli_err)
        self.assertRegex(lines[0], r"^trainer\.py: error: --mode=export: the task of model "
                                   r"\S*TinyMlp \(TinyMlpTask\) defines no serving signatures; "
                                   r"add a method Inference\(self\)")

    def test_logdir_without_checkpoint_is_refused_in_one_line(self):
        status, _, err = run_trainer(model="keras_digits.ResNetDigits", mode="export",
                                     logdir=os.path.join(self.root, "empty"))
        self.assertEqual(1, status)
        self.assertEqual([f"trainer.py: error: no checkpoint in {self.root}/empty/checkpoints to "
                          "export, train first (--mode=train with the same --logdir)."],
                         err.strip().splitlines())

    def test_export_checkpoint_names_a_step_or_path_else_one_line(self):
        status, out, err = run_trainer(model="keras_digits.ResNetDigits", mode="export",
                                       num_cells=4, logdir=self.dirs["keras_k4"],
                                       export_checkpoint="7")
        self.assertEqual(1, status)
        self.assertEqual(1, len(err.strip().splitlines()), msg=err)
        self.assertIn("--export_checkpoint=7: ", err)
        self.assertIn("checkpoints in", err)
        path = checkpointer.latest_checkpoint(self.dirs["keras_k1"])
        status, out, err = run_trainer(model="keras_digits.ResNetDigits", mode="export",
                                       logdir=self.dirs["keras_k1"], export_checkpoint=path)
        self.assertEqual(0, status, msg=err)
        self.assertIn(f"Exporting {path} (global step 2)", out)
        status, _, err = run_trainer(model="keras_digits.ResNetDigits", mode="eval",
                                     logdir=self.dirs["keras_k1"], export_checkpoint="2")
        self.assertEqual(["trainer.py: error: --export_checkpoint only applies to --mode=export, "
                          "not --mode=eval; drop it."], err.strip().splitlines())


def _doc_blocks() -> list[str]:
    """The fenced bash blocks of docs/export.md."""
    with open(os.path.join(REPO, "docs", "export.md"), encoding="utf-8") as f:
        return re.findall(r"```bash\n(.*?)\n```", f.read(), flags=re.S)


def test_docs_commands_run_as_written():
    """docs/export.md's blocks, each a bash script run from the repository root in order
    (/tmp/ moved into a temporary directory, .venv/bin/python this interpreter)."""
    # A path a Params override takes unquoted, as /tmp/mt_data (pytest's have hyphens).
    tmp_path = tempfile.mkdtemp(prefix="export_docs_")
    blocks = _doc_blocks()
    assert len(blocks) >= 3
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    bin_dir = os.path.dirname(sys.executable)
    for block in blocks:
        script = block.replace("/tmp/", f"{tmp_path}/")
        script = re.sub(r"\.venv/bin/(\w+)", lambda m: os.path.join(bin_dir, m.group(1)), script)
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{block}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
