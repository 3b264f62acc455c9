"""NOTE [Autocast around remat's calls]: remat called inside the user's ``torch.autocast`` region."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.core._autocast import _nesting, outside_autocast


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_inside_it_autocast_is_as_outside_every_region_and_is_put_back():
    weight = torch.randn(8, 8, requires_grad=True)
    with _bf16(), _bf16():
        assert _nesting() == 2
        cast = torch.mm(torch.randn(2, 8), weight)  # caches a bf16 copy of the weight
        assert cast.dtype == torch.bfloat16
        with outside_autocast():
            assert not torch.is_autocast_enabled("cpu") and _nesting() == 0
            assert torch.mm(torch.randn(2, 8), weight).dtype == torch.float32
            with _bf16():  # a recomputation's own region: its exit clears the cache, as outside the user's
                assert _nesting() == 1
        assert torch.is_autocast_enabled("cpu") and _nesting() == 2
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu") and _nesting() == 0


def test_it_puts_autocast_back_when_the_backward_fails():
    with _bf16(), pytest.raises(KeyboardInterrupt), outside_autocast():
        raise KeyboardInterrupt
    assert _nesting() == 0 and not torch.is_autocast_enabled("cpu")
    with _bf16():
        with pytest.raises(ValueError), outside_autocast():
            raise ValueError
        assert torch.is_autocast_enabled("cpu") and _nesting() == 1


def test_without_autocast_it_changes_nothing():
    with outside_autocast():
        assert not torch.is_autocast_enabled("cpu") and _nesting() == 0


class _MLP(nn.Module):
    def __init__(self, d=64, n=4):
        super().__init__()
        self.inp, self.out = nn.Linear(32, d), nn.Linear(d, 10)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d))
            for _ in range(n)
        )

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


class _ForwardUnderAutocast(nn.Module):
    """The recipe's step: forward and loss under autocast, backward outside."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        with _bf16():
            return self.model(x)


def _mlp():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
    return _MLP().train(), x, lambda out: F.cross_entropy(out.float(), y)


def test_a_step_measured_inside_autocast_is_the_recipes_step():
    # Before, the backward ran inside the user's region: the cast cache held the forward's copies through it.
    model, x, loss_fn = _mlp()
    recipe = remat.measure(_ForwardUnderAutocast(model), x, loss_fn, warmup=0, repeat=1).peak_bytes
    with _bf16():
        inside = remat.measure(model, x, loss_fn, warmup=0, repeat=1).peak_bytes
        assert torch.is_autocast_enabled("cpu")
    assert inside == recipe


def test_auto_inside_autocast_plans_what_its_step_measures():
    # A bf16 MLP: fake and real profiles agree on every mix (they were 256 B apart per LayerNorm, and mixed plans
    # 15% over), and the plan auto applies measures what it predicted, within the budget, in the recipe's step.
    model, x, loss_fn = _mlp()
    with _bf16():
        real = remat.profile(model, x, loss_fn, warmup=0, repeat=1, policies=("keep", "full"))
        fake = remat.profile(model, x, loss_fn, fake=True, target="cpu", policies=("keep", "full"))
        names = [b.name for b in real.blocks]
        for k in range(2 ** len(names)):
            assignment = {n: ("keep", "full")[k >> i & 1] for i, n in enumerate(names)}
            assert fake.predict_peak(assignment) == real.predict_peak(assignment), assignment
        plan = remat.auto(model, x, budget=0.92, loss_fn=loss_fn)
    assert plan.checkpointed
    measured = remat.measure(_ForwardUnderAutocast(model), x, loss_fn, warmup=0, repeat=1).peak_bytes
    assert measured == plan.predicted_peak_bytes <= plan.budget_bytes
    remat.remove(model)
