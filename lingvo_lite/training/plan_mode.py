"""`trainer.py --mode=plan`: search the plans for a registered model's first PipeliningLayer
and print them with the command that runs the best (`lingvo_lite.analysis.planner` searches)."""

from __future__ import annotations

from lingvo_lite.analysis import bucket_plan, memory_model, planner
from lingvo_lite.core import hyperparams
from lingvo_lite.pipeline import buckets
from lingvo_lite.training import model_config, options
from lingvo_lite.training.options import UsageError

__all__ = ["plan_flags", "plan_text"]


def plan_flags(plan: planner.Plan, model: str, path: str, base_override: str = "") -> str:
    """The trainer.py command line that runs `plan`."""
    settings = [base_override.strip().rstrip(";"), f"{path}.schedule : '{plan.schedule}'",
                f"{path}.remat : '{plan.remat}'"]
    if plan.virtual_stages > 1:
        settings.append(f"{path}.virtual_stages : {plan.virtual_stages}")
    override = "; ".join(x for x in settings if x)
    return (f"{options.trainer_command()} --model={model} "
            f"--logdir={options.default_run_logdir(model)} --num_cells={plan.num_cells} "
            f"--num_replicas={plan.num_replicas} --num_micro_batches={plan.num_micro_batches} "
            f"--model_params_override=\"{override}\"")


def plan_text(model: str, task_params: hyperparams.Params, num_devices: int, budget: int,
              device_flops: float | None = None, base_override: str = "", top: int = 5) -> str:
    """`trainer.py --mode=plan` for a task's (first) PipeliningLayer."""
    pipelines = list(model_config.iter_pipelining_params(task_params))
    if not pipelines:
        raise UsageError(f"--mode=plan: model {model} has no PipeliningLayer to plan.")
    path, p = pipelines[0]
    if p.input_buckets and p.input_shapes is None:  # Memory is planned for the largest bucket.
        p = p.Copy().Set(input_shapes=buckets.planning_shapes(p))
    train = task_params.train if "train" in task_params else None
    optimizer = train.optimizer if train is not None else None
    sharded = bool(train is not None and "shard_optimizer_state" in train
                   and train.shard_optimizer_state)
    try:
        result = planner.search(p, num_devices, budget,
                                device_flops or planner.DEFAULT_DEVICE_FLOPS,
                                memory_model.optimizer_slots(optimizer),
                                shard_optimizer_state=sharded)
    except ValueError as e:
        raise UsageError(f"--mode=plan: {e}") from None
    if sharded and "shard_optimizer_state" not in base_override:  # The printed command too.
        base_override = "; ".join(x for x in (base_override.strip().rstrip(";"),
                                              "train.shard_optimizer_state : True") if x)
    text = planner.format_report(
        result, model, path, top,
        run_command=lambda plan: plan_flags(plan, model, path, base_override))
    if p.input_buckets and result.fitting:
        weights, source = bucket_plan.bucket_weights(
            p, task_params.input if "input" in task_params else None)
        steps = bucket_plan.bucket_steps(
            p, weights, result.fitting[0], device_flops or planner.DEFAULT_DEVICE_FLOPS,
            num_slots=memory_model.optimizer_slots(optimizer), shard_slots=sharded)
        text += "\n" + "\n".join(bucket_plan.mix_lines(
            steps, f"{source}; plan 1", budget, planned=p.input_shapes)) + "\n"
    if len(pipelines) > 1:
        text += (f"(Planned the first PipeliningLayer, '{path}', of {len(pipelines)}.)\n")
    return text
