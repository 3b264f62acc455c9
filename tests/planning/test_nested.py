"""Nested plans (issue #19): segments of blocks checkpointed as one region with a plan inside."""

from __future__ import annotations

import json
import logging
import math
import weakref
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

import remat
from remat.planning import _candidates as candidates_module
from remat.planning import _verify_step as step_module
from remat.planning import _within as within_module
from remat.planning import apply as apply_module
from remat.planning._nested import Costs, Node, costs_of, extra_time, simulate, solve_nested, to_plan
from remat.planning._nested_plan import lowest_nested
from remat.planning._solve import Chain
from remat.planning._synthetic import fixed_times


def conv_chain(channels: int = 8, n: int = 6, norm: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1)]
    for _ in range(n):
        layers.append(
            nn.Sequential(
                nn.Conv2d(channels, channels, 3, padding=1),
                nn.BatchNorm2d(channels) if norm else nn.Identity(),
                nn.ReLU(),
                nn.Dropout(0.1),
            )
        )
    return nn.Sequential(*layers)


#: Extra seconds per block under each policy: selective-ops the cheapest checkpointing, as it is on some machines.
SECONDS = {"keep": 0.0, "selective": 0.2, "selective-ops": 0.1, "full": 1.0, "full-fine": 1.5}


def test_nested_plans_keep_selective_blocks_out_of_segments_and_are_exact():
    # A selective block's cache outlives its segment's forward (NOTE [Selective caches inside a segment]):
    # with selective-ops cheap, the DP put it inside segments and the plans measured 4-10% over their walk.
    torch.manual_seed(0)
    model, x = conv_chain(norm=False), torch.randn(2, 3, 16, 16)
    prof = fixed_times(remat.profile(model, x, repeat=1, warmup=0), SECONDS)
    floor = remat.plan(prof, strategy="none").min_peak_bytes
    one_level = remat.plan(prof, strategy="none", nested=False).min_peak_bytes
    names, policies = [b.name for b in prof.blocks], set()
    for fraction in (0.25, 0.5, 0.75, 1.0):
        budget = int(floor + fraction * (one_level - 1 - floor))
        plan = remat.plan(prof, budget)
        inside = {n for first, last in plan.segments for n in names[names.index(first) : names.index(last) + 1]}
        remat.apply(model, plan)
        try:
            measured = remat.measure(model, x, repeat=1, warmup=1).peak_bytes
        finally:
            remat.remove(model)
        assert measured == plan.predicted_peak_bytes <= budget, (fraction, plan.assignment, plan.segments)
        assert plan.segments and not any(plan.assignment[n].startswith("selective") for n in inside), plan
        policies.update(plan.assignment.values())
    assert "selective-ops" in policies  # between segments


def _step(model: nn.Module, x: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(seed)
    out = model(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def chain_and_profile():
    torch.manual_seed(0)
    model = conv_chain()
    x = torch.randn(2, 3, 16, 16)
    return model, x, remat.profile(model, x)


def test_nested_plan_goes_below_the_one_level_floor(chain_and_profile):
    model, x, prof = chain_and_profile
    one_level = remat.plan(prof, strategy="none", nested=False).min_peak_bytes
    budget = int(one_level * 0.85)
    with pytest.raises(remat.RematError, match="below the lowest peak"):
        remat.plan(prof, budget, nested=False)
    plan = remat.plan(prof, budget)
    assert plan.segments and plan.predicted_peak_bytes <= budget
    assert plan.min_peak_bytes < one_level


def test_nested_plan_gradients_buffers_and_memory_match(chain_and_profile):
    model, x, prof = chain_and_profile
    torch.use_deterministic_algorithms(True)
    try:
        plain = conv_chain()
        plain.load_state_dict(model.state_dict())
        ref_out, ref_grads = _step(plain, x)
        keys = list(model.state_dict())
        plan = remat.plan(prof, int(remat.plan(prof, strategy="none", nested=False).min_peak_bytes * 0.85))
        twin = conv_chain()
        twin.load_state_dict(model.state_dict())
        calls = []
        twin[1][0].register_forward_hook(lambda *a: calls.append(1))
        remat.apply(twin, plan)
        out, grads = _step(twin, x)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(out, ref_out)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[k], ref_grads[k]) for k in grads)
    assert len(calls) >= 2  # block 1 sits in a segment: recomputed in backward
    for name, buf in plain.named_buffers():  # BatchNorm updated once
        assert torch.equal(buf, dict(twin.named_buffers())[name]), name
    assert list(twin.state_dict()) == keys
    measured = remat.measure(twin, x, repeat=1, warmup=1).peak_bytes
    assert measured <= plan.budget_bytes
    # Off by the region's copies of BatchNorm buffers (136 bytes a segment here): within 1%.
    assert abs(plan.predicted_peak_bytes - measured) <= 0.01 * measured
    remat.remove(twin)
    assert "forward" not in twin.__dict__ and not any("forward" in m.__dict__ for m in twin.modules())


def test_every_plan_and_the_cli_name_the_nested_floor(chain_and_profile):
    _, _, prof = chain_and_profile
    one_level = remat.plan(prof, strategy="none", nested=False).min_peak_bytes
    floor = remat.plan(prof, strategy="none").min_peak_bytes
    assert floor < one_level
    for plan in (remat.plan(prof, strategy="all"), remat.plan(prof, 0.9), remat.plan(prof, floor)):
        assert plan.min_peak_bytes == floor
    lowest = remat.plan(prof, floor)  # the floor is reachable, and it is the lowest: one byte less is refused
    assert lowest.segments and lowest.predicted_peak_bytes == floor
    with pytest.raises(remat.RematError, match=rf"lowest peak .*\({floor} bytes"):
        remat.plan(prof, floor - 1)
    assert remat.plan(prof, 0.9, nested=False).min_peak_bytes == one_level


def test_auto_falls_back_to_the_nested_floor(chain_and_profile, monkeypatch):
    model, x, prof = chain_and_profile
    floor = remat.plan(prof, strategy="none").min_peak_bytes
    seen: list = []

    budget = int(remat.plan(prof, strategy="none", nested=False).min_peak_bytes * 1.02)

    def measured(model, inputs, loss_fn, plan, backend=None, loop=None):  # noqa: ANN001, ANN202
        seen.append(plan)  # every plan but the lowest-peak one measures over the budget
        return step_module.Step(floor if plan.predicted_peak_bytes == floor else budget + 1)

    monkeypatch.setattr(candidates_module, "measured_step", measured)
    monkeypatch.setattr(apply_module, "make_profile", lambda *a, **k: prof)
    plan = remat.auto(model, x, budget)
    remat.remove(model)
    assert len(seen) >= 2 and plan is not seen[0]
    assert plan.segments and plan.predicted_peak_bytes == plan.measured_peak_bytes == floor < budget


class _Scaled(nn.Sequential):
    """A conv chain whose parent scales every block's output: a segment would hand on unscaled outputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self:
            x = module(x) * 1.0
        return x


class _ByKeyword(nn.Sequential):
    """A conv chain whose parent passes each output by keyword: the profile sees a chain, a segment cannot run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self:
            x = module(input=x)
        return x


def test_a_parent_that_reads_block_outputs_gets_no_nested_plan():
    torch.manual_seed(0)
    model, x = _Scaled(*conv_chain()), torch.randn(2, 3, 16, 16)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    assert prof.unchained == tuple(b.name for b in prof.blocks[:-1])  # the last block's output is the model's
    lowest = remat.plan(prof, strategy="none")
    assert lowest.min_peak_bytes == remat.plan(prof, strategy="none", nested=False).min_peak_bytes
    assert remat.Profile.from_json(prof.to_json()).unchained == prof.unchained


def test_auto_plans_one_level_deep_where_segments_cannot_run(monkeypatch, caplog):
    torch.manual_seed(0)
    model, x = _ByKeyword(*conv_chain()), torch.randn(2, 3, 16, 16)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    # the profile sees each block handed another tensor by keyword (NOTE [Arguments a segment hands on]): its view
    # is the first guard, and this test is of the run-time one, so the profile is made to see a chain
    assert prof.new_arguments == tuple(b.name for b in prof.blocks[1:])
    prof = replace(prof, new_arguments=())
    one_level = remat.plan(prof, strategy="none", nested=False).min_peak_bytes
    assert remat.plan(prof, strategy="none").min_peak_bytes < one_level  # auto's last resort is nested
    real, seen = step_module.measured_step, []

    def measured(model, inputs, loss_fn, plan, backend=None, loop=None):  # noqa: ANN001, ANN202
        seen.append(plan.segments)  # plans above the one-level floor measure 1 MiB over: only the lowest is left
        step = real(model, inputs, loss_fn, plan, backend, loop)
        return replace(step, peak=step.peak + (2**20 if plan.predicted_peak_bytes > one_level else 0))

    monkeypatch.setattr(candidates_module, "measured_step", measured)
    monkeypatch.setattr(apply_module, "make_profile", lambda *a, **k: prof)
    monkeypatch.setattr(within_module, "make_profile", lambda *a, **k: prof)  # the fake profile below the peak
    with caplog.at_level(logging.INFO, logger="remat"):
        plan = remat.auto(model, x, (one_level + prof.baseline_peak_bytes) // 2)
    # Said once, in remat's words: the model did nothing wrong (no "fix the error", no internal traceback).
    said = [r for r in caplog.records if "one level deep" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO and "fix the error" not in said[0].getMessage()
    try:
        assert any(seen) and plan.segments == () and plan.measured_peak_bytes == one_level
        assert any("keyword arguments only" in n and "planned one level deep" in n for n in plan.notes)
        assert any("lowest-peak plan fits" in n for n in plan.notes)
    finally:
        remat.remove(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_plan_json_keeps_segments_and_reads_schema_2(chain_and_profile):
    _, _, prof = chain_and_profile
    plan = remat.plan(prof, int(remat.plan(prof, strategy="none", nested=False).min_peak_bytes * 0.85))
    assert remat.Plan.from_json(plan.to_json()) == plan
    old = json.loads(plan.to_json())
    old["schema"] = 2
    del old["segments"]
    assert remat.Plan.from_json(json.dumps(old)).segments == ()


class _Loop(nn.Module):
    """Blocks in a ModuleList, called in the parent's loop with a shared extra argument (as Hugging Face does)."""

    def __init__(self, residual_in_parent: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Gated() for _ in range(4))
        self.residual_in_parent = residual_in_parent

    def forward(self, x):
        gate = x.mean(dim=0).sigmoid()
        for layer in self.layers:
            x = layer(x, gate=gate) + x if self.residual_in_parent else layer(x, gate=gate)
        return x


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(16, 16), nn.Dropout(0.2)

    def forward(self, x, gate):
        return self.drop(self.lin(x).tanh() * gate)


def _loop_plan(segments, model="_Loop"):
    names = [f"layers.{i}" for i in range(4)]
    return remat.Plan(
        {n: "keep" for n in names} | {"layers.3": "full", "layers.1": "full"},
        1,
        0.0,
        1,
        1,
        None,
        "optimal",
        model,
        segments=segments,
    )


def test_segments_over_a_module_list_loop_match_gradients():
    torch.manual_seed(0)
    ref = _Loop()
    model = _Loop()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(8, 16)
    ref_out, ref_grads = _step(ref, x)
    remat.apply(model, _loop_plan((("layers.0", "layers.3"), ("layers.0", "layers.1"))))
    out, grads = _step(model, x)
    assert torch.equal(out, ref_out)  # dropout replayed in every recomputation
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    remat.remove(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_nested_plan_holds_no_argument_past_its_step_and_pickles_with_the_model():
    import gc
    import pickle
    import weakref

    torch.manual_seed(0)
    ref, model = _Loop(), _Loop()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(8, 16)
    remat.apply(model, _loop_plan((("layers.0", "layers.3"), ("layers.0", "layers.1"))))
    gates: list = []
    hook = model.layers[0].register_forward_pre_hook(
        lambda m, args, kwargs: gates.append(weakref.ref(kwargs["gate"])), with_kwargs=True
    )
    _step(model, x)
    hook.remove()
    gc.collect()
    assert gates and gates[-1]() is None  # the segment's check of the next call keeps no tensor alive
    loaded = pickle.loads(pickle.dumps(model))  # torch.save(model) pickles it so
    recomputed: list = []
    loaded.layers[2].lin.register_forward_hook(lambda *_: recomputed.append(remat.is_recomputing()))
    out, grads = _step(loaded, x)
    ref_out, ref_grads = _step(ref, x)
    assert torch.equal(out, ref_out) and all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    assert recomputed == [False, True]  # the loaded copy runs its plan
    remat.remove(model)


def test_a_parent_that_does_not_chain_its_blocks_is_refused():
    model = _Loop(residual_in_parent=True)
    remat.apply(model, _loop_plan((("layers.0", "layers.1"),)))
    with pytest.raises(remat.RematError, match="not a chain"):
        model(torch.randn(8, 16))
    remat.remove(model)
    with pytest.raises(remat.RematError, match="two or more blocks"):
        remat.apply(model, _loop_plan((("layers.0", "layers.2"), ("layers.1", "layers.3"))))
    assert not any("forward" in m.__dict__ for m in model.modules())


class _TupleLoop(nn.Module):
    """Blocks returning tuples, the parent handing ``out[0]`` on (Hugging Face blocks in transformers 4.x)."""

    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_TupleGated(extra) for _ in range(4))

    def forward(self, x):
        gate = x.mean(dim=0).sigmoid()
        for layer in self.layers:
            out = layer(x, gate=gate)
            x = out[0]
        return out


class _TupleGated(_Gated):
    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.extra, self.calls = extra, 0

    def forward(self, x, gate):
        self.calls += 1
        h = super().forward(x, gate)
        return (h, h.detach().mean() if self.extra else None, None)


def test_segments_over_blocks_returning_tuples_match_gradients():
    torch.manual_seed(0)
    ref, model = _TupleLoop(), _TupleLoop()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(8, 16)

    def step(m):
        torch.manual_seed(0)
        out = m(x)
        out[0].square().sum().backward()
        return out, {n: p.grad.clone() for n, p in m.named_parameters()}

    ref_out, ref_grads = step(ref)
    remat.apply(model, _loop_plan((("layers.0", "layers.3"), ("layers.0", "layers.1")), "_TupleLoop"))
    out, grads = step(model)
    assert out[1:] == (None, None) and torch.equal(out[0], ref_out[0])  # the last block's tuple, as without remat
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    assert all(layer.calls > 1 for layer in model.layers)  # recomputed in backward (one call each without remat)
    remat.remove(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_blocks_returning_another_tensor_beside_the_hidden_state_are_refused():
    model = _TupleLoop(extra=True)
    remat.apply(model, _loop_plan((("layers.0", "layers.1"),), "_TupleLoop"))
    with pytest.raises(remat.RematError, match="tuple of 3, not a tensor"):
        model(torch.randn(8, 16))
    remat.remove(model)


def test_plan_offers_no_segment_over_blocks_returning_another_tensor():
    # transformers 4.x's BERT layers return (hidden, attention weights): remat.plan must not offer a
    # segment that remat.apply then refuses at the first step
    model, x = _TupleLoop(extra=True), torch.randn(8, 16)
    prof = remat.profile(model, x, lambda out: out[0].square().mean(), repeat=1, warmup=0)
    assert set(prof.unchained) == {"layers.0", "layers.1", "layers.2"}  # the last one feeds the head
    floor = remat.plan(prof, 1.0).min_peak_bytes  # without the fix: a nested floor below the one-level one
    plan = remat.plan(prof, floor)
    assert not plan.segments
    remat.apply(model, plan)
    try:
        model(x)[0].sum().backward()
    finally:
        remat.remove(model)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_nested_plans_on_the_zoo_are_exact(name):
    from remat.planning._nested import costs_of, simulate, to_plan
    from remat.zoo import build

    sizes = dict(layers=4, hidden=64, heads=4, vocab=256, batch=2, seq=32)
    zoo = build(name, **sizes, **({"intermediate": 128} if name == "llama" else {}))
    prof = remat.profile(zoo.model, zoo.inputs)
    c = costs_of(prof)
    keep = c.chain.policies.index("keep")
    nodes = (Node(0, end=4, children=(Node(0, end=2, children=(Node(0, keep),)), Node(2, keep))),)
    assignment, segments = to_plan(c, nodes)
    plan = remat.Plan(
        {b.name: assignment[b.name] for b in prof.blocks},
        simulate(c, nodes),
        0.0,
        prof.baseline_peak_bytes,
        0,
        None,
        "optimal",
        type(zoo.model).__name__,
        segments=segments,
    )
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        zoo.model(**zoo.inputs).loss.backward()
        ref = {n: p.grad.clone() for n, p in zoo.model.named_parameters()}
        zoo.model.zero_grad(set_to_none=True)
        remat.apply(zoo.model, plan)
        torch.manual_seed(0)
        zoo.model(**zoo.inputs).loss.backward()
        assert all(torch.equal(p.grad, ref[n]) for n, p in zoo.model.named_parameters())
    finally:
        torch.use_deterministic_algorithms(False)
    measured = remat.measure(zoo.model, zoo.inputs, repeat=1, warmup=1).peak_bytes
    assert abs(plan.predicted_peak_bytes - measured) <= 0.01 * measured
    assert plan.predicted_peak_bytes < prof.baseline_peak_bytes


# -- the DP against brute force ------------------------------------------------------------------


def _synthetic(n: int, seed: int) -> Costs:
    rng = np.random.default_rng(seed)
    out = rng.integers(50, 150, n)
    act = rng.integers(100, 400, n)
    grads = rng.integers(0, 30, n)
    prev = np.concatenate([[0], out[:-1]])
    # policies: keep (index 0), full (index 1)
    fwd_delta = np.stack([out + act, out], axis=1)
    fwd_peak = np.stack([out + act + rng.integers(0, 50, n), out + act // 2], axis=1)
    bwd_delta = np.stack([-(act + prev) + grads, -prev + grads], axis=1)
    bwd_peak = np.stack([out + rng.integers(0, 40, n), out + act + rng.integers(0, 40, n)], axis=1)
    extra = np.stack([np.zeros(n), rng.uniform(1, 2, n)], axis=1)
    chain = Chain(
        [str(i) for i in range(n)],
        ["keep", "full"],
        fwd_delta,
        fwd_peak,
        bwd_peak,
        np.zeros(n, np.int64),
        np.array([20, 20]),
        np.array([40, 40]),
        1000,
        1000,
        extra,
        bwd_delta,
    )
    return Costs(chain, out, rng.uniform(0.5, 1.0, n), 1)


def _all_plans(s: int, stop: int, inside: bool) -> list[tuple[Node, ...]]:
    """Every nested plan of blocks s..stop-1 (segments end before ``stop``)."""
    if s == stop:
        return [()]
    plans = [(Node(s, j), *rest) for j in (0, 1) for rest in _all_plans(s + 1, stop, inside)]
    for k in range(s + 2, stop + 1):
        for children in _all_plans(s, k - 1, True):
            plans += [(Node(s, end=k, children=children), *rest) for rest in _all_plans(k, stop, inside)]
    return plans


@pytest.mark.parametrize("seed", range(4))
def test_nested_dp_is_optimal_against_brute_force(seed):
    c = _synthetic(5, seed)
    plans = _all_plans(0, 5, False)
    peaks = [simulate(c, p) for p in plans]
    for budget in np.linspace(min(peaks), max(peaks), 7).astype(int):
        fits = [extra_time(c, p) for p, peak in zip(plans, peaks) if peak <= budget]
        found = solve_nested(c, int(budget))
        if found is not None:  # every plan it returns fits, and none that fits is faster
            assert simulate(c, found[0]) <= budget
            assert found[1] >= min(fits) - 1e-9
        # rounding costs at most one grid cell per block and per segment level
        slack = solve_nested(c, int(budget * 1.05) + 1)
        if fits:
            assert slack is not None and slack[1] <= min(fits) + 1e-9
        assert math.isfinite(found[1]) if found is not None else True


@pytest.mark.parametrize("seed", range(6))
def test_nested_floor_is_the_lowest_peak_of_all_plans(seed):
    c = _synthetic(5, seed)
    plans = _all_plans(0, 5, False)
    peaks = [simulate(c, p) for p in plans]
    floor, nodes = lowest_nested(c, max(peaks))
    assert floor == simulate(c, nodes) == min(peaks)
    one_level = min(peak for p, peak in zip(plans, peaks) if all(node.end is None for node in p))
    assert floor <= one_level


@pytest.mark.parametrize("seed", range(6))
def test_the_floor_plan_is_the_fastest_at_its_peak(seed):
    c = _synthetic(5, seed)
    plans = _all_plans(0, 5, False)
    floor, nodes = lowest_nested(c, 10**12)
    at_floor = [extra_time(c, p) for p in plans if simulate(c, p) <= floor]
    assert extra_time(c, nodes) <= min(at_floor) + 1e-9


@pytest.mark.parametrize("blocks", [12, 40])
def test_no_plan_at_any_budget_is_below_the_floor(blocks):
    # Regression: the floor was once searched over tables, one per budget, and on a 12-block synthetic chain
    # stopped at 0.961 of the baseline while the table at 0.6 of it held a plan at 0.583.
    from remat.planning._nested import costs_of
    from remat.planning._nested_plan import nested_floor
    from remat.planning._synthetic import synthetic_profile

    prof = synthetic_profile(blocks)
    c = costs_of(prof)
    assert c is not None  # 40 blocks: nested plans go past the old limit of 24
    floor = nested_floor(prof)[0]
    for fraction in np.linspace(0.3, 1.0, 15):
        found = solve_nested(c, int(fraction * prof.baseline_peak_bytes))
        if found is not None:
            assert simulate(c, found[0]) >= floor
    plan = remat.plan(prof, floor)
    assert plan.predicted_peak_bytes <= floor and plan.min_peak_bytes == floor


def test_blocks_that_write_their_input_stay_out_of_segments_and_plans_are_exact():
    # Every block begins with ReLU(inplace=True): each region around it keeps its own copy of the input it
    # writes (NOTE [Inputs written in place inside a segment]). The nested floor's plan put them in segments
    # and measured 17% over its prediction; now no segment, and every plan is exact, gradients too.
    torch.manual_seed(0)

    def block() -> nn.Module:
        return nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4))

    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), *(block() for _ in range(6)), nn.Flatten(), nn.Linear(256, 10))
    x = torch.randn(8, 3, 8, 8)
    reference = _step(model, x)[1]
    model.zero_grad(set_to_none=True)
    prof = remat.profile(model, x, repeat=1, warmup=0, policies=("keep", "selective", "selective-ops", "full"))
    assert all(b.writes_input for b in prof.blocks) and "write their input in place" in prof.notes[-1]
    floor = remat.plan(prof, strategy="none").min_peak_bytes
    for budget in (floor, (floor + prof.baseline_peak_bytes) // 2, prof.baseline_peak_bytes):
        plan = remat.plan(prof, budget)
        remat.apply(model, plan)
        try:
            assert all(torch.equal(g, reference[n]) for n, g in _step(model, x)[1].items())
            model.zero_grad(set_to_none=True)
            assert remat.measure(model, x, repeat=1, warmup=1).peak_bytes == plan.predicted_peak_bytes, plan
        finally:
            remat.remove(model)
        assert plan.segments == ()


class _SharedBias(nn.Module):
    """Blocks adding in one tensor the parent computes once (a bias, a mask): kept blocks do not save it."""

    def __init__(self, d: int = 8, n: int = 4) -> None:
        super().__init__()
        self.embed, self.bias = nn.Linear(d, d), nn.Linear(d, 2 * d)
        self.blocks = nn.ModuleList(_BiasBlock(d) for _ in range(n))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, shared = self.embed(x), self.bias(x)
        for block in self.blocks:
            h = block(h, shared)
        return self.head(h).logsumexp(-1).mean()


class _BiasBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x) + shared))


def _grads(model: nn.Module, x: torch.Tensor) -> dict:
    torch.manual_seed(0)
    model(x).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def test_a_tensor_every_block_of_a_segment_receives_is_held_by_the_segment():
    # The segment holds the shared tensor among its inputs until its backward; the keep run a later kept block
    # is taken from frees it after the last forward (NOTE [Storages handed to a segment from outside]): the
    # floor's plan measured one shared tensor over its budget.
    from remat.planning._nested import costs_of, simulate, to_plan

    torch.manual_seed(0)
    model, x = _SharedBias(), torch.randn(4, 64, 8)
    reference = _grads(model, x)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    c = costs_of(prof)
    keep, full = c.chain.policies.index("keep"), c.full
    hand = [
        (Node(0, end=2, children=(Node(0, full),)), Node(2, full), Node(3, keep)),
        (Node(0, keep), Node(1, end=3, children=(Node(1, keep),)), Node(3, keep)),
        (Node(0, end=4, children=(Node(0, end=2, children=(Node(0, keep),)), Node(2, full))),),
    ]
    plans = [remat.plan(prof, remat.plan(prof, strategy="none").min_peak_bytes)]
    for nodes in hand:
        assignment, segments = to_plan(c, nodes)
        order = {b.name: assignment[b.name] for b in prof.blocks}
        plans.append(replace(plans[0], assignment=order, segments=segments, predicted_peak_bytes=simulate(c, nodes)))
    assert plans[0].segments
    for plan in plans:
        remat.apply(model, plan)
        try:
            measured = remat.measure(model, x, repeat=1, warmup=0).peak_bytes
            assert measured == plan.predicted_peak_bytes, (plan.assignment, plan.segments)
            assert all(torch.equal(g, reference[n]) for n, g in _grads(model, x).items())
        finally:
            remat.remove(model)


class _SomeGetBias(_SharedBias):
    """Only blocks 1 and 2 get the shared tensor: a segment running block 1 with block 0's arguments cannot."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, shared = self.embed(x), self.bias(x)
        for k, block in enumerate(self.blocks):
            h = block(h, shared) if k in (1, 2) else block(h)
        return self.head(h).logsumexp(-1).mean()


class _MaybeBiasBlock(_BiasBlock):
    def forward(self, x: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc1(x)
        return x + self.fc2(nn.functional.gelu(h if shared is None else h + shared))


def _some_get_bias() -> _SomeGetBias:
    model = _SomeGetBias()
    model.blocks = nn.ModuleList(_MaybeBiasBlock(8) for _ in range(4))
    return model


def test_a_segment_over_blocks_called_with_other_arguments_is_refused_and_never_planned():
    # A segment runs every block with its first block's other arguments: block 1 raised TypeError on block 0's
    # (none) before remat's own check saw the parent's call; now remat refuses, and never plans such a segment.
    from remat.planning._nested import costs_of, to_plan

    torch.manual_seed(0)
    model, x = _some_get_bias(), torch.randn(4, 64, 8)
    reference = _grads(model, x)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    c = costs_of(prof)
    assert c.same_args.tolist() == [True, False, True, False]
    full, none = c.full, remat.plan(prof, strategy="none")
    for first in (0, 2):  # block 1 run with block 0's arguments raises; block 3 with block 2's computes others
        nodes = tuple(
            Node(first, end=first + 2, children=(Node(first, full),)) if k == first else Node(k, full)
            for k in range(4)
            if k != first + 1
        )
        assignment, segments = to_plan(c, nodes)
        plan = replace(none, assignment={b.name: assignment[b.name] for b in prof.blocks}, segments=segments)
        state = {n: t.clone() for n, t in model.state_dict().items()}
        remat.apply(model, plan)
        try:
            with pytest.raises(remat.RematError, match="nested=False"):
                _grads(model, x)
        finally:
            remat.remove(model)
        assert all(torch.equal(t, state[n]) for n, t in model.state_dict().items())
        model.zero_grad(set_to_none=True)
    floor = none.min_peak_bytes
    for budget in (floor, (floor + prof.baseline_peak_bytes) // 2):
        plan = remat.plan(prof, budget)
        names = [b.name for b in prof.blocks]
        for a, b in plan.segments:  # a segment starting at block 1 may hold block 2 (both get the tensor)
            assert (names.index(a), names.index(b)) in {(1, 2)}, plan.segments
        remat.apply(model, plan)
        try:
            assert all(torch.equal(g, reference[n]) for n, g in _grads(model, x).items())
            measured = remat.measure(model, x, repeat=1, warmup=0).peak_bytes
            assert measured <= plan.predicted_peak_bytes <= budget, (plan.assignment, plan.segments)
        finally:
            remat.remove(model)


class _KeywordBlock(_BiasBlock):
    def forward(self, x: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class _SomeGetKeyword(nn.Module):
    """A diffusers down block: its resnets are called ``resnet(h, temb=None)``, its downsamplers ``down(h)``."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(d, d), nn.Linear(d, 10)
        self.blocks = nn.ModuleList(_KeywordBlock(d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for k, block in enumerate(self.blocks):
            h = block(h, temb=None) if k < 2 else block(h)
        return self.head(h).logsumexp(-1).mean()


def test_blocks_called_with_other_non_tensor_arguments_share_no_planned_segment():
    # NOTE [Arguments a segment hands on]: the profile records how each block is called beyond tensors; a plan
    # once held blocks 1..2 in one segment, which the first step refused (NotAChain), and auto's floor was a lie
    from remat.planning._nested import costs_of

    torch.manual_seed(0)
    model, x = _SomeGetKeyword(), torch.randn(4, 64, 8)
    reference = _grads(model, x)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    assert prof.new_arguments == ("blocks.2",)
    assert costs_of(prof).same_args.tolist() == [True, True, False, True]
    assert remat.Profile.from_json(prof.to_json()).new_arguments == ("blocks.2",)
    floor = remat.plan(prof, strategy="none").min_peak_bytes
    for budget in (floor, (floor + prof.baseline_peak_bytes) // 2):
        plan = remat.plan(prof, budget)
        names = [b.name for b in prof.blocks]
        assert all(names.index(a) >= 2 or names.index(b) < 2 for a, b in plan.segments), plan.segments
        remat.apply(model, plan)
        try:
            assert all(torch.equal(g, reference[n]) for n, g in _grads(model, x).items())
            assert remat.measure(model, x, repeat=1, warmup=0).peak_bytes <= plan.predicted_peak_bytes <= budget
        finally:
            remat.remove(model)


class _ReturnsMore(_BiasBlock):
    """Returns its hidden state with a None and a number: a tuple a segment cannot hand on."""

    def forward(self, x: torch.Tensor) -> tuple:
        return x + self.fc2(nn.functional.gelu(self.fc1(x))), None, 3


class _SlicesPositions(nn.Module):
    """Hands each block a view of its positions made for that call (``self.pos[:n]``): the same storage, another
    tensor each time. ``returns_more``: its blocks return ``(hidden, None, 3)`` instead."""

    def __init__(self, returns_more: bool, d: int = 8) -> None:
        super().__init__()
        self.returns_more = returns_more
        self.blocks = nn.ModuleList((_ReturnsMore if returns_more else _KeywordBlock)(d) for _ in range(4))
        self.pos, self.head = nn.Parameter(torch.randn(64, d)), nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.returns_more:
                x, _, _ = block(x)
            else:
                x = block(x, temb=self.pos[: x.shape[1]])
        return self.head(x).logsumexp(-1).mean()


@pytest.mark.parametrize("returns_more", [False, True], ids=["a view per call", "a tuple of three"])
def test_the_floor_holds_no_segment_the_parent_cannot_run(returns_more):
    # The floor and its plan held segments remat.apply then refused (the parent's calls differ by tensor identity;
    # a tuple with a number in it is no hand-off), so auto could not reach the floor it named.
    torch.manual_seed(0)
    model, x = _SlicesPositions(returns_more), torch.randn(4, 64, 8)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    floor = remat.plan(prof, strategy="none").min_peak_bytes
    assert floor == remat.plan(prof, strategy="none", nested=False).min_peak_bytes
    plan = remat.plan(prof, floor)
    assert not plan.segments
    remat.apply(model, plan)
    try:
        assert remat.measure(model, x, repeat=1, warmup=0).peak_bytes <= plan.predicted_peak_bytes
    finally:
        remat.remove(model)


class _ScaledCalls(nn.Module):
    """Calls each block through ``torch.func.functional_call`` with its weights scaled for the call."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_KeywordBlock(d) for _ in range(4))
        self.scale, self.head = nn.Parameter(torch.tensor(1.03)), nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.func.functional_call(block, {k: v * self.scale for k, v in block.named_parameters()}, (x,))
        return self.head(x).logsumexp(-1).mean()


def test_blocks_called_with_other_weights_get_no_segment_and_a_hand_made_one_refuses():
    # NOTE [Blocks called with other weights] in remat.core._segment: a segment ran its later blocks with their own
    # weights, before the parent put the scaled ones in: the gradient of the scale was wrong (0.28 off).
    torch.manual_seed(0)
    model, x = _ScaledCalls(), torch.randn(4, 64, 8)
    reference = _grads(model, x)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    floor = remat.plan(prof, strategy="none").min_peak_bytes
    assert floor == remat.plan(prof, strategy="none", nested=False).min_peak_bytes
    assert not remat.plan(prof, floor).segments
    none = remat.plan(prof, strategy="none", nested=False)
    hand = replace(none, assignment={**none.assignment, "blocks.2": "full"}, segments=(("blocks.0", "blocks.2"),))
    remat.apply(model, hand)
    try:
        with pytest.raises(remat.RematError, match="other parameters or buffers than its own"):
            _grads(model, x)
    finally:
        remat.remove(model)
    model.zero_grad(set_to_none=True)
    remat.apply(model, remat.plan(prof, floor))
    try:
        assert all(torch.equal(g, reference[n]) for n, g in _grads(model, x).items())
    finally:
        remat.remove(model)


class _Residual(nn.Module):
    def __init__(self, d: int = 8, relu_first: bool = False) -> None:
        super().__init__()
        self.pre = nn.ReLU(inplace=True) if relu_first else nn.Identity()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class _ResidualChain(nn.Module):
    def __init__(self, writers: tuple[int, ...] = (), n: int = 4, d: int = 8) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(d, d), nn.Linear(d, 10)
        self.blocks = nn.ModuleList(_Residual(d, k in writers) for k in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).logsumexp(-1).mean()


def _hand_made(model: nn.Module, x: torch.Tensor, prof: remat.Profile, shapes: list) -> list[tuple[int, int]]:
    """(predicted, measured) of each hand-made nested plan ``shapes`` (functions of the Costs), gradients checked."""
    from remat.planning._nested import costs_of, simulate, to_plan

    reference = _grads(model, x)
    c, none, out = costs_of(prof), remat.plan(prof, strategy="none"), []
    for shape in shapes:
        nodes = shape(c, c.chain.policies.index)
        assignment, segments = to_plan(c, nodes)
        order = {b.name: assignment[b.name] for b in prof.blocks}
        plan = replace(none, assignment=order, segments=segments, predicted_peak_bytes=simulate(c, nodes))
        remat.apply(model, plan)
        try:
            assert all(torch.equal(g, reference[n]) for n, g in _grads(model, x).items())
            out.append((plan.predicted_peak_bytes, remat.measure(model, x, repeat=1, warmup=0).peak_bytes))
        finally:
            remat.remove(model)
    return out


def test_a_hand_made_selective_block_inside_a_segment_is_predicted_safe():
    # The planner keeps selective blocks out of segments (their cache outlives the segment's forward: NOTE
    # [Selective caches inside a segment]); a plan made by hand was predicted one cache under the measured
    # peak. Now never under, over by at most one cache per forward of the block before its last.
    torch.manual_seed(0)
    model, x = _ResidualChain(), torch.randn(4, 64, 8)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    cache = 4 * 64 * (16 + 8) * 4  # selective saves fc1's and fc2's outputs
    one_level = [
        lambda c, p: (Node(0, end=2, children=(Node(0, p("selective")),)), Node(2, p("keep")), Node(3, p("keep"))),
        lambda c, p: (Node(0, end=2, children=(Node(0, p("selective-ops")),)), Node(2, c.full), Node(3, c.full)),
    ]
    deeper = [
        lambda c, p: (Node(0, p("keep")), Node(1, end=4, children=(Node(1, p("selective")), Node(2, c.full)))),
        lambda c, p: (
            Node(0, end=4, children=(Node(0, end=2, children=(Node(0, p("selective-ops")),)), Node(2, p("keep")))),
        ),
    ]
    for predicted, measured in _hand_made(model, x, prof, one_level):
        assert measured <= predicted <= measured + cache
    for predicted, measured in _hand_made(model, x, prof, deeper):
        assert measured <= predicted <= measured + 2 * cache


def test_a_hand_made_segment_over_a_block_writing_its_input_is_predicted_safe():
    # The planner begins and ends no segment at a block that writes its input (nor before one: NOTE [Inputs
    # written in place inside a segment]); a plan made by hand was predicted one input under. Now never under,
    # and over by at most one input per region holding the writer and two more.
    torch.manual_seed(0)
    model, x = _ResidualChain(writers=(1,)), torch.randn(4, 64, 8)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    assert [b.writes_input for b in prof.blocks] == [False, True, False, False]
    shapes = [
        lambda c, p: (Node(0, end=2, children=(Node(0, c.full),)), Node(2, p("keep")), Node(3, p("keep"))),
        lambda c, p: (Node(0, end=3, children=(Node(0, p("keep")), Node(1, p("keep")))), Node(3, p("keep"))),
        lambda c, p: (Node(0, p("keep")), Node(1, end=3, children=(Node(1, c.full),)), Node(3, p("keep"))),
        lambda c, p: (Node(0, end=4, children=(Node(0, p("keep")), Node(1, end=3, children=(Node(1, c.full),)))),),
    ]
    activation = 4 * 64 * 8 * 4
    for predicted, measured in _hand_made(model, x, prof, shapes):
        assert measured <= predicted <= measured + 3 * activation


class _Halving(_Residual):
    """Halves its input in place first: unlike ReLU(inplace=True), running it twice gives another value."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


def test_a_hand_made_segment_over_a_block_halving_its_input_trains_the_same_function():
    # A block checkpointed inside a segment is handed its input by the segment's recomputation, after the block's
    # own write there; it recomputes from its copy of the value before (NOTE [A write after a call inside a
    # recomputation] in remat.core._nested_writes). Before, it recomputed from the halved input: wrong gradients.
    torch.manual_seed(0)
    model, x = _ResidualChain(), torch.randn(4, 64, 8)
    model.blocks[1] = _Halving()
    prof = remat.profile(model, x, repeat=1, warmup=0)
    assert [b.writes_input for b in prof.blocks] == [False, True, False, False]
    shapes = [
        lambda c, p: (Node(0, p("keep")), Node(1, end=3, children=(Node(1, c.full),)), Node(3, p("keep"))),
        lambda c, p: (Node(0, end=4, children=(Node(0, c.full), Node(1, end=3, children=(Node(1, c.full),)))),),
    ]
    for predicted, measured in _hand_made(model, x, prof, shapes):  # gradients bit-equal, checked inside
        assert measured <= predicted


class _SkipOverTwo(nn.Module):
    """Blocks in a ModuleList, the last one also given the output two blocks back (a skip): a segment over
    layers.0..layers.1 would hand the skip its own output in place of layers.0's."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Residual(16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [x]
        for k, layer in enumerate(self.layers):
            outs.append(layer(outs[-1] + outs[-2] if k == 2 else outs[-1]))
        return outs[-1].square().mean()


def test_a_hand_made_segment_over_a_block_whose_output_the_parent_reads_is_refused():
    torch.manual_seed(0)
    model, x = _SkipOverTwo(), torch.randn(4, 16)
    prof = remat.profile(model, x, loss_fn=lambda out: out, repeat=1, warmup=0)
    assert "layers.0" in prof.unchained and "layers.1" in prof.unchained
    assert not remat.plan(prof, strategy="none").segments  # the planner never makes one
    none = remat.plan(prof, strategy="none")
    plan = replace(none, assignment={"layers.0": "full", "layers.1": "full", "layers.2": "keep"})
    assert plan.unchained == prof.unchained and remat.Plan.from_json(plan.to_json()) == plan
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(remat.RematError, match=r"layers\.0.*nested=False") as refused:
        remat.apply(model, replace(plan, segments=(("layers.0", "layers.1"),)))
    assert "read outside the next block" in str(refused.value)
    assert not any("forward" in m.__dict__ for m in model.modules())  # left as it was
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    ref_loss, ref_grads = model(x), None
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    remat.apply(model, plan)  # the same blocks one level deep: exact
    try:
        loss = model(x)
        loss.backward()
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(p.grad, ref_grads[n]) for n, p in model.named_parameters())
    finally:
        remat.remove(model)


class _ViewBlock(_Residual):
    """A residual block ending in a BatchNorm between transposes: its output is a transposed view, of which the
    next block's Linear saves a contiguous copy rather than the output itself."""

    def __init__(self, d: int = 8) -> None:
        super().__init__(d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(super().forward(x).transpose(1, 2)).transpose(1, 2)


class _KeepsAll(nn.Module):
    """The parent keeps every block's output in a list (as for skips it may take) until its forward returns."""

    def __init__(self, first: int) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(8, 8), nn.Linear(8, 10)
        self.blocks = nn.ModuleList(_ViewBlock() if k == first else _Residual() for k in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [self.embed(x)]
        for block in self.blocks:
            outs.append(block(outs[-1]))
        return self.head(outs[-1]).logsumexp(-1).mean()


@pytest.mark.parametrize(("view", "segment"), [(0, (0, 3)), (1, (0, 3)), (0, (1, 2))])
def test_a_segment_over_or_after_a_view_output_the_parent_keeps_is_predicted_safe(view, segment):
    torch.manual_seed(0)
    model, x = _KeepsAll(view), torch.randn(4, 64, 8)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    c = costs_of(prof)
    full, keep = c.chain.policies.index("full"), c.chain.policies.index("keep")
    lo, hi = segment[0], segment[0] + segment[1]
    nodes = (
        *(Node(k, full) for k in range(lo)),
        Node(lo, end=hi, children=tuple(Node(k, full) for k in range(lo, hi - 1))),
        *(Node(k, keep) for k in range(hi, 4)),
    )
    assignment, segments = to_plan(c, nodes)
    plan = replace(
        remat.plan(prof, strategy="none"),
        assignment={n: assignment[n] for n in c.chain.blocks},
        segments=segments,
        predicted_peak_bytes=simulate(c, nodes),
    )
    ref = _grads(model, x)
    remat.apply(model, plan)
    try:
        measured = remat.measure(model, x, repeat=1, warmup=0).peak_bytes
        assert measured <= plan.predicted_peak_bytes * 1.005, (measured, plan.predicted_peak_bytes)
        grads = _grads(model, x)
    finally:
        remat.remove(model)
    assert all(torch.equal(grads[n], ref[n]) for n in ref)


def _vgg(widths: tuple[int, ...] = (8, 8, 16, 16)) -> nn.Sequential:
    """A flat VGG-style chain: Conv2d, BatchNorm2d, ReLU(inplace=True) repeated, each layer a block."""
    layers: list[nn.Module] = []
    for c_in, c_out in zip((3, *widths), widths):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[-1], 10), _LogSumExp())


class _LogSumExp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.logsumexp(-1).mean()


def _counters(model: nn.Sequential, segments) -> int:
    """Bytes of the BatchNorm counters inside each segment, once per segment holding them: the walk keeps the copy a
    recomputation runs on until a kept norm's backward, the counter too, which the norm does not save (NOTE [Buffers
    a region keeps for its recomputation] in remat.planning._nested_copies)."""
    blocks = dict(model.named_children())
    names = list(blocks)
    held = [blocks[b] for first, last in segments for b in names[names.index(first) : names.index(last) + 1]]
    return sum(m.num_batches_tracked.nbytes for m in held if isinstance(m, nn.BatchNorm2d))


def test_a_flat_conv_chain_of_in_place_relus_gets_nested_plans_predicted_to_its_buffers():
    # Each ReLU(inplace=True) writes its input, the BatchNorm's output. Writers and the blocks before them were
    # kept out of every segment, and one level saves nothing on single layers: no plan below the peak without
    # checkpointing at all. Segments from conv to conv hold the writes inside them.
    torch.manual_seed(0)
    model, x = _vgg(), torch.randn(8, 3, 32, 32)
    reference = _grads(model, x)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    baseline = prof.baseline_peak_bytes
    assert remat.plan(prof, strategy="none", nested=False).min_peak_bytes == baseline
    floor = remat.plan(prof, strategy="none").min_peak_bytes
    assert floor < 0.6 * baseline, floor / baseline
    for budget in (floor, (floor + baseline) // 2, int(0.9 * baseline)):
        plan = remat.plan(prof, budget)
        assert plan.segments and plan.predicted_peak_bytes <= budget
        remat.apply(model, plan)
        try:
            assert all(torch.equal(g, reference[n]) for n, g in _grads(model, x).items())
            measured = remat.measure(model, x, repeat=1, warmup=0).peak_bytes
        finally:
            remat.remove(model)
        slack = _counters(model, plan.segments)
        assert plan.predicted_peak_bytes - slack <= measured <= plan.predicted_peak_bytes, (plan, measured)


def test_every_hand_made_segment_over_a_conv_chain_of_in_place_relus_is_predicted_safe():
    # The walk's rule for writers inside a segment, each shape by hand: never under (NOTE [Inputs written in place
    # inside a segment]), where the planner's own rule allows the shape or not.
    torch.manual_seed(0)
    model, x = _vgg((8, 8)), torch.randn(8, 3, 16, 16)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    n, names = len(prof.blocks), [b.name for b in prof.blocks]
    assert [b.writes_input for b in prof.blocks[:6]] == [False, False, True] * 2

    def segment(i: int, j: int):
        return lambda c, p: (
            *(Node(k, p("keep")) for k in range(i)),
            Node(i, end=j + 1, children=tuple(Node(k, p("keep")) for k in range(i, j))),
            *(Node(k, p("keep")) for k in range(j + 1, n)),
        )

    shapes = [segment(i, j) for i in range(6) for j in range(i + 1, 7)]
    spans = [((names[i], names[j]),) for i in range(6) for j in range(i + 1, 7)]
    for span, (predicted, measured) in zip(spans, _hand_made(model, x, prof, shapes), strict=True):
        assert measured <= predicted, (span, predicted, measured)


class _Memory:
    """An argument every block reads that is not a tensor (a key/value cache is one)."""

    def __init__(self, d: int) -> None:
        self.table = torch.randn(d)


class _ReadsMemory(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, memory: _Memory) -> torch.Tensor:
        return torch.tanh(self.fc(x) + memory.table)


class _MemoryChain(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ReadsMemory(d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = _Memory(x.shape[-1])
        self.seen = weakref.ref(memory)
        for block in self.blocks:
            x = block(x, memory)
        return x.square().mean()


def test_a_segment_keeps_no_argument_past_the_step():
    # the segment's head checks the next blocks' arguments by identity; it held a non-tensor one until the next
    # step, and with it what it holds (a key/value cache: every layer's keys and values, through the backward)
    torch.manual_seed(0)
    model, x = _MemoryChain(), torch.randn(4, 8)
    none = remat.plan(remat.profile(model, x, repeat=1, warmup=0), strategy="none")
    plan = replace(none, assignment={**none.assignment, "blocks.1": "full"}, segments=(("blocks.0", "blocks.1"),))
    remat.apply(model, plan)
    try:
        model(x).backward()
        assert model.seen() is None
    finally:
        remat.remove(model)
