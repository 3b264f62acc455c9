"""A block that runs its submodules under saved-tensor hooks of its own (a torch checkpoint it calls itself,
save_on_cpu) stays op-level under selective (NOTE [Hooks inside the block] in remat.core._by_module)."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as tuc
from conftest import assert_grads_equal, twin
from torch import nn

import remat
from remat.core._memo import STRUCTURES

D = 32


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class UserCheckpoint(nn.Module):
    """The fuzzing report's block: torch.utils.checkpoint around its MLP, after a part it does not checkpoint."""

    def __init__(self, hooks: str) -> None:
        super().__init__()
        self.pre, self.inner, self.hooks = (
            nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)),
            MLP(),
            hooks,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pre(x)
        if self.hooks == "checkpoint":
            return tuc.checkpoint(self.inner, x, use_reentrant=False)
        with torch.autograd.graph.save_on_cpu():
            return self.inner(x)


class Model(nn.Module):
    def __init__(self, hooks: str = "checkpoint") -> None:
        super().__init__()
        self.layers = nn.ModuleList(UserCheckpoint(hooks) for _ in range(4))
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _steps_match(model: nn.Module, plain: nn.Module) -> None:
    """Three steps on changing batches: loss and every gradient equal to ``plain``'s (no remat)."""
    for step in range(3):
        x = torch.randn(4, 16, D, generator=torch.Generator().manual_seed(step))
        losses = []
        for m in (model, plain):
            m.zero_grad(set_to_none=True)
            loss = m(x).square().mean()
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(*losses), step
        assert_grads_equal(plain, model)


@pytest.mark.parametrize("hooks", ["checkpoint", "save_on_cpu"])
def test_selective_keeps_a_block_with_hooks_of_its_own_op_level_and_exact(hooks):
    # By module, a region's hooks sat inside the block's torch checkpoint, whose recomputation in backward ran
    # without them: step 2 raised torch's CheckpointError (saved [64, 32], recomputed [32]). Under save_on_cpu
    # regions were exact, but remat cannot tell hooks that recompute from hooks that do not.
    torch.manual_seed(0)
    model = Model(hooks)
    plain = twin(model)
    for layer in model.layers:
        remat.wrap(layer, policy="selective")
    _steps_match(model, plain)
    for layer in model.layers:
        assert all(not structure.regions for structure in STRUCTURES[layer].values())


def test_auto_plans_a_model_whose_blocks_call_torch_checkpoint():
    # auto refused it: "the training step raised CheckpointError during a profiled step" (selective's run).
    torch.manual_seed(0)
    model, x = Model(), torch.randn(4, 16, D)
    plain = twin(model)
    plan = remat.auto(model, x, budget=0.9, loss_fn=lambda out: out.square().mean(), repeat=1, warmup=0)
    try:
        assert plan.verified and plan.checkpointed, plan.summary()
        _steps_match(model, plain)
    finally:
        remat.remove(model)
