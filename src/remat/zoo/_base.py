"""What every zoo builder shares: the :class:`ZooModel` it returns, seeded weights and batches, option checks.

See NOTE [Building for training] in :mod:`remat.zoo` for why weights and data are seeded this way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from remat.core._typing import Inputs, LossFn
from remat.errors import RematError


@dataclass
class ZooModel:
    """A model, a batch it is called with, and the loss of a training step."""

    name: str
    """Zoo name the model was built from."""
    model: nn.Module
    """The model, in training mode, random weights."""
    inputs: Inputs
    """What the model is called with: a tensor, a tuple or a dict."""
    loss_fn: LossFn | None
    """``loss_fn(output) -> scalar``; None means ``output.loss`` / sum of outputs."""
    blocks: tuple[str, ...] = field(default=())
    """Qualified names of the repeated blocks, the natural checkpointing units."""


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def weights(seed: int, make: Callable[[], nn.Module]) -> nn.Module:
    """``make()`` under ``torch.manual_seed(seed)``, in training mode, caller's RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make().train()


def fail(name: str, problem: str, fix: str) -> RematError:
    return RematError(f"remat.zoo.build({name!r}): {problem}; {fix}.")


def check_positive(name: str, **sizes: int) -> None:
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise fail(name, f"{key}={value!r} is not a positive integer", f"pass {key}=1 or more")


def check_divides(name: str, big: str, big_value: int, small: str, small_value: int) -> None:
    if big_value % small_value:
        near = -(-big_value // small_value) * small_value  # the next multiple up
        raise fail(
            name,
            f"{big}={big_value} is not a multiple of {small}={small_value}",
            f"choose e.g. {big}={near}",
        )


def check_classes(name: str, classes: int) -> None:
    # One label would make transformers treat the task as regression (MSE on integer labels).
    if classes < 2:
        raise fail(name, f"classes={classes} leaves nothing to classify", "pass classes=2 or more")


def check_seq(name: str, seq: int) -> None:
    # The model shifts labels by one: a single token leaves no target and a NaN loss.
    if seq < 2:
        raise fail(name, f"seq={seq} leaves no next token to predict", "pass seq=2 or more")


def check_dropout(name: str, dropout: float) -> None:
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise fail(name, f"dropout={dropout!r} is outside [0, 1)", "pass e.g. dropout=0.1, or 0.0 for none")


def check_attention(name: str, attention: str) -> None:
    if attention not in ("sdpa", "eager"):
        raise fail(name, f"attention={attention!r} is not supported", "pass attention='sdpa' or attention='eager'")
