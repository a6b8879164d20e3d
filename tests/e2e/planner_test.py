"""trainer.py --mode=plan: sizes, user errors, the simulator at scale, and an end-to-end check
that the chosen plan fits when run and the faster plan rejected for memory does not."""

from __future__ import annotations

import dataclasses
import io
import re

import memory_model_test
import pytest

from lingvo_lite.analysis import planner, simulator
from lingvo_lite.core import sizes
from lingvo_lite.pipeline.schedules import schedule
from lingvo_lite.training import model_config, options, plan_mode, runner

MODEL = "tests.plan_models.PlanMlp"


@pytest.mark.parametrize("text,expected", [
    ("16GiB", 16 * 2**30), ("512MiB", 512 * 2**20), ("8GB", 8 * 10**9), ("1.5KiB", 1536),
    ("100", 100), ("2 mib", 2 * 2**20)])
def test_parse_size(text, expected):
    assert sizes.parse_size(text) == expected


def _run(**kwargs) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = runner.main(options.RunOptions(model=MODEL, mode="plan", **kwargs), out, err)
    return status, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("kwargs,message", [
    (dict(plan_memory_per_device="1GiB"), "--plan_devices is required"),
    (dict(plan_devices=2), "--plan_memory_per_device is required"),
    (dict(plan_devices=2, plan_memory_per_device="lots"), "--plan_memory_per_device='lots' is "
     "not a size; write e.g. 16GiB"),
    (dict(plan_devices=0, plan_memory_per_device="1GiB"), "--plan_devices=0 must be an int"),
    (dict(plan_devices=2, plan_memory_per_device="1GiB", plan_device_flops=-1.0),
     "--plan_device_flops=-1.0 must be a number > 0"),
])
def test_bad_flags_give_one_line(kwargs, message):
    status, out, err = _run(**kwargs)
    assert status == 1 and out == ""
    assert err.startswith("trainer.py: error: ") and message in err
    assert err.count("\n") == 1


def test_nothing_fits_says_what_to_change():
    status, out, _ = _run(plan_devices=1, plan_memory_per_device="64KiB")
    assert status == 0
    assert "No plan fits. The smallest needs" in out and "raise --plan_memory_per_device" in out


_CHOSEN = re.compile(r"--num_cells=(\d+) --num_replicas=(\d+) --num_micro_batches=(\d+) "
                     r"--model_params_override=\"network.schedule : '(\w+)'; "
                     r"network.remat : '(\w+)'(?:; network.virtual_stages : (\d+))?\"")


def _rejected(out: str) -> tuple[int, int, int, str, str, int]:
    lines = out.split("Faster plans rejected for memory:\n", 1)[1].splitlines()
    row = lines[1].split()  # lines[0] is the header.
    k, r, t, sched = row[1:5]
    if row[5].startswith("v="):  # "interleaved v=2".
        return int(k), int(r), int(t), sched, row[6], int(row[5][2:])
    return int(k), int(r), int(t), sched, row[5], 1


@pytest.mark.slow
def test_chosen_plan_fits_when_run_and_rejected_plan_does_not():
    budget = "2.5MiB"
    status, out, _ = _run(plan_devices=2, plan_memory_per_device=budget)
    assert status == 0, out
    match = _CHOSEN.search(out)
    assert match, out
    chosen = (int(match[1]), int(match[2]), int(match[3]), match[4], match[5],
              int(match[6] or 1))
    rejected = _rejected(out)
    assert chosen != rejected
    # The printed flags are what the trainer accepts, and they set the plan.
    config = model_config.build_model_config(options.RunOptions(
        model=MODEL, mode="inspect_model", num_cells=chosen[0], num_replicas=chosen[1],
        num_micro_batches=chosen[2],
        model_params_override=f"network.schedule : '{chosen[3]}'; network.remat : "
                              f"'{chosen[4]}'; network.virtual_stages : {chosen[5]}"))
    (_, p), = model_config.iter_pipelining_params(config.task_params)
    assert (p.num_cells, p.num_replicas, p.num_micro_batches, p.schedule, p.remat,
            p.virtual_stages) == chosen
    configs = [":".join(map(str, c)) for c in (chosen, rejected)]
    measured = memory_model_test.measure(MODEL, configs)
    limit = sizes.parse_size(budget)
    assert max(measured[0]) < limit, f"chosen {configs[0]} measured {measured[0]} B"
    assert max(measured[1]) > limit, f"rejected {configs[1]} measured {measured[1]} B"


def test_interleaved_plans_put_v_cells_on_each_device():
    config = model_config.build_model_config(options.RunOptions(model=MODEL,
                                                                mode="inspect_model"))
    (path, p), = model_config.iter_pipelining_params(config.task_params)
    result = planner.search(p, num_devices=2, budget=sizes.parse_size("1GiB"),
                            schedules=("1f1b", "interleaved"))
    interleaved = [x for x in result.fitting if x.schedule == "interleaved"]
    # PlanMlp has 9 layers: 2 devices take v = 2, 3 and 4 cells each (never 1 device).
    assert {x.virtual_stages for x in interleaved} == set(planner.PLANNED_VIRTUAL_STAGES)
    for plan in interleaved:
        devices = plan.num_cells // plan.virtual_stages
        assert devices == 2 and plan.num_devices == 2 * plan.num_replicas
        assert plan.num_micro_batches % devices == 0  # Megatron's groups of one per device.
        assert [m.cells for m in plan.memory] == [
            tuple(range(d, plan.num_cells, devices)) for d in range(devices)]
    # Same devices and T: interleaving shortens the predicted bubble.
    def bubble(schedule, v):
        return next(x.step.breakdown().bubble for x in result.fitting
                    if (x.schedule, x.virtual_stages, x.num_replicas, x.num_micro_batches,
                        x.remat) == (schedule, v, 1, 8, "never")
                    and x.num_devices == 2)
    assert bubble("interleaved", 2) < bubble("1f1b", 1)
    # Its printed flags build a pipeline of that many cells, v per device.
    plan = interleaved[0]
    flags = plan_mode.plan_flags(plan, MODEL, path)
    assert f"--num_cells={plan.num_cells} " in flags
    override = flags.split('--model_params_override="')[1].rstrip('"')
    built = model_config.build_model_config(options.RunOptions(
        model=MODEL, mode="inspect_model", num_cells=plan.num_cells,
        num_replicas=plan.num_replicas, num_micro_batches=plan.num_micro_batches,
        model_params_override=override))
    (_, q), = model_config.iter_pipelining_params(built.task_params)
    assert (q.num_cells, q.schedule, q.virtual_stages) == (
        plan.num_cells, "interleaved", plan.virtual_stages)
    assert "(cells 0, 2" in planner.format_report(
        dataclasses.replace(result, fitting=(plan,)), MODEL, path)


def test_zbv_plans_put_two_cells_on_each_device_in_a_v():
    config = model_config.build_model_config(options.RunOptions(model=MODEL,
                                                                mode="inspect_model"))
    (path, p), = model_config.iter_pipelining_params(config.task_params)
    result = planner.search(p, num_devices=2, budget=sizes.parse_size("1GiB"),
                            schedules=("zero_bubble", "zbv"))
    zbv = [x for x in result.fitting + result.too_big if x.schedule == "zbv"]
    # PlanMlp has 9 layers; on at most 2 devices ZB-V runs K=4 cells on 2 devices (K=2
    # would be one device, which has no bubble to fill).
    assert zbv and {x.num_cells for x in zbv} == {4}
    for plan in zbv:
        assert plan.num_devices == 2 * plan.num_replicas
        # Device 0 holds cells 0 and 3, device 1 cells 1 and 2: not k % 2.
        assert [m.cells for m in plan.memory] == [(0, 3), (1, 2)]
    plan = zbv[0]
    assert plan.schedule_label == "zbv"
    flags = plan_mode.plan_flags(plan, MODEL, path)
    assert "network.schedule : 'zbv'" in flags and "virtual_stages" not in flags
    assert "zbv" in planner.format_report(dataclasses.replace(result, fitting=(plan,)), MODEL,
                                          path)


def test_odd_cell_counts_get_no_zbv_plan():
    config = model_config.build_model_config(options.RunOptions(model=MODEL,
                                                                mode="inspect_model"))
    (_, p), = model_config.iter_pipelining_params(config.task_params)
    result = planner.search(p, num_devices=3, budget=sizes.parse_size("1GiB"),
                            schedules=("zbv",), remats=("never",))
    assert {x.num_cells for x in result.fitting + result.too_big} == {4, 6}


def test_simulator_at_128_cells_and_512_micro_batches_is_linear(monkeypatch):
    """K=128, T=512: the dependency checks stay O(K x (T + K)), and the step time is GPipe's
    closed form (T + K - 1) x (forward + backward)."""
    calls = 0
    original = schedule.dependencies

    def counting(action, num_cells):
        nonlocal calls
        calls += 1
        return original(action, num_cells)

    monkeypatch.setattr(schedule, "dependencies", counting)
    k, t = 128, 512
    for name in ("gpipe", "1f1b"):
        calls = 0
        step = simulator.simulate(schedule.make_schedule(name, k, t),
                                  simulator.PhaseCosts.uniform(k, 1.0, 2.0), remat="never")
        assert step.step_time == pytest.approx((t + k - 1) * 3.0)
        # One check per (tick, cell) while the schedule is laid out, one per action when
        # replayed: at most 2 (T + K) ticks x K cells + 2 K T actions.
        assert calls <= 2 * (t + k) * k + 2 * k * t, (name, calls)
