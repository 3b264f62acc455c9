"""Named models with random weights and synthetic batches, for demos, tests and benchmarks.

Every builder returns a :class:`ZooModel`; nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import RematError

__all__ = ["ZooModel", "build", "names", "SeedCifarCNN"]


@dataclass
class ZooModel:
    """A model, a batch it is called with, and the loss of a training step."""

    name: str
    """Zoo name the model was built from."""
    model: nn.Module
    """The model, in training mode, random weights."""
    inputs: Any
    """What the model is called with: a tensor, a tuple or a dict."""
    loss_fn: Callable[[Any], torch.Tensor] | None
    """``loss_fn(output) -> scalar``; None means ``output.loss`` / sum of outputs."""
    blocks: tuple[str, ...] = field(default=())
    """Qualified names of the repeated blocks, the natural checkpointing units."""


class SeedCifarCNN(nn.Module):
    """The CIFAR-10 CNN of seed 000, exactly as the user wrote it (Dropout inside the blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.cnn_block_1 = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2),
            nn.Dropout(0.25),
        )
        self.cnn_block_2 = nn.Sequential(
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2),
            nn.Dropout(0.25),
        )
        self.flatten = lambda inp: torch.flatten(inp, 1)
        self.head = nn.Sequential(nn.Linear(64 * 8 * 8, 512), nn.ReLU(), nn.Dropout(0.5), nn.Linear(512, 10))

    def forward(self, X: torch.Tensor) -> torch.Tensor:  # noqa: N803 (the user's name)
        X = self.cnn_block_1(X)
        X = self.cnn_block_2(X)
        X = self.flatten(X)
        return self.head(X)


def _seed_cifar(*, batch: int = 256, seed: int = 0) -> ZooModel:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = SeedCifarCNN()
    images = torch.randn(batch, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (batch,), generator=gen)
    return ZooModel(
        name="seed-cifar",
        model=model,
        inputs=images,
        loss_fn=lambda logits: F.cross_entropy(logits, labels),
        blocks=("cnn_block_1", "cnn_block_2", "head"),
    )


_BUILDERS: dict[str, Callable[..., ZooModel]] = {"seed-cifar": _seed_cifar}


def names() -> list[str]:
    """Names :func:`build` accepts."""
    return sorted(_BUILDERS)


def build(name: str, **options: Any) -> ZooModel:
    """Build zoo model ``name`` with random weights; ``options`` set its sizes (e.g. ``batch=64``)."""
    if name not in _BUILDERS:
        raise RematError(f"remat.zoo.build: unknown model {name!r}; known models: {', '.join(names())}.")
    try:
        return _BUILDERS[name](**options)
    except TypeError as exc:
        raise RematError(f"remat.zoo.build: bad options for {name!r}: {exc}.") from None
