"""From `--model` and the override flags to the final task and input params.

Order of application (later wins):
  1. `model_params.Model()`: the task params with the train input under `input`;
  2. `--model_params_override` (FromText on the task params, so `input.*` keys work too);
  3. `--input_params_override` (FromText on the train input params);
  4. the dedicated flags: `--max_steps`, `--num_cells`, `--num_replicas`, `--num_micro_batches`,
     `--seed`.

Nothing here creates a TensorFlow op: it runs before the logical devices are configured.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

from lingvo_lite.core import hyperparams
from lingvo_lite.tasks import model_registry
from lingvo_lite.training.options import RunOptions, UsageError

__all__: list[str] = []


@dataclasses.dataclass
class ModelConfig:
    """A resolved model: its name, the registered params object and the final task params."""

    name: str
    model_params: model_registry.SingleTaskModelParams
    task_params: hyperparams.InstantiableParams

    @property
    def train_input_params(self) -> hyperparams.Params:
        return self.task_params.input

    def eval_input_params(self, split: str) -> hyperparams.Params:
        """Input params of `split` for one evaluation pass (repeat=False)."""
        try:
            p = self.model_params.Input(split)
        except ValueError as e:
            raise UsageError(f"--eval_splits: {e}") from None
        except NotImplementedError:
            have = [s for s in self.available_splits() if s != "train"] or ["train"]
            raise UsageError(
                f"--eval_splits: model {self.name} has no {split!r} split; pass one it defines, "
                f"e.g. --eval_splits={','.join(have)}.") from None
        p = p.Copy()
        if "repeat" in p:
            p.repeat = False
        return p

    def available_splits(self) -> list[str]:
        """The splits whose input params the model defines."""
        out = []
        for split in ("train", "dev", "test"):
            try:
                self.model_params.Input(split)
            except NotImplementedError:
                continue
            out.append(split)
        return out


def import_model_modules(modules: list[str] | tuple[str, ...]) -> None:
    """Imports `--model_modules` so the models they register can be named by `--model`."""
    for module in modules:
        module = module.strip()
        if not module:
            continue
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and module.startswith(e.name):
                raise UsageError(
                    f"--model_modules: cannot import {module!r} ({e}); check the name and "
                    "PYTHONPATH.") from None
            raise


def resolve_model_class(name: str) -> type:
    """The params class for `--model`: a registered name, else a `module.path.ClassName`.

    A fully-qualified path is imported on demand, so a model defined outside the declared model
    packages (e.g. a test model) can be trained without registering it there.
    """
    try:
        return model_registry.get_class(name)
    except KeyError as e:
        registry_error = e
    module_name, _, class_name = name.rpartition(".")
    cls = None
    if module_name and class_name:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if not (e.name and module_name.startswith(e.name)):
                raise  # The module exists but one of its own imports is missing: a real bug.
            module = None
        cls = getattr(module, class_name, None) if module is not None else None
        candidates = [n for n, v in vars(module).items() if isinstance(v, type)
                      and issubclass(v, model_registry.SingleTaskModelParams)
                      and v is not model_registry.SingleTaskModelParams] if module else []
        if cls is None and candidates:
            close = difflib.get_close_matches(class_name, candidates, n=3, cutoff=0.5)
            hint = (f"Did you mean: {', '.join(f'{module_name}.{c}' for c in close)}?" if close
                    else f"It defines: {', '.join(sorted(candidates))}.")
            raise UsageError(f"--model: module {module_name} has no model {class_name!r}. {hint}")
    if cls is None:
        raise UsageError(f"--model: {registry_error.args[0]}") from None
    if not (isinstance(cls, type) and issubclass(cls, model_registry.SingleTaskModelParams)):
        raise UsageError(
            f"--model: {name} is not a model params class (it must subclass "
            "model_registry.SingleTaskModelParams).")
    return cls


def _apply_text(p: hyperparams.Params, text: str, flag: str) -> None:
    if not text or not text.strip():
        return
    try:
        p.FromText(text)
    except AttributeError as e:
        raise UsageError(
            f"--{flag}: {e} Run --mode=inspect_params to list every param.") from None
    except ValueError as e:
        raise UsageError(f"--{flag}: {e}") from None


def iter_pipelining_params(p: Any, path: str = "") -> Iterator[tuple[str, hyperparams.Params]]:
    """`pipelining_layer.iter_pipelining_params`, importing TensorFlow (no op runs) on first
    call: the trainer checks its flags before TensorFlow loads."""
    from lingvo_lite.pipeline import pipelining_layer

    return pipelining_layer.iter_pipelining_params(p, path)


def auto_num_logical_cpus(task_params: hyperparams.Params) -> int:
    """The most devices any PipeliningLayer needs (num_replicas x the devices its schedule
    places its cells on), at least 1."""
    from lingvo_lite.pipeline import step_layout

    sizes = []
    for _, pp in iter_pipelining_params(task_params):
        if not (isinstance(pp.num_cells, int) and isinstance(pp.num_replicas, int)):
            continue
        try:
            devices = step_layout.placement_schedule(pp).num_devices
        except ValueError:  # The pipeline reports its schedule error when it is built.
            devices = pp.num_cells
        sizes.append(devices * pp.num_replicas)
    return max([1, *sizes])


def set_pipeline_fields(p: hyperparams.Params, num_cells: int | None = None,
                        num_micro_batches: int | None = None,
                        num_replicas: int | None = None, placement: str | None = None) -> int:
    """Sets num_cells / num_micro_batches / num_replicas / placement (when not None) in every
    PipeliningLayer params.

    Returns the number of PipeliningLayer params found. A num_cells larger than a pipeline's
    number of layers raises UsageError naming the `--num_cells` flag.
    """
    pipelines = list(iter_pipelining_params(p))
    for path, pp in pipelines:
        if num_cells is not None:
            if isinstance(pp.layers, (list, tuple)) and num_cells > len(pp.layers):
                raise UsageError(
                    f"--num_cells={num_cells}: PipeliningLayer '{path}' has only "
                    f"{len(pp.layers)} layers; use --num_cells <= {len(pp.layers)}.")
            pp.num_cells = num_cells
        if num_micro_batches is not None:
            pp.num_micro_batches = num_micro_batches
            pp.micro_batch_size = None  # The flag must win over a micro_batch_size setting.
        if num_replicas is not None:
            pp.num_replicas = num_replicas
        if placement is not None:
            pp.placement = placement
    return len(pipelines)


LAYER_PROFILE_FILE = "layer_profile.json"


def set_layer_profile_paths(p: hyperparams.Params, logdir: str) -> list[str]:
    """Points every PipeliningLayer with partition_cost='measured' and no
    `partition_profile_path` at `<logdir>/layer_profile.json`: the cache of its layer times,
    beside the checkpoints, so a restarted or evaluating job partitions on the same times.

    Returns the dotted paths of the pipelines that were set.
    """
    changed = []
    for path, pp in iter_pipelining_params(p):
        if pp.partition_cost == "measured" and pp.partition_profile_path is None:
            pp.partition_profile_path = os.path.join(logdir, LAYER_PROFILE_FILE)
            changed.append(path)
    return changed


def uses_measured_costs(p: hyperparams.Params) -> bool:
    """Whether a PipeliningLayer under `p` partitions on measured layer times."""
    return any(pp.partition_cost == "measured" for _, pp in iter_pipelining_params(p))


def _apply_flags(p: hyperparams.InstantiableParams, options: RunOptions) -> None:
    if options.max_steps is not None:
        p.train.max_steps = options.max_steps
    if options.shard_optimizer_state:
        p.train.shard_optimizer_state = True
    flags = {"num_cells": options.num_cells, "num_micro_batches": options.num_micro_batches,
             "num_replicas": options.num_replicas}
    given = [name for name, value in flags.items() if value is not None]
    if given:
        if not set_pipeline_fields(p, options.num_cells, options.num_micro_batches,
                                   options.num_replicas):
            flag = given[0]
            raise UsageError(
                f"--{flag}: model {options.model} has no PipeliningLayer params to apply it to; "
                f"drop --{flag}.")
    if options.seed is not None:
        if "random_seed" in p:
            p.random_seed = options.seed
        if p.input is not None and "seed" in p.input:
            p.input.seed = options.seed


def build_model_config(options: RunOptions) -> ModelConfig:
    """Resolves `options.model` and applies every override; raises UsageError on user errors."""
    import_model_modules(list(options.model_modules))
    cls = resolve_model_class(options.model)
    model_params = cls()
    task_params = model_params.Model()
    _apply_text(task_params, options.model_params_override, "model_params_override")
    if options.input_params_override and options.input_params_override.strip():
        if task_params.input is None:
            raise UsageError(f"--input_params_override: model {options.model} has no train "
                             "input params.")
        _apply_text(task_params.input, options.input_params_override, "input_params_override")
    _apply_flags(task_params, options)
    check_settable_params(task_params)
    return ModelConfig(name=options.model, model_params=model_params, task_params=task_params)


def check_settable_params(task_params: hyperparams.Params) -> None:
    """Checks params whose library errors would name an internal argument (`method=`,
    `SyntheticInput: batch_size`); raises UsageError naming the dotted param the user sets."""
    from lingvo_lite.pipeline import pipelining_layer
    from lingvo_lite.pipeline.partition import partition

    choices = {"partition_method": partition.METHODS,
               "partition_cost": pipelining_layer.PARTITION_COSTS}
    for path, pp in iter_pipelining_params(task_params):
        for name, valid in choices.items():
            value = pp.Get(name)
            if value not in valid:
                raise UsageError(
                    f"{path}.{name}={value!r} is unknown; use one of {', '.join(valid)}, e.g. "
                    f"--model_params_override=\"{path}.{name} : '{valid[0]}'\".")
    inp = task_params.input
    if inp is not None and "batch_size" in inp:
        size = inp.batch_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise UsageError(
                f"input.batch_size={size!r} must be an int >= 1; set it with "
                "--input_params_override='batch_size : <int>'.")


def list_models_text(modules: list[str] | tuple[str, ...] = ()) -> str:
    """One line per registered model: name and the first line of its docstring."""
    import_model_modules(list(modules))
    models = model_registry.list_models()
    if not models:
        packages = ", ".join(f"{p}/" for p in model_registry.model_packages()) or "a package"
        return f"No registered models (add modules under {packages}).\n"
    width = max(len(n) for n in models)
    return "".join(f"{name:<{width}}  {doc}\n" for name, doc in models.items())


def describe_params(config: ModelConfig, splits: Sequence[str] = ()) -> str:
    """The inspect_params text: task params (train input under `input.*`) and eval inputs."""
    parts = [f"# Task params of {config.name} (train input params under input.*)\n",
             config.task_params.ToText()]
    for split in splits:
        try:
            p = config.eval_input_params(split)
        except ValueError:
            continue
        parts += [f"\n# Input params of split {split!r}\n", p.ToText()]
    return "".join(parts)
