"""A recomputation sees a module's parameters and buffers as its forward did (remat.core._slots)."""

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

import remat
from remat.core._slots import Slots

POLICIES = ("full", "selective", "selective-ops")
D = 16


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.recomputed = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.recomputed += remat.is_recomputing()
        return x + self.f(x)


class Scaled(nn.Module):
    """Calls each block with its weights scaled, through ``functional_call`` (a weight-shared or meta-learned
    model's pattern): the block's own weights are back in its slots when its backward recomputes it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Residual() for _ in range(3))
        self.scale = nn.Parameter(torch.tensor(1.03))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = functional_call(block, {k: v * self.scale for k, v in block.named_parameters()}, (x,))
        return x


class RunningMean(nn.Module):
    """Keeps a running mean by assigning its buffer anew, and reads it before a ReLU (whose mask it shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.register_buffer("ema", torch.zeros(D))
        self.recomputed = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.recomputed += remat.is_recomputing()
        h = self.fc(x)
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * h.detach().mean((0, 1))
        return x + torch.relu(h - self.ema)


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict, dict]:
    torch.manual_seed(1)
    loss = model(x).square().mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, {n: b.clone() for n, b in model.named_buffers()}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("build", [Scaled, lambda: nn.Sequential(*(RunningMean() for _ in range(3)))])
def test_a_recomputation_reads_the_tensors_the_forward_read(build, policy):
    torch.manual_seed(0)
    reference = build()
    model, x = copy.deepcopy(reference), torch.randn(4, 8, D)
    blocks = [m for m in model.modules() if isinstance(m, (Residual, RunningMean))]
    for block in blocks:  # the block whole, or its cheap sub-layers (selective) as regions of their own
        remat.wrap(block, policy=policy)
    want, got = _step(reference, x), _step(model, x)
    assert torch.equal(want[0], got[0])
    assert all(torch.equal(want[1][n], got[1][n]) for n in want[1]), [
        n for n in want[1] if not torch.equal(want[1][n], got[1][n])
    ]
    assert all(torch.equal(want[2][n], got[2][n]) for n in want[2])  # the running means moved once
    if policy == "full":  # the whole block ran again in backward
        assert all(block.recomputed == 1 for block in blocks)


def test_a_tensor_let_go_since_the_call_is_not_put_back():
    # FSDP frees an unsharded weight after the forward (its storage resized to nothing) and gathers it again for
    # the backward into the slot: the recomputation reads what the slot then holds.
    layer = nn.Linear(4, 4)
    slots = Slots(layer)
    seen, bias = layer.weight, layer.bias
    layer._parameters["weight"] = gathered = nn.Parameter(seen.detach().clone())
    layer._buffers["running"] = torch.zeros(1)  # a slot the call did not have is left alone
    layer.bias = nn.Parameter(torch.zeros(4))
    seen.untyped_storage().resize_(0)
    with slots.as_called():
        assert layer.weight is gathered and layer.bias is bias
    assert layer.bias is not bias and layer.weight is gathered
