"""The training loop around a step: an optimizer's state and step, and gradient accumulation.

NOTE [The step a loop repeats]
A plan's peak is the peak of the step the user's loop repeats, not of a first step on a
fresh model, and two things of the loop change it:
* an optimizer: its state (AdamW: two tensors per parameter) is made by its first step
  and stays alive from then on; its ``step()`` runs after the backward with every
  gradient alive and adds temporaries of its own (foreach kernels make whole lists of
  parameter-sized tensors).
* gradient accumulation (``accumulation_steps`` backward passes per optimizer step), or
  ``zero_grad(set_to_none=False)``: from the second backward on, every gradient is alive
  through the whole forward and backward, where a first step makes them one by one.
Measured on GPT-2 4x256 (CPU), a plan for 85.0 MiB of a bare step peaked at 120.5 MiB
with AdamW and at 100.4 MiB in the second backward of an accumulation. So remat
measures and profiles the repeated step from the loop's steady state: the optimizer
stepped once (its state made) and, when accumulating, one backward run (gradients
alive); both are resting memory, and ``optimizer.step()`` runs after each backward as
its last segment. The first step of a loop is lighter and never sets the peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from remat.core._step import LossFn, training_step
from remat.errors import RematError

__all__ = ["Loop", "NO_LOOP"]


@dataclass(frozen=True)
class Loop:
    """What the training loop keeps alive around each step (NOTE [The step a loop repeats])."""

    optimizer: torch.optim.Optimizer | None = None
    """Stepped after every backward; its state is resting memory. None: the step ends with the backward."""
    accumulation_steps: int = 1
    """Backward passes per optimizer step; from 2 on, every gradient is alive through the step."""

    @property
    def accumulates(self) -> bool:
        return self.accumulation_steps > 1

    def describe(self) -> str:
        """What the step holds beyond forward and backward ("" for neither)."""
        return describe_loop(None if self.optimizer is None else type(self.optimizer).__name__, self.accumulation_steps)

    def start(self, model: nn.Module) -> None:
        """Before a step: the gradients as the loop leaves them."""
        if not self.accumulates:
            model.zero_grad(set_to_none=True)

    def steady(self, model: nn.Module, inputs: Any, loss_fn: LossFn | None) -> None:
        """Bring the model and optimizer to where a repeated step starts: the optimizer's state made, and with
        accumulation every gradient alive. Changes parameters and gradients: the caller restores them."""
        if self.optimizer is not None and not _has_state(self.optimizer):
            model.zero_grad(set_to_none=True)
            training_step(model, inputs, loss_fn, self.optimizer)
        if self.accumulates and any(p.grad is None for p in model.parameters() if p.requires_grad):
            model.zero_grad(set_to_none=True)
            training_step(model, inputs, loss_fn)

    def resident(self, model: nn.Module) -> list[torch.Tensor]:
        """Tensors the loop keeps alive across steps: accumulated gradients and the optimizer's state."""
        out = [p.grad for p in model.parameters() if p.grad is not None] if self.accumulates else []
        return out + optimizer_state(self.optimizer)


NO_LOOP = Loop()


def describe_loop(optimizer: str | None, accumulation_steps: int) -> str:
    """ "AdamW's state and step and gradients accumulated over 4 backward passes" ("" for neither)."""
    parts = [f"{optimizer}'s state and step"] if optimizer else []
    if accumulation_steps > 1:
        parts.append(f"gradients accumulated over {accumulation_steps} backward passes")
    return " and ".join(parts)


def optimizer_state(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The tensors of ``optimizer``'s state (empty before its first step)."""
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _has_state(optimizer: torch.optim.Optimizer) -> bool:
    """True once every parameter that has a gradient got state (stateless optimizers: plain SGD, trivially)."""
    return bool(optimizer.state) or not _keeps_state(optimizer)


def _keeps_state(optimizer: torch.optim.Optimizer) -> bool:
    # SGD without momentum keeps none; every other torch optimizer does after one step.
    if isinstance(optimizer, torch.optim.SGD):
        return any(group.get("momentum", 0) for group in optimizer.param_groups)
    return True


def make_loop(model: nn.Module, optimizer: Any, accumulation_steps: Any, api: str) -> Loop:
    """Check the loop options a user gave ``api`` (RematError with how to fix them)."""
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise RematError(
            f"{api}: accumulation_steps must be an integer >= 1 (backward passes per optimizer "
            f"step), got {accumulation_steps!r}."
        )
    if optimizer is None:
        return Loop(None, accumulation_steps)
    # Accelerate's and Lightning's wrappers step the optimizer they hold only when gradients are synchronised
    # (never on an accumulation step): the state and step are the inner optimizer's.
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise RematError(
            f"{api}: optimizer must be a torch.optim.Optimizer (the one the loop steps), got "
            f"{type(optimizer).__name__}."
        )
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
    if foreign:
        raise RematError(
            f"{api}: {foreign} of the optimizer's parameters are not parameters of the model "
            f"{type(model).__name__}; pass the optimizer built on this model's parameters."
        )
    return Loop(optimizer, accumulation_steps)


class OptimizerSnapshot:
    """The optimizer's state, copied to CPU memory (a CUDA peak measured meanwhile never counts it)."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, api: str = "remat") -> None:
        self.optimizer = optimizer
        self.api = api
        self.saved = None if optimizer is None else tree_map(_to_cpu, optimizer.state_dict())

    def restore(self) -> None:
        if self.optimizer is None:
            return
        try:
            # load_state_dict moves the state back to each parameter's device and dtype; on the CPU it keeps the
            # tensors it is given, which the next step updates in place: hand it copies, not the snapshot
            self.optimizer.load_state_dict(tree_map(_to_cpu, self.saved))
        except Exception as exc:
            raise RematError(
                f"{self.api}: failed to restore the state of the optimizer {type(self.optimizer).__name__} after "
                f"running its step ({type(exc).__name__}: {exc}); its load_state_dict (or a hook on it) raised."
            ) from exc


def _to_cpu(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
