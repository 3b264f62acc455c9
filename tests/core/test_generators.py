"""A generator a checkpointed call draws from is replayed in its recomputation (remat.core._generators)."""

import copy

import pytest
import torch
from torch import nn

import remat
from remat.core._state import capture

D = 16


class OwnMasks(nn.Module):
    """Draws its dropout-like mask from a generator of its own, kept on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.gen = torch.Generator().manual_seed(5)
        self.recomputed = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.recomputed += remat.is_recomputing()
        return x + self.f(x) * (torch.rand(x.shape, generator=self.gen) > 0.2)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(OwnMasks() for _ in range(3)))


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict, list]:
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, [b.gen.get_state() for b in model]


@pytest.mark.parametrize("policy", ["full", "selective", "selective-ops"])
def test_a_generator_of_the_blocks_own_is_replayed_and_left_as_the_forward_left_it(policy):
    reference = _model()
    model, x = copy.deepcopy(reference), torch.randn(4, 8, D)
    for block in model:
        remat.wrap(block, policy=policy)
    for _ in range(2):  # the first call watches every op; the second goes by what the first learned
        want, got = _step(reference, x), _step(model, x)
        assert torch.equal(want[0], got[0])
        assert all(torch.equal(want[1][n], got[1][n]) for n in want[1])
        assert all(torch.equal(a, b) for a, b in zip(want[2], got[2]))  # advanced by the forward's draws only
    if policy == "full":
        assert all(block.recomputed == 2 for block in model)


def test_a_snapshot_puts_back_the_generators_the_models_modules_keep():
    model = _model()
    state = capture(model, parameters=False)
    before = [b.gen.get_state() for b in model]
    model(torch.randn(2, D))
    assert not torch.equal(model[0].gen.get_state(), before[0])
    state.restore()
    assert all(torch.equal(b.gen.get_state(), s) for b, s in zip(model, before))
