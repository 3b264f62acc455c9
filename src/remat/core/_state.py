"""Snapshot and restore of everything a training step can change on a model.

Profiling, measuring and the doctor run real training steps on the user's model;
afterwards the model must be exactly as it was: parameters, buffers, gradients,
``requires_grad`` and ``training`` flags, and the global RNG streams.
"""

from __future__ import annotations

from dataclasses import dataclass

# NOTE [Snapshots a step without an optimizer needs]
# On the CPU the snapshot sits in the memory the step runs in: a copy of every parameter
# is as much again as the model, and a budget that the step alone would meet is missed
# by it (remat.auto's NOTE [Within the budget]). A training step without an optimizer
# changes gradients, buffers and the RNG, never the parameters' values, so the callers
# that run such steps (auto's verification) leave the values out.

import torch
from torch import nn


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    # Snapshots live on the CPU so that a CUDA peak measured afterwards never counts them.
    return None if t is None else t.detach().to("cpu", copy=True)


@dataclass
class ModelState:
    """Everything :func:`capture` saw; :meth:`restore` puts it back in place (same tensor objects)."""

    model: nn.Module
    params: dict[str, tuple[torch.Tensor | None, torch.Tensor | None, bool]]
    """Per parameter: (its data, None where not copied; its gradient; ``requires_grad``)."""
    buffers: dict[str, torch.Tensor | None]
    training: dict[str, bool]
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None

    def restore(self) -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters(remove_duplicate=False):
                data, grad, requires_grad = self.params[name]
                if data is not None:
                    p.copy_(data)
                # a copy: on the CPU .to() would hand out the snapshot itself, and a step that
                # accumulates into p.grad in place (NOTE [The step a loop repeats]) would change it
                p.grad = None if grad is None else grad.to(p.device, copy=True)
                p.requires_grad_(requires_grad)
            for name, b in self.model.named_buffers(remove_duplicate=False):
                saved = self.buffers[name]
                if b is not None and saved is not None:
                    b.copy_(saved)
        for name, module in self.model.named_modules(remove_duplicate=False):
            module.training = self.training[name]
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def capture(model: nn.Module, *, parameters: bool = True) -> ModelState:
    """Snapshot ``model`` and the RNG streams (to CPU memory); ``parameters=False`` leaves out the parameters'
    values, for steps that do not change them (NOTE [Snapshots a step without an optimizer needs])."""
    params = {
        name: (_copy(p) if parameters else None, _copy(p.grad), p.requires_grad)
        for name, p in model.named_parameters(remove_duplicate=False)
    }
    buffers = {name: _copy(b) for name, b in model.named_buffers(remove_duplicate=False)}
    training = {name: m.training for name, m in model.named_modules(remove_duplicate=False)}
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return ModelState(model, params, buffers, training, torch.get_rng_state(), cuda_rng)
