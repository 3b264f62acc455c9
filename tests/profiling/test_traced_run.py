"""A traced plan saved with the model (NOTE [A traced plan pickles as its cuts] in ``remat.profiling._traced_run``)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from conftest import assert_grads_equal, twin
from torch import nn

import remat
from remat.profiling._traced import HOLDER

LOOPS = 24


class _Looped(nn.Module):
    """A function looped over a tensor, a BatchNorm in the middle: no blocks, so remat cuts its trace."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x):
        for i in range(LOOPS):
            x = x + torch.tanh(x @ self.w)
            if i == LOOPS // 2:
                x = self.bn(x)
        return x


def _loss(out):
    return (out**2).mean()


def _saved_and_loaded(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.fixture
def planned():
    torch.manual_seed(0)
    model, x = _Looped(), torch.randn(8, 16, 32)
    reference = twin(model)
    plan = remat.auto(model, x, budget=0.6, loss_fn=_loss, repeat=1, warmup=0)
    assert any(name.startswith(HOLDER + ".") for name in plan.checkpointed)
    _loss(model(x)).backward()  # a step before saving: what a training loop saves
    model.zero_grad(set_to_none=True)
    _loss(reference(x)).backward()
    reference.zero_grad(set_to_none=True)
    return model, x, reference, plan


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_a_traced_plan_saved_with_the_model_runs_in_the_loaded_copy(planned, how):
    model, x, reference, plan = planned
    loaded = _saved_and_loaded(model) if how == "torch.save" else copy.deepcopy(model)
    for m in (loaded, reference):
        torch.manual_seed(1)
        _loss(m(x)).backward()
    assert_grads_equal(reference, loaded)
    assert torch.equal(loaded.bn.running_mean, reference.bn.running_mean)  # updated once, as without remat
    loaded.zero_grad(set_to_none=True)
    peak = remat.measure(loaded, x, loss_fn=_loss, repeat=1).peak_bytes
    assert peak == plan.measured_peak_bytes < plan.baseline_peak_bytes  # the plan, not the class's forward
    remat.remove(loaded)
    assert HOLDER not in loaded._modules and "forward" not in loaded.__dict__


def test_a_loaded_traced_plan_whose_forward_changed_says_what_to_call(planned, monkeypatch):
    model, x, _, _ = planned
    loaded = _saved_and_loaded(model)
    monkeypatch.setattr(__import__(__name__), "LOOPS", 12)  # the class's code, as a new version of it would
    with pytest.raises(remat.RematError, match=r"remat.remove\(model\), then remat.apply"):
        loaded(x)
