"""One training step, defined once: call the model, reduce to a loss, backward.

NOTE [Each step's inputs are fresh]
A training loop hands every step new input tensors, so an input that requires grad
starts each step with no gradient, and its gradient (made in the backward of the
first op that reads it) is alive from there to the end of the step. remat runs many
steps on the one ``inputs`` it is given: backward into the user's tensor would leave a
``.grad`` on it after every remat call, and from the second step on that gradient
would be alive through the whole step and accumulated in place, so a plan predicted
from a first step's trace measured 524288 B (the gradient of a 32x64x64 float input)
above its prediction. So each step calls the model with a new leaf over the same data
for every input that requires grad (``fresh_inputs``): the user's tensor is never
touched and never reached by backward (a non-leaf's graph included, whose second
backward would fail). A leaf input that already has a gradient hands it to its fresh
leaf, so that the step starts with the gradient as the user had it (alive, accumulated
into in place); :class:`InputGrads` puts its values and version back afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from remat.core._autocast import outside_autocast
from remat.core._typing import Inputs, LossFn
from remat.errors import RematError


def call_model(model: nn.Module, inputs: Inputs) -> Any:
    """Call ``model`` the way design.md defines ``inputs`` (tensor, tuple or dict), on fresh leaves for the
    inputs that require grad (NOTE [Each step's inputs are fresh])."""
    inputs = fresh_inputs(model, inputs)
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
    total = floats[0].float().sum()
    for t in floats[1:]:
        total = total + t.float().sum()
    return total


def compute_loss(output: Any, loss_fn: LossFn | None) -> torch.Tensor:
    loss = default_loss(output) if loss_fn is None else loss_fn(output)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise RematError(f"remat: loss_fn must return a scalar tensor, got {shape}; reduce it, e.g. with .mean().")
    return loss


def training_step(
    model: nn.Module,
    inputs: Inputs,
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
    with outside_autocast():  # NOTE [Autocast around remat's calls]
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


def input_tensors(inputs: Inputs) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(inputs)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def fresh_inputs(model: nn.Module, inputs: Inputs) -> Inputs:
    """``inputs`` with every tensor that requires grad (and is no parameter of ``model``) replaced by a new leaf
    over the same data: what one step reads (NOTE [Each step's inputs are fresh]). ``inputs`` itself when no
    input requires grad."""
    if not any(t.requires_grad for t in input_tensors(inputs)):
        return inputs
    own = {id(p) for p in model.parameters()}  # a parameter passed as an input stays the model's

    def fresh(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.requires_grad or id(t) in own:
            return t
        leaf = t.detach().requires_grad_()
        if t.is_leaf:
            leaf.grad = t.grad
        else:  # a non-leaf keeps no gradient: its gradient is used and freed, as backward into its graph would
            leaf.register_post_accumulate_grad_hook(_drop_grad)
        return leaf

    return tree_map(fresh, inputs)


def _drop_grad(leaf: torch.Tensor) -> None:
    leaf.grad = None


class InputGrads:
    """The gradients the user's leaf inputs hold, put back by :meth:`restore`: the same tensors, their values and
    version counters (steps accumulate into them in place, NOTE [Each step's inputs are fresh]), and ``.grad`` as
    it was on every input. Snapshots live on the CPU, so that a CUDA peak measured meanwhile never counts them."""

    def __init__(self, inputs: Inputs) -> None:
        tensors = list({id(t): t for t in input_tensors(inputs) if t.is_leaf}.values())
        self.saved = [
            (t, t.grad, None if t.grad is None else (t.grad.detach().to("cpu", copy=True), t.grad._version))
            for t in tensors
        ]
        """Per leaf input: (it, its gradient, (the gradient's values, its version) where it has one)."""

    def restore(self) -> None:
        for t, grad, snapshot in self.saved:
            if grad is not None and snapshot is not None and grad._version != snapshot[1]:
                with torch.no_grad():
                    grad.copy_(snapshot[0])
                _set_version(grad, snapshot[1])
            if t.grad is not grad:
                t.grad = grad


def _set_version(t: torch.Tensor, version: int) -> None:
    try:
        torch._C._autograd._unsafe_set_version_counter((t,), (version,))
    except TypeError:  # older torch takes one tensor (the stubs describe the current signature only)
        torch._C._autograd._unsafe_set_version_counter(t, version)  # type: ignore[arg-type]


def input_grads(inputs: Inputs) -> list[torch.Tensor]:
    """The gradients the leaf inputs already hold: alive through every step (resting)."""
    return [t.grad for t in input_tensors(inputs) if t.is_leaf and t.grad is not None]


# NOTE [Training mode keeps the modules the user froze]
# remat profiles and verifies a training step whatever mode the model is in (``training=True``):
# ``from_pretrained`` hands out a model in eval mode, trained after ``model.train()``. A model the
# user already put in training mode may hold submodules they put back in eval mode: BatchNorm
# frozen for fine-tuning (detection and segmentation do), a frozen encoder or teacher. Its
# training step runs them so, and ``model.train()`` would switch them on: the profile measured
# another step (batch statistics, the running ones updated), and a traced plan, which runs only
# in the modes it was traced in, was measured within the budget by auto in those modes while
# every step of the user's ran the class's forward, checkpointing nothing (a conv net with frozen
# BatchNorm: a plan measured at 131,424 B, the user's step at 294,696 B, its peak without
# checkpointing). So a model whose own mode is training keeps every module's mode as it is; one
# in eval mode is switched whole.
def set_training(model: nn.Module, training: bool | None) -> None:
    """``model`` in ``training`` mode (None: as it is) for a step remat runs (NOTE [Training mode keeps the
    modules the user froze]); the caller puts the modes back."""
    if training is None or (training and model.training):
        return
    model.train(training)
