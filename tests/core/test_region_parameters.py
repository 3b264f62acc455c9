"""A checkpointed forward that writes a parameter in place: once per step, recomputed from the value it read.

NOTE [Parameters a forward writes] in remat.core._region.
"""

import copy

import pytest
import torch
from torch import nn

import remat

W = 16


class Codebook(nn.Module):
    """A vector quantiser that moves its codes after using them, in place and outside autograd: through ``.data``
    (a trainable codebook, dead codes re-initialised) or under ``no_grad`` (an EMA codebook that is not trained)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(W, W), nn.Linear(W, W)
        self.codes = nn.Parameter(torch.randn(8, W), requires_grad=how == "data")
        self.how = how
        self.recomputed = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.recomputed += remat.is_recomputing()
        z = self.enc(x)
        q = self.codes[torch.cdist(z.detach(), self.codes.detach()).argmin(-1)]
        if self.how == "data":
            self.codes.data[:4] = self.codes.data[:4] * 0.5 + 1.0
        else:
            with torch.no_grad():
                self.codes.mul_(0.9).add_(0.1 * z.detach().mean(0))
        return x + self.dec(z + (q - z).detach()) + (q - z.detach()).square().mean()


def _step(model: nn.Module, x: torch.Tensor) -> tuple:
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", ["full", "selective", "selective-ops"])
@pytest.mark.parametrize("how", ["data", "no_grad"])
def test_a_parameter_the_forward_writes_is_written_once_and_recomputed_from_the_value_it_read(how, policy):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, W), *(Codebook(how) for _ in range(3)), nn.Linear(W, 1))
    model, x = copy.deepcopy(reference), torch.randn(16, 8)
    for block in model[1:4]:
        remat.wrap(block, policy=policy)
    for _ in range(2):  # the first call watches every parameter; the second those the first wrote
        want, got = _step(reference, x), _step(model, x)
        assert torch.equal(want[0], got[0])
        for name in want[1]:
            assert (want[1][name] is None) == (got[1][name] is None), name
            assert want[1][name] is None or torch.equal(want[1][name], got[1][name]), name
        assert all(torch.equal(want[2][n], got[2][n]) for n in want[2])  # the codes moved once per step
    if policy == "full":
        assert all(block.recomputed == 2 for block in model[1:4])
