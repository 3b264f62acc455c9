"""One training step, defined once: call the model, reduce to a loss, backward."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from remat.errors import RematError

LossFn = Callable[[Any], torch.Tensor]


def call_model(model: nn.Module, inputs: Any) -> Any:
    """Call ``model`` the way design.md defines ``inputs``: tensor, tuple or dict."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` when there is one (Hugging Face), else the sum of float outputs."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    if hasattr(output, "to_tuple"):  # transformers ModelOutput without a loss
        output = output.to_tuple()
    leaves, _ = tree_flatten(output)
    floats = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise RematError(
            "remat: the model's output has no floating-point tensor to build a loss from "
            f"(got {type(output).__name__}); pass loss_fn=lambda out: ... returning a scalar."
        )
    return sum(t.float().sum() for t in floats)


def compute_loss(output: Any, loss_fn: LossFn | None) -> torch.Tensor:
    loss = default_loss(output) if loss_fn is None else loss_fn(output)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise RematError(
            f"remat: loss_fn must return a scalar tensor, got {shape}; reduce it, e.g. with .mean()."
        )
    return loss


def training_step(
    model: nn.Module,
    inputs: Any,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    before_backward: Callable[[], None] | None = None,
    before_optimizer_step: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Forward, loss, backward (and ``optimizer.step()`` when given). Returns the detached loss.

    ``before_backward`` runs between the loss and ``backward()``, ``before_optimizer_step`` between
    ``backward()`` and ``optimizer.step()`` (the profiler's segment markers).
    """
    loss = compute_loss(call_model(model, inputs), loss_fn)
    if not loss.requires_grad:
        raise RematError(
            "remat: the loss does not require grad, so no parameter can be trained; "
            "check that the model has trainable parameters and that the step is not under torch.no_grad()."
        )
    if before_backward is not None:
        before_backward()
    loss.backward()
    if optimizer is not None:
        if before_optimizer_step is not None:
            before_optimizer_step()
        optimizer.step()
    return loss.detach()


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def input_tensors(inputs: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(inputs)
    return [t for t in leaves if isinstance(t, torch.Tensor)]
