"""A lone single-op layer among a flat chain's units: plans keep it one level deep, as remat.apply does
(NOTE [A lone layer is kept one level deep] in remat.planning._solve)."""

import copy
import re

import pytest
import torch
from torch import nn

import remat

D = 32
#: The fuzzing report's first body: LayerNorms, which a free solver checkpointed for their mean and rstd.
BODY = ("lin", "gelu", "ln", "lin", "tanh", "ln", "lin", "gelu")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        make = {"lin": lambda: nn.Linear(D, D), "gelu": nn.GELU, "ln": lambda: nn.LayerNorm(D), "tanh": nn.Tanh}
        self.stem = nn.Linear(D, D)
        self.body = nn.Sequential(*(make[s]() for s in BODY))
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)))


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _built() -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    return Net(), torch.randn(3, 32, D)


def _outside_segments(plan: remat.Plan) -> dict[str, str]:
    """The blocks the plan checkpoints one level deep (outside every nested segment)."""
    order = list(plan.assignment)
    inside = {n for a, b in plan.segments for n in order[order.index(a) : order.index(b) + 1]}
    return {n: p for n, p in plan.checkpointed.items() if n not in inside}


def _assert_trains_the_same(model: Net, plain: Net) -> None:
    """Three steps on changing batches: loss and every gradient equal to the model without checkpointing."""
    for step in range(3):
        x = torch.randn(3, 32, D, generator=torch.Generator().manual_seed(step))
        losses = []
        for m in (model, plain):
            m.zero_grad(set_to_none=True)
            loss = loss_fn(m(x))
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(*losses), step
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad), (step, name)


@pytest.fixture(scope="module")
def profiled():
    model, x = _built()
    return model, remat.profile(model, x, loss_fn, repeat=1, warmup=0)


def test_every_plan_keeps_lone_layers_outside_segments_and_applies(profiled):
    # The one-level floor's plan checkpointed body.2 and body.5 (LayerNorms); remat.apply refused it.
    model, prof = profiled
    plain = copy.deepcopy(model)
    assert [b.name for b in prof.blocks] == [f"body.{i}" for i in range(len(BODY))]  # each a lone torch layer
    one_level = remat.plan(prof, strategy="none", nested=False).min_peak_bytes
    floor = remat.plan(prof, strategy="none").min_peak_bytes
    plans = [remat.plan(prof, f"{one_level}B", nested=False)]
    plans += [remat.plan(prof, strategy=s) for s in ("all", "selective", "sqrt", "every:2")]
    plans += [remat.plan(prof, f"{int(floor + f * (prof.baseline_peak_bytes - floor))}B") for f in (0, 0.3, 0.7)]
    assert any(p.segments and p.checkpointed for p in plans)  # nested plans still recompute lone layers
    for plan in plans:
        assert not _outside_segments(plan), (plan.strategy, plan.assignment, plan.segments)
        remat.apply(model, plan)
        try:
            _assert_trains_the_same(model, plain)
        finally:
            remat.remove(model)


def test_auto_applies_a_verified_plan_at_a_budget_and_at_its_advertised_floor():
    # auto compared plans with the one-level floor's plan, which remat.apply refused: every budget below the
    # peak without checkpointing raised "block 'body.2' is a lone LayerNorm", its advertised floor too.
    model, x = _built()
    plain = copy.deepcopy(model)
    with pytest.raises(remat.RematError, match=r"at least \d+ bytes") as refused:
        remat.auto(model, x, budget=0.5, loss_fn=loss_fn, repeat=1, warmup=0)
    match = re.search(r"at least (\d+) bytes", str(refused.value))
    assert match is not None
    for budget in (0.8, int(match.group(1))):
        plan = remat.auto(model, x, budget=budget, loss_fn=loss_fn, repeat=1, warmup=0)
        try:
            assert plan.verified and plan.segments and not _outside_segments(plan), plan
            assert any("bit for bit" in note for note in plan.notes), plan.notes
            _assert_trains_the_same(model, plain)
        finally:
            remat.remove(model)
