"""The README's main job: the seed 000 CNN trained three ways from identical weights.

1. no checkpointing (the reference);
2. both conv blocks checkpointed with remat, the first one on raw input;
3. the seed's code: ``torch.utils.checkpoint(..., use_reentrant=True)`` on the blocks.

Numbers are collected here; ``remat.cli`` renders them.
"""

from __future__ import annotations

import copy
import statistics
import warnings
from dataclasses import dataclass

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import remat
from remat.bench._rounds import interleaved_rounds, ratio_to, timed_step
from remat.core._state import capture
from remat.core._step import compute_loss, training_step
from remat.core.measure import Measurement
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
    step_time_s: float
    """Median step time over the interleaved rounds."""
    time_ratio: float
    """Median over rounds of the step time over no checkpointing's in the same round."""


def _step_times(models: list[nn.Module], zoo: ZooModel, *, warmup: int, repeat: int) -> list[list[float]]:
    """Step times of every model in interleaved rounds (see ``remat.bench._rounds``); the models are restored."""
    states = [capture(m) for m in models]
    try:
        return interleaved_rounds(
            [timed_step(m, zoo.inputs, zoo.loss_fn) for m in models], warmup=warmup, repeat=repeat
        )
    finally:
        for state in states:
            state.restore()


def _train(model: nn.Module, zoo: ZooModel, steps: int, lr: float) -> tuple[list[float], list[str]]:
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        torch.manual_seed(1000 + step)  # same dropout masks for every variant
        opt.zero_grad(set_to_none=True)
        loss = compute_loss(model(zoo.inputs), zoo.loss_fn)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    frozen = [n for n, p in model.named_parameters() if torch.equal(before[n], p.detach())]
    return losses, frozen


def run_demo(*, batch: int = 128, steps: int = 10, lr: float = 0.05, rounds: int = 5) -> list[Variant]:
    """The seed CNN three ways: peak, step time (``rounds`` interleaved rounds), losses and frozen parameters."""
    zoo = build("seed-cifar", batch=batch)
    reentrant = SeedCifarReentrant()
    reentrant.load_state_dict(zoo.model.state_dict())
    checkpointed = copy.deepcopy(zoo.model)
    if not isinstance(checkpointed, SeedCifarCNN):
        raise RuntimeError(
            f"remat demo: the zoo's seed-cifar model is a {type(checkpointed).__name__}, "
            "not the SeedCifarCNN whose blocks the demo wraps"
        )
    remat.wrap(checkpointed.cnn_block_1)
    remat.wrap(checkpointed.cnn_block_2)
    named = [
        ("no checkpointing", copy.deepcopy(zoo.model)),
        ("remat, both conv blocks", checkpointed),
        ("torch reentrant (seed 000)", reentrant),
    ]
    models = [m for _, m in named]
    times = _step_times(models, zoo, warmup=1, repeat=rounds)
    variants = []
    for (name, model), t in zip(named, times):
        measurement = remat.measure(model, zoo.inputs, zoo.loss_fn, warmup=0, repeat=1)  # peak and gradients
        losses, frozen = _train(model, zoo, steps, lr)
        variants.append(
            Variant(name, tuple(losses), measurement, tuple(frozen), statistics.median(t), ratio_to(t, times[0]))
        )
    return variants


@dataclass(frozen=True)
class PlanDemo:
    """remat.auto on a small GPT-2, verified against no checkpointing."""

    model: str
    plan: remat.Plan
    baseline: Measurement
    planned: Measurement
    grads_equal: bool
    step_times_s: tuple[float, float]
    """Median step time without checkpointing and with the plan, over the interleaved rounds."""
    time_ratio: float
    """Median over rounds of the planned step time over the un-checkpointed one in the same round."""


def _grads(model: nn.Module, zoo: ZooModel) -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)  # same dropout masks with and without the plan
    model.zero_grad(set_to_none=True)
    training_step(model, zoo.inputs, zoo.loss_fn)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def run_plan_demo(*, budget: float = 0.6, rounds: int = 5) -> PlanDemo:
    """Profile, plan for ``budget`` and apply on GPT-2 (4 layers, 256 wide, 4 x 256 tokens), then verify."""
    zoo = build("gpt2", layers=4, hidden=256, heads=4, vocab=4096, seq=256, batch=4)
    planned_model = copy.deepcopy(zoo.model)  # same weights; timed beside the original, round by round
    plan = remat.auto(planned_model, zoo.inputs, budget, loss_fn=zoo.loss_fn, repeat=2)
    baseline = remat.measure(zoo.model, zoo.inputs, zoo.loss_fn, warmup=0, repeat=1)
    planned = remat.measure(planned_model, zoo.inputs, zoo.loss_fn, warmup=0, repeat=1)
    reference, ours = _grads(zoo.model, zoo), _grads(planned_model, zoo)
    same = reference.keys() == ours.keys() and all(torch.equal(reference[k], ours[k]) for k in reference)
    base_t, plan_t = _step_times([zoo.model, planned_model], zoo, warmup=1, repeat=rounds)
    return PlanDemo(
        "gpt2 (4 layers, 256 wide, 4 x 256 tokens)",
        plan,
        baseline,
        planned,
        same,
        (statistics.median(base_t), statistics.median(plan_t)),
        ratio_to(plan_t, base_t),
    )
