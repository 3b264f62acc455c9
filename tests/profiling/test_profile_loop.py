"""Profiles of the step a training loop repeats (NOTE [The step a loop repeats]): an optimizer's state and
step, accumulated gradients. Predicted against measured peaks of the same loop, and fake against real."""

import pytest
import torch

import remat
from remat.zoo import build

SIZES = {"layers": 6, "hidden": 64, "heads": 2, "vocab": 512, "seq": 64, "batch": 2}
LOOPS = {
    "adamw": (lambda params: torch.optim.AdamW(params, lr=1e-3), 1),
    "accumulation": (None, 2),
    "sgd-momentum, accumulation": (lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9), 4),
}


@pytest.fixture(scope="module")
def profiled():
    out = {}
    for name, (make, steps) in LOOPS.items():
        zoo = build("gpt2", **SIZES)
        optimizer = make(zoo.model.parameters()) if make else None
        prof = remat.profile(zoo.model, zoo.inputs, optimizer=optimizer, accumulation_steps=steps, warmup=0, repeat=1)
        out[name] = zoo, optimizer, steps, prof
    return out


def _budgets(prof, nested=True):
    lowest, base = remat.plan(prof, strategy="none", nested=nested).min_peak_bytes, prof.baseline_peak_bytes
    return [lowest, int(lowest * 1.05), (lowest + base) // 2, base]


@pytest.mark.parametrize("name", list(LOOPS))
def test_plans_predict_the_loops_peak_to_the_byte(profiled, name):
    zoo, optimizer, steps, prof = profiled[name]
    bare = remat.profile(zoo.model, zoo.inputs, warmup=0, repeat=1)
    assert prof.resting_bytes > bare.resting_bytes and prof.baseline_peak_bytes > bare.baseline_peak_bytes
    for budget in _budgets(prof):
        plan = remat.plan(prof, budget)
        remat.apply(zoo.model, plan)
        measured = remat.measure(
            zoo.model, zoo.inputs, optimizer=optimizer, accumulation_steps=steps, warmup=0, repeat=1
        )
        remat.remove(zoo.model)
        assert measured.grads_ok
        assert measured.peak_bytes == plan.predicted_peak_bytes <= budget, (budget, plan.assignment, plan.segments)
    assert (optimizer is None or "state and step" in plan.loop) and (steps == 1 or f"over {steps}" in plan.loop)
    assert plan.loop in plan.summary()


def test_a_plan_for_the_bare_step_goes_over_its_budget_in_the_loop(profiled):
    zoo, optimizer, steps, _ = profiled["adamw"]
    bare = remat.profile(zoo.model, zoo.inputs, warmup=0, repeat=1)
    plan = remat.plan(bare, 0.6)
    remat.apply(zoo.model, plan)
    in_loop = remat.measure(zoo.model, zoo.inputs, optimizer=optimizer, warmup=0, repeat=1).peak_bytes
    remat.remove(zoo.model)
    assert in_loop > plan.budget_bytes * 1.2  # what this change is for


def test_the_optimizer_step_can_set_the_floor_and_the_error_says_so(profiled):
    _, _, _, prof = profiled["adamw"]
    floor = remat.plan(prof, strategy="none").min_peak_bytes
    # the optimizer's step (every gradient, the state and its temporaries alive) is the last backward segment
    assert floor >= prof.resting_bytes + prof.grad_bytes
    with pytest.raises(remat.RematError, match="AdamW's state .* alive through every step"):
        remat.plan(prof, floor - 1, nested=False)


@pytest.mark.parametrize("name", list(LOOPS))
def test_fake_profiles_of_the_loop_equal_real_ones(profiled, name):
    zoo, optimizer, steps, prof = profiled[name]
    with torch.device("meta"):
        meta = build("gpt2", **SIZES)
    make = LOOPS[name][0]
    fake = remat.profile(
        meta.model,
        zoo.inputs,
        optimizer=make(meta.model.parameters()) if make else None,
        accumulation_steps=steps,
        fake=True,
    )
    assert (fake.resting_bytes, fake.optimizer_bytes) == (prof.resting_bytes, prof.optimizer_bytes)
    for budget in _budgets(prof, nested=False):
        assignment = remat.plan(prof, budget, nested=False).assignment
        assert fake.predict_peak(assignment) == prof.predict_peak(assignment)


def test_saved_profiles_keep_the_loop(profiled):
    _, _, _, prof = profiled["sgd-momentum, accumulation"]
    again = remat.Profile.from_json(prof.to_json())
    assert (again.optimizer, again.optimizer_bytes, again.accumulation_steps) == ("SGD", prof.optimizer_bytes, 4)
    assert again.predict_peak({}) == prof.predict_peak({})


def test_the_optimizers_step_is_a_segment_and_can_set_the_peak():
    """Wide layers, a tiny batch: AdamW's step (foreach temporaries beside every gradient) is the step's peak,
    which a profile without it would miss under every plan."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(4)])
    x = torch.randn(2, 256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = remat.profile(model, x, optimizer=optimizer, warmup=0, repeat=1)
    for assignment in ({}, {b.name: "full" for b in prof.blocks}):
        timeline = prof.timeline(assignment)
        assert max(top for _, _, top in timeline) == timeline[-1][2] > max(top for _, _, top in timeline[:-1])
        remat.apply(
            model,
            remat.Plan(
                assignment={b.name: assignment.get(b.name, "keep") for b in prof.blocks},
                predicted_peak_bytes=0,
                predicted_overhead=0.0,
                baseline_peak_bytes=0,
                min_peak_bytes=0,
                budget_bytes=None,
                strategy="hand",
                model="Sequential",
            ),
        )
        measured = remat.measure(model, x, optimizer=optimizer, warmup=0, repeat=1).peak_bytes
        remat.remove(model)
        assert measured == prof.predict_peak(assignment)
