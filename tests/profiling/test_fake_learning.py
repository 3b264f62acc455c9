"""Selective blocks learn on fake tensors before a real step (NOTE [Blocks a profile never ran] in
``remat.profiling._fake_learning``)."""

from __future__ import annotations

import torch
from conftest import Untouched, assert_grads_equal, twin
from torch import nn

import remat
from remat.core.checkpoint import knows_structure
from remat.profiling._fake_learning import learn_on_fake_tensors


def _mlps(blocks: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(blocks)))


def test_blocks_learn_on_fake_tensors_and_nothing_else_changes():
    model, x = _mlps(), torch.randn(64, 32)
    for block in model:
        remat.wrap(block, policy="selective")
    untouched = Untouched(model)
    assert not any(knows_structure(block) for block in model)
    assert learn_on_fake_tensors(model, x, None, [str(i) for i in range(6)])
    assert all(knows_structure(block) for block in model)
    untouched.check()
    assert not learn_on_fake_tensors(model, x, None, [str(i) for i in range(6)])  # nothing left to learn
    remat.remove(model)


def test_auto_verifies_blocks_the_profile_never_ran_as_the_plan_runs_them():
    # Alike blocks are profiled on a stack of five: the sixth's first call was the verification step, which kept
    # what op-by-op selective keeps (6656 bytes over) and made auto refuse its own floor.
    model, x = _mlps(), torch.randn(64, 32)
    reference = twin(model)
    plan = remat.auto(model, x, budget=0.7)
    try:
        assert "selective" in plan.assignment.values()
        assert plan.measured_peak_bytes == plan.predicted_peak_bytes <= plan.budget_bytes
        model(x).sum().backward()
        reference(x).sum().backward()
        assert_grads_equal(reference, model)
    finally:
        remat.remove(model)
