"""The README's main job: the seed 000 CNN trained three ways from identical weights.

1. no checkpointing (the reference);
2. both conv blocks checkpointed with remat, the first one on raw input;
3. the seed's code: ``torch.utils.checkpoint(..., use_reentrant=True)`` on the blocks.

Numbers are collected here; ``remat.cli`` renders them.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import remat
from remat.measure import Measurement
from remat.zoo import SeedCifarCNN, ZooModel, build


class SeedCifarReentrant(SeedCifarCNN):
    """Seed 000 as the user checkpointed it: reentrant checkpoint on raw input freezes block 1."""

    def forward(self, X: torch.Tensor) -> torch.Tensor:  # noqa: N803
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            X = torch_checkpoint.checkpoint(self.cnn_block_1, X, use_reentrant=True)
            X = torch_checkpoint.checkpoint(self.cnn_block_2, X, use_reentrant=True)
        return self.head(self.flatten(X))


@dataclass(frozen=True)
class Variant:
    name: str
    losses: tuple[float, ...]
    measurement: Measurement
    frozen: tuple[str, ...]
    """Trainable parameters that did not change during training."""


def _train(model: nn.Module, zoo: ZooModel, steps: int, lr: float) -> tuple[list[float], list[str]]:
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        torch.manual_seed(1000 + step)  # same dropout masks for every variant
        opt.zero_grad(set_to_none=True)
        loss = zoo.loss_fn(model(zoo.inputs))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    frozen = [n for n, p in model.named_parameters() if torch.equal(before[n], p.detach())]
    return losses, frozen


def run_demo(*, batch: int = 128, steps: int = 10, lr: float = 0.05) -> list[Variant]:
    zoo = build("seed-cifar", batch=batch)
    reentrant = SeedCifarReentrant()
    reentrant.load_state_dict(zoo.model.state_dict())
    checkpointed = copy.deepcopy(zoo.model)
    remat.wrap(checkpointed.cnn_block_1)
    remat.wrap(checkpointed.cnn_block_2)
    variants = []
    for name, model in (
        ("no checkpointing", copy.deepcopy(zoo.model)),
        ("remat, both conv blocks", checkpointed),
        ("torch reentrant (seed 000)", reentrant),
    ):
        measurement = remat.measure(model, zoo.inputs, zoo.loss_fn, warmup=1, repeat=3)
        losses, frozen = _train(model, zoo, steps, lr)
        variants.append(Variant(name, tuple(losses), measurement, tuple(frozen)))
    return variants


@dataclass(frozen=True)
class PlanDemo:
    """remat.auto on a small GPT-2, verified against no checkpointing."""

    model: str
    plan: remat.Plan
    baseline: Measurement
    planned: Measurement
    grads_equal: bool


def _grads(model: nn.Module, zoo: ZooModel) -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)  # same dropout masks with and without the plan
    model.zero_grad(set_to_none=True)
    from remat._step import training_step

    training_step(model, zoo.inputs, zoo.loss_fn)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def run_plan_demo(*, budget: float = 0.6) -> PlanDemo:
    """Profile, plan for ``budget`` and apply on GPT-2 (4 layers, 256 wide, 4 x 256 tokens), then verify."""
    zoo = build("gpt2", layers=4, hidden=256, heads=4, vocab=4096, seq=256, batch=4)
    baseline = remat.measure(zoo.model, zoo.inputs, zoo.loss_fn, warmup=1, repeat=3)
    reference = _grads(zoo.model, zoo)
    plan = remat.auto(zoo.model, zoo.inputs, budget, loss_fn=zoo.loss_fn, repeat=2)
    try:
        planned = remat.measure(zoo.model, zoo.inputs, zoo.loss_fn, warmup=1, repeat=3)
        ours = _grads(zoo.model, zoo)
    finally:
        remat.remove(zoo.model)
    same = reference.keys() == ours.keys() and all(torch.equal(reference[k], ours[k]) for k in reference)
    return PlanDemo("gpt2 (4 layers, 256 wide, 4 x 256 tokens)", plan, baseline, planned, same)
