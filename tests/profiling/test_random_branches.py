"""Branches on random draws (NOTE [Branches on random draws]): found by two forced runs, told by profile and auto."""

import copy
import random
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import remat
from remat.errors import RandomBranchWarning
from remat.profiling._called import random_branches
from remat.profiling._types import Profile


class _Skipping(nn.Module):
    """A stack whose forward decides per layer, with ``test(draw)``, whether to skip it."""

    def __init__(self, test, n=4, d=16):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d)) for _ in range(n)
        )
        self.test = test

    def forward(self, x):
        for layer in self.layers:
            if self.test(x):
                continue
            x = x + layer(x)
        return x.sum()


_BRANCHING = {
    "rand below p": lambda x: torch.rand([]) < 0.3,
    "uniform_ of empty": lambda x: torch.empty(1).uniform_() > 0.7,
    "item of a draw": lambda x: torch.rand(1).item() < 0.5,
    "randn": lambda x: torch.randn([]) > 3.0,
    "bernoulli of probabilities": lambda x: bool(torch.bernoulli(torch.full((), 0.3))),
    "rand_like of data": lambda x: bool((torch.rand_like(x[0, 0]) < 0.3).all()),
    # torchvision's GeneralizedRCNNTransform.torch_choice of two training sizes
    "a choice of two": lambda x: [False, True][int(torch.empty(1).uniform_(0.0, 2.0).item())],
}
_NOT_BRANCHING = {
    "rand below 0": lambda x: torch.rand([]) < 0.0,
    "uniform above 0": lambda x: bool(torch.empty(1).uniform_() > 0.0),  # fairseq's layerdrop with probability 0
    "bernoulli of 0": lambda x: bool(torch.bernoulli(torch.zeros(()), 0.0).bool()),
    "dropout of data": lambda x: bool(torch.nn.functional.dropout(x, 0.5).sum() > 1e9),
    "data": lambda x: bool(x.sum() > 1e9),
    # The same choice of one size (torchvision's detection models' default): the item()s of the two ends differ,
    # and pick the same; and a drawn scale read into Python that sends no run elsewhere.
    "a choice of one": lambda x: [False][int(torch.empty(1).uniform_(0.0, 1.0).item())],
    "a drawn scale": lambda x: bool(x.sum() * torch.rand(1).item() > 1e9),
}


def _model(test):
    torch.manual_seed(0)
    return _Skipping(test).train(), torch.randn(8, 16)


@pytest.mark.parametrize("name", _BRANCHING)
def test_a_branch_on_a_random_draw_is_found_where_it_is(name):
    model, x = _model(_BRANCHING[name])
    found = random_branches(model, x, training=True)
    assert len(found) == 1 and found[0].startswith("test_random_branches.py:")


@pytest.mark.parametrize("name", _NOT_BRANCHING)
def test_a_draw_that_decides_nothing_is_no_branch(name):
    model, x = _model(_NOT_BRANCHING[name])
    assert random_branches(model, x, training=True) == ()


_HOST_BRANCHING = {
    "python random": lambda x: random.random() < 0.5,
    "numpy rand": lambda x: np.random.rand() < 0.5,
    "numpy choice": lambda x: bool(np.random.choice([True, False])),
}
_HOST_NOT_BRANCHING = {
    "python random below 0": lambda x: random.random() < 0.0,
    # A mask drawn from NumPy, as Wav2Vec2's SpecAugment: other values each step, the same ops.
    "numpy mask": lambda x: bool(torch.from_numpy(np.random.rand(*x.shape) < 0.5).float().mul(x).sum() > 1e9),
}


@pytest.mark.parametrize("name", _HOST_BRANCHING)
def test_a_branch_on_a_host_draw_is_found_where_it_is(name):
    model, x = _model(_HOST_BRANCHING[name])
    for seed in range(5):  # whatever path the user's own state takes
        random.seed(seed)
        np.random.seed(seed)
        before = (random.getstate(), np.random.get_state())
        found = random_branches(model, x, training=True)
        assert len(found) == 1 and found[0].startswith("test_random_branches.py:"), found
        assert "Python's or NumPy's" in found[0]
        assert random.getstate() == before[0] and np.random.get_state()[2] == before[1][2]  # put back


@pytest.mark.parametrize("name", _HOST_NOT_BRANCHING)
def test_a_host_draw_that_decides_nothing_is_no_branch(name):
    model, x = _model(_HOST_NOT_BRANCHING[name])
    assert random_branches(model, x, training=True) == ()


def test_auto_refuses_a_model_that_skips_layers_on_a_python_draw():
    model, _ = _model(_HOST_BRANCHING["python random"])
    x = torch.randn(256, 16)  # activations that a plan at 0.9 can save
    random.seed(0)  # a step that skips every layer trains nothing: not this one
    with pytest.raises(remat.RematError, match=r"test_random_branches.py:\d+ .*Python's or NumPy's generator"):
        remat.auto(model, x, budget=0.9)


def test_the_runs_leave_the_model_its_rng_and_its_mode_as_they_were():
    model, x = _model(_BRANCHING["rand below p"])
    model.eval()
    bn = nn.BatchNorm1d(16)
    model.layers[0].insert(0, bn)
    before, rng = copy.deepcopy(model.state_dict()), torch.get_rng_state()
    random_branches(model, x, training=True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert not model.training


def test_profile_records_the_branch_and_warns():
    model, x = _model(_BRANCHING["rand below p"])
    with pytest.warns(RandomBranchWarning, match="test_random_branches.py"):
        prof = remat.profile(model, x, warmup=0, repeat=1)
    assert prof.random_branches and any("random draws" in n for n in prof.notes)
    assert Profile.from_json(prof.to_json()).random_branches == prof.random_branches


def test_a_profile_without_random_branches_says_nothing():
    model, x = _model(_NOT_BRANCHING["rand below 0"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RandomBranchWarning)
        prof = remat.profile(model, x, warmup=0, repeat=1)
    assert prof.random_branches == ()


def test_auto_refuses_a_model_that_branches_on_a_draw_and_leaves_it_as_it_was():
    model, x = _model(_BRANCHING["rand below p"])
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(
        remat.RematError, match=r"branches on random draws at test_random_branches.py:\d+ .*its probability 0"
    ):
        remat.auto(model, x, budget=0.9)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(type(m).__name__.startswith("Checkpoint") for m in model.modules())
    assert all(p.grad is None for p in model.parameters())


def test_a_fake_profile_says_where_the_forward_branches_on_a_draw():
    model, x = _model(_BRANCHING["rand below p"])
    with pytest.raises(remat.RematError, match=r"fake=True.*random draw at test_random_branches.py:\d+"):
        remat.profile(model, x, fake=True)


class _LayerDrop(_Skipping):
    """LayerDrop as transformers writes it, its probability an attribute named ``layerdrop``."""

    def __init__(self):
        super().__init__(lambda x: self.training and self.layerdrop > 0 and torch.rand([]) < self.layerdrop, n=6)
        self.layerdrop = 0.3


def test_auto_plans_a_layerdrop_model_for_every_layer_and_later_draws_stay_within_the_budget():
    from conftest import assert_grads_equal

    torch.manual_seed(0)
    model, x = _LayerDrop().train(), torch.randn(64, 16)
    reference = copy.deepcopy(model)
    plan = remat.auto(model, x, budget=0.8)
    assert model.layerdrop == 0.3
    skipped = set()
    for seed in range(8):
        torch.manual_seed(seed)
        assert remat.measure(model, x, warmup=0, repeat=1).peak_bytes <= plan.budget_bytes
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            m(x).backward()
        assert_grads_equal(reference, model)
        skipped.add(sum(p.grad is None for p in model.parameters()))
    assert len(skipped) > 1
    remat.remove(model)


class _LayerDropChain(nn.Module):
    """Blocks handing each output to the next (nested segments can run over them), skipped as transformers
    skips them: wav2vec2's default LayerDrop, at a size where the nested floor is below one level's."""

    def __init__(self, layerdrop: float, n: int = 16, d: int = 64):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Dropout(0.1), nn.Linear(d, d), nn.Tanh()) for _ in range(n)
        )
        self.head = nn.Linear(d, 1)
        self.layerdrop = layerdrop

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            if self.training and self.layerdrop > 0 and torch.rand([]) < self.layerdrop:
                continue
            x = layer(x)
        return self.head(x).square().mean()


def _floor_plan(prof):
    return remat.plan(prof, remat.plan(prof, 0.99).min_peak_bytes)


def _steps(model, x, seeds):
    out = []
    for seed in seeds:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = model(x)
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    model.zero_grad(set_to_none=True)
    return out


def test_a_layerdrop_model_gets_no_nested_segment_and_trains_the_same_function_at_its_floor():
    # Once remat.auto applied, verified with LayerDrop off, a nested plan whose later steps ran the layers LayerDrop
    # skipped inside a segment (other losses) or stopped on a block called with another input (NOTE [LayerDrop and
    # nested segments] in remat.core._hf).
    torch.manual_seed(0)
    x = torch.randn(512, 16)
    without = remat.profile(_LayerDropChain(0.0).train(), x, repeat=1, warmup=0)
    floor = _floor_plan(without)
    assert floor.segments, "the test's premise: without LayerDrop the floor is a nested plan"
    torch.manual_seed(0)
    model = _LayerDropChain(0.3).train()
    reference = copy.deepcopy(model)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    assert prof.skips_layers == ("_LayerDropChain.layerdrop = 0.3",) and any("LayerDrop is on" in n for n in prof.notes)
    assert Profile.from_json(prof.to_json()).skips_layers == prof.skips_layers
    lowest = _floor_plan(prof)
    assert not lowest.segments and lowest.min_peak_bytes > floor.min_peak_bytes
    plan = remat.auto(model, x, (lowest.min_peak_bytes * 1.01 + 1) / prof.baseline_peak_bytes, repeat=1, warmup=0)
    assert not plan.segments and plan.checkpointed
    got, want = _steps(model, x, range(6)), _steps(reference, x, range(6))
    for (loss, grads), (loss2, grads2) in zip(got, want):
        assert torch.equal(loss, loss2) and grads.keys() == grads2.keys()
        assert all(torch.equal(grads[n], grads2[n]) for n in grads)
    assert len({len(g) for _, g in want}) > 1  # the draws skipped layers, a different number from step to step
    remat.remove(model)


def test_apply_refuses_nested_segments_on_a_layerdrop_model_and_leaves_it_as_it_was():
    torch.manual_seed(0)
    x = torch.randn(512, 16)
    floor = _floor_plan(remat.profile(_LayerDropChain(0.0).train(), x, repeat=1, warmup=0))
    assert floor.segments
    model = _LayerDropChain(0.3).train()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(remat.RematError, match=r"LayerDrop: _LayerDropChain.layerdrop = 0.3.*nested=False"):
        remat.apply(model, floor)
    assert all("forward" not in m.__dict__ and not remat.is_wrapped(m) for m in model.modules())
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    model.layerdrop = 0.0  # off: the same plan runs
    remat.apply(model, floor)
    remat.remove(model)


class _LayerDropLoop(nn.Module):
    """No submodules (its forward is cut along a trace), LayerDrop on its loop's steps."""

    def __init__(self, layerdrop: float, n: int = 8, d: int = 32):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, d, d) / d**0.5)
        self.n, self.layerdrop = n, layerdrop

    def forward(self, x):
        for k in range(self.n):
            if self.training and self.layerdrop > 0 and torch.rand([]) < self.layerdrop:
                continue
            x = torch.tanh(x @ self.w[k])
        return x.square().mean()


def test_a_layerdrop_model_is_not_cut_along_a_trace_which_would_fix_one_draw():
    # A trace taken while LayerDrop is on runs the layers one draw kept, every step after (or, taken with it off,
    # every layer): a plan of traced segments would train another function.
    torch.manual_seed(0)
    from remat.profiling._traced import is_traced_plan

    x = torch.randn(512, 32)
    traced = _floor_plan(remat.profile(_LayerDropLoop(0.0).train(), x, repeat=1, warmup=0))
    assert is_traced_plan(traced.assignment) and traced.checkpointed
    model = _LayerDropLoop(0.5).train()
    with pytest.raises(remat.RematError, match=r"LayerDrop: _LayerDropLoop.layerdrop = 0.5.*not cut along") as e:
        remat.profile(model, x, repeat=1, warmup=0)
    assert "no submodule" in str(e.value) and "Pass blocks" not in str(e.value)  # it has none to name
    with pytest.raises(remat.RematError, match=r"LayerDrop: _LayerDropLoop.layerdrop = 0.5.*one draw's path"):
        remat.apply(model, traced)
    assert not list(model.children()) and "forward" not in model.__dict__ and model.layerdrop == 0.5
