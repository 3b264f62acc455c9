"""remat.plan / apply / remove / auto: budgets met as measured, gradients untouched, all or nothing."""

import itertools
import json
import math

import pytest
import torch
from conftest import SMALL, assert_buffers_equal, assert_grads_equal, assert_state_equal, residual_chain, twin

import remat
from remat.core._state import capture
from remat.planning._budget import Unreachable
from remat.planning._solve import chain_of, solve
from remat.planning._synthetic import synthetic_profile
from remat.zoo import build


@pytest.fixture(scope="module")
def profiled():
    out = {}
    for name in ("gpt2", "llama"):
        zoo = build(name, **SMALL[name])
        out[name] = (zoo, remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, repeat=1, warmup=0))
    return out


def _grads_after_step(model, zoo):
    torch.manual_seed(7)
    model.zero_grad(set_to_none=True)
    remat.core._step.training_step(model, zoo.inputs, zoo.loss_fn)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_budgets_are_met_as_measured_with_identical_gradients(profiled, name):
    zoo, prof = profiled[name]
    reference = twin(zoo.model)
    _grads_after_step(reference, zoo)
    keys = list(zoo.model.state_dict())
    minimum = remat.plan(prof, 1.0).min_peak_bytes
    previous_peak = math.inf
    for budget in (0.9, 0.7, 0.5, minimum):
        if isinstance(budget, float) and budget * prof.baseline_peak_bytes < minimum:
            with pytest.raises(remat.RematError, match="below the lowest peak"):
                remat.plan(prof, budget)
            continue
        plan = remat.plan(prof, budget)
        assert plan.predicted_peak_bytes <= plan.budget_bytes
        assert plan.predicted_peak_bytes <= previous_peak  # smaller budget, never a larger peak
        previous_peak = plan.predicted_peak_bytes
        remat.apply(zoo.model, plan)
        assert list(zoo.model.state_dict()) == keys
        measured = remat.measure(zoo.model, zoo.inputs, zoo.loss_fn, warmup=0, repeat=1)
        assert measured.peak_bytes <= 1.02 * plan.budget_bytes, (budget, measured.peak_bytes, plan.budget_bytes)
        _grads_after_step(zoo.model, zoo)
        assert_grads_equal(reference, zoo.model)
        remat.remove(zoo.model)
        zoo.model.zero_grad(set_to_none=True)
    assert all(remat.is_wrapped(m) is None for m in zoo.model.modules())


def test_seed_cnn_budget_below_its_minimum_names_the_minimum():
    zoo = build("seed-cifar", batch=16)
    prof = remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, repeat=1, warmup=0)
    plan = remat.plan(prof, 1.0)
    assert plan.min_peak_bytes == prof.baseline_peak_bytes  # checkpointing cannot lower this CNN's peak
    assert plan.checkpointed == {}  # so the plan does not recompute for nothing
    assert "No plan lowers this model's peak" in plan.summary()
    # Unreachable, which remat.auto and remat.distributed.auto catch to profile again with full-fine
    with pytest.raises(Unreachable, match=rf"lowest peak .*\({plan.min_peak_bytes} bytes, 1.000"):
        remat.plan(prof, 0.9)


def test_solver_is_optimal_against_brute_force():
    for seed in range(4):
        prof = synthetic_profile(6, seed=seed, resting=0)
        chain = chain_of(prof)
        names = [b.name for b in prof.blocks]
        every = [dict(zip(names, combo)) for combo in itertools.product(prof.policies, repeat=len(names))]
        peaks = [prof.predict_peak(a) for a in every]
        times = [prof.predict_time(a) for a in every]
        for frac in (0.95, 0.8, 0.65):
            budget = min(peaks) + frac * (max(peaks) - min(peaks))
            best = min(t for t, p in zip(times, peaks) if p <= budget)
            picks, _ = solve(chain, budget)
            found = {n: chain.policies[j] for n, j in zip(chain.blocks, picks)}
            assert prof.predict_peak(found) <= budget
            assert prof.predict_time(found) <= best + 1e-9
        lowest, _ = solve(chain, math.inf, minimise_peak=True)
        lowest_plan = {n: chain.policies[j] for n, j in zip(chain.blocks, lowest)}
        assert prof.predict_peak(lowest_plan) == min(peaks)


def test_two_hundred_blocks_plan():
    prof = synthetic_profile(200)
    plan = remat.plan(prof, 0.6)
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert len(plan.assignment) == 200 and plan.checkpointed


@pytest.mark.parametrize(
    "budget, expected",
    [
        ("6GiB", 6 * 2**30),
        ("500MB", 5 * 10**8),
        ("0.5", 5 * 10**8),
        (0.5, 5 * 10**8),
        ("50%", 5 * 10**8),
        (1.0, 10**9),
        (1, 10**9),
        ("1", 10**9),
        ("100%", 10**9),
        (123456789, 123456789),
        ("123456789", 123456789),
        (6e9, 6 * 10**9),
        ("6e9", 6 * 10**9),
        (" 2 gib ", 2 * 2**30),
        ("1.5GiB", 3 * 2**29),
        ("4096B", 4096),
    ],
)
def test_budget_forms(budget, expected):
    assert remat.parse_budget(budget, baseline_bytes=10**9) == expected


@pytest.mark.parametrize(
    "budget, why",
    [
        (1.5, "ambiguous"),
        ("1.5", "ambiguous"),
        (2, "ambiguous"),
        ("1023", "ambiguous"),
        (1500.5, "ambiguous"),
        ("101%", "above 100%"),
        (0, "positive"),
        ("-1GB", "positive"),
        (float("inf"), "positive"),
        ("0.5 GiBs", "cannot be read"),
        ("5O%", "cannot be read"),
        ([0.5], "is a list"),
    ],
)
def test_ambiguous_budgets_are_refused_with_the_accepted_forms(budget, why):
    with pytest.raises(remat.RematError, match=why) as info:
        remat.parse_budget(budget, baseline_bytes=10**9)
    assert "'50%'" in str(info.value) and "'6GiB'" in str(info.value) and repr(budget) in str(info.value)


def test_same_number_same_budget_in_every_form():
    for forms in ([0.25, "0.25", "25%"], [1, 1.0, "1", "1.0", "100%"], [4096, 4096.0, "4096", "4096B", "4KiB"]):
        assert len({remat.parse_budget(f, 10**9) for f in forms}) == 1, forms


@pytest.mark.parametrize("budget", [0, -5, 1.5, "lots", "5 parsecs", True, None, "-1GB", float("nan")])
def test_bad_budgets_raise_and_leave_model_untouched(profiled, budget):
    zoo, prof = profiled["llama"]
    before = capture(zoo.model)
    with pytest.raises(remat.RematError, match="budget"):
        remat.plan(prof, budget)
    with pytest.raises(remat.RematError, match="budget"):
        remat.auto(zoo.model, zoo.inputs, budget, loss_fn=zoo.loss_fn, repeat=1, warmup=0)
    assert_state_equal(before, capture(zoo.model))
    assert all(remat.is_wrapped(m) is None for m in zoo.model.modules())
    assert zoo.model.config.use_cache is False  # the zoo builds for training; untouched either way


def test_plan_json_round_trip_and_validation(profiled):
    _, prof = profiled["gpt2"]
    plan = remat.plan(prof, 0.6)
    again = remat.Plan.from_json(plan.to_json())
    assert again == plan
    with pytest.raises(remat.RematError, match="schema"):
        remat.Plan.from_json(json.dumps({**json.loads(plan.to_json()), "schema": 7}))
    with pytest.raises(remat.RematError, match="not JSON"):
        remat.Plan.from_json("{")
    with pytest.raises(remat.RematError, match="unknown policies"):
        remat.Plan.from_json(plan.to_json().replace('"full"', '"sometimes"'))


def test_apply_is_all_or_nothing(profiled):
    zoo, prof = profiled["gpt2"]
    plan = remat.plan(prof, 0.6)
    bad = remat.Plan(**{**plan.__dict__, "assignment": {**plan.assignment, "transformer.h.99": "full"}})
    with pytest.raises(remat.RematError, match="does not have"):
        remat.apply(zoo.model, bad)
    assert all(remat.is_wrapped(m) is None for m in zoo.model.modules())


def test_hand_made_strategies(profiled):
    _, prof = profiled["llama"]
    names = [b.name for b in prof.blocks]
    assert remat.plan(prof, strategy="none").checkpointed == {}
    assert remat.plan(prof, strategy="all").checkpointed == {n: "full" for n in names}
    assert remat.plan(prof, strategy="every:2").checkpointed == {names[0]: "full", names[2]: "full"}
    optimal = remat.plan(prof, budget=remat.plan(prof, strategy="all").predicted_peak_bytes)
    assert optimal.predicted_overhead <= remat.plan(prof, strategy="all").predicted_overhead + 1e-12
    with pytest.raises(remat.RematError, match="unknown strategy"):
        remat.plan(prof, strategy="every:zero")


def test_auto_applies_and_remove_restores(profiled):
    zoo = build("llama", **SMALL["llama"])
    ref = twin(zoo.model)
    plan = remat.auto(zoo.model, zoo.inputs, 0.75, loss_fn=zoo.loss_fn, repeat=1, warmup=0)
    wrapped = {n for n, m in zoo.model.named_modules() if remat.is_wrapped(m)}
    assert wrapped == set(plan.checkpointed)
    _grads_after_step(ref, zoo)
    _grads_after_step(zoo.model, zoo)
    assert_grads_equal(ref, zoo.model)
    assert_buffers_equal(ref, zoo.model)
    remat.remove(zoo.model)
    assert not any(remat.is_wrapped(m) for m in zoo.model.modules())


@pytest.mark.parametrize("held", [False, True], ids=["no-grad", "held-grad"])
def test_auto_on_an_input_that_requires_grad_verifies_exactly_and_leaves_it_as_it_was(held):
    model = residual_chain()
    x = torch.randn(16, 32, 32, requires_grad=True)
    if held:
        x.grad = torch.randn_like(x)
    grad = x.grad
    values = None if grad is None else grad.clone()
    plan = remat.auto(model, x, 0.6, repeat=1, warmup=0)
    assert plan.checkpointed and plan.measured_peak_bytes == plan.predicted_peak_bytes <= plan.budget_bytes
    assert x.grad is grad and (grad is None or torch.equal(grad, values) and grad._version == 0)
    assert remat.measure(model, x, repeat=1).peak_bytes == plan.predicted_peak_bytes
    assert x.grad is grad and x.requires_grad and x._version == 0


def test_autocast_plans_fit_and_credit_released_casts():
    """Under autocast the chain's safe view keeps cached weight casts until backward; plans made
    crediting their release are checked with the exact peak model, so budgets still hold as measured,
    and they are never slower than the safe view's."""
    from remat.bench._gpu_truth import autocast_forward
    from remat.planning._solve import cast_credits

    zoo = build("llama", layers=6, hidden=128, intermediate=344, heads=4, kv_heads=2, vocab=256, seq=64, batch=2)
    autocast_forward(zoo.model, torch.bfloat16)
    prof = remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, repeat=1, warmup=0)
    assert len(cast_credits(prof)) > 1
    lowest, baseline = remat.plan(prof, strategy="all").min_peak_bytes, prof.baseline_peak_bytes
    for between in (0.6, 0.2):
        plan = remat.plan(prof, int(lowest + between * (baseline - lowest)))
        safe = solve(chain_of(prof), plan.budget_bytes)
        if safe is not None:
            safe_plan = {b: chain_of(prof).policies[j] for b, j in zip(chain_of(prof).blocks, safe[0])}
            assert prof.predict_time(plan.assignment) <= prof.predict_time(safe_plan) + 1e-12
        remat.apply(zoo.model, plan)
        try:
            measured = remat.measure(zoo.model, zoo.inputs, zoo.loss_fn, warmup=0, repeat=1).peak_bytes
        finally:
            remat.remove(zoo.model)
        assert plan.predicted_peak_bytes <= plan.budget_bytes and measured <= plan.budget_bytes
        assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * measured


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_budget_of_the_whole_peak_keeps_every_block(profiled, name):
    # The DP rounds live bytes up: keep-all, exactly at the budget, looked over it (NOTE [Rounding never costs time]).
    _, prof = profiled[name]
    for budget in (1.0, prof.baseline_peak_bytes):
        plan = remat.plan(prof, budget)
        assert plan.checkpointed == {} and plan.predicted_peak_bytes == prof.baseline_peak_bytes


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_no_checkpointed_block_could_be_kept_within_the_budget(profiled, name):
    _, prof = profiled[name]
    for fraction in (0.95, 0.85, 0.75):
        plan = remat.plan(prof, fraction, nested=False)
        for block in plan.checkpointed:
            kept = {**plan.assignment, block: "keep"}
            cheaper = prof.predict_time(kept) <= prof.predict_time(plan.assignment)
            assert prof.predict_peak(kept) > plan.budget_bytes or not cheaper, (fraction, block)
