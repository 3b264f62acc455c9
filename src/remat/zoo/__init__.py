"""Named models with random weights and synthetic batches, for demos, tests and benchmarks.

Every builder returns a :class:`ZooModel`; nothing is downloaded. The real
architectures are built from ``transformers`` configs, imported only when such a
model is asked for (``import remat`` does not import transformers). Defaults are
sized so that one training step takes about 0.5-2 s on 2 CPU cores:

==========  ===================================================================
seed-cifar  seed 000's CIFAR-10 CNN, batch 256 x 3x32x32
gpt2        GPT2LMHeadModel: 6 layers, hidden 512, 8 heads, vocab 8192,
            dropout 0.1 (residual, embedding, attention), batch 4 x 256 tokens
llama       LlamaForCausalLM: 6 layers, hidden 512, intermediate 1376, 8 heads,
            4 KV heads, vocab 8192, batch 4 x 256 tokens
vit         ViTForImageClassification: ViT-B/16's layout (12 layers, patch
            16, 224x224, MLP 4x hidden) at ViT-S/16's width (hidden 384,
            6 heads), 1000 classes, batch 4 x 197 tokens
resnet50    ResNetForImageClassification with ``ResNetConfig()``'s layout
            (bottleneck depths 3-4-6-3), 1000 classes, batch 4 x 3x128x128
==========  ===================================================================

NOTE [Building for training]
* Reproducible: weights come from ``torch.manual_seed(seed)`` inside
  ``torch.random.fork_rng`` (the caller's RNG stream is left as it was), data
  from a ``torch.Generator`` seeded with ``seed``. Same seed, same model and batch.
* ``use_cache=False``: a language model called in training with the config's
  default ``use_cache=True`` builds a KV cache and every decoder layer appends to
  it. Under checkpointing the recompute appends a second time (eager attention
  then fails on mismatched shapes; SDPA silently crops the doubled keys), and
  while the output lives the cache holds every layer's keys and values. Training
  never reads the cache; ``transformers`` turns it off under its own gradient
  checkpointing for the same reason.
* ``attention="sdpa"`` by default: it is what ``transformers`` users train with,
  and on CPU without attention dropout it dispatches to
  ``aten._scaled_dot_product_flash_attention_for_cpu``, the fused op that the
  selective policy keeps (``remat.SAVE_OPS``). With attention dropout > 0
  (GPT-2's 0.1) CPU SDPA falls back to the math path, which materialises the
  attention maps and draws the dropout mask from the CPU RNG (restored in
  recompute). ``attention="eager"`` gives transformers' explicit
  matmul-softmax-dropout-matmul instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import RematError
from remat.zoo._base import ZooModel, check_positive, generator, weights
from remat.zoo._hf import gpt2, llama, resnet50, vit

__all__ = ["ZooModel", "build", "names", "options", "SeedCifarCNN"]


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
    """Seed 000's CNN on a random CIFAR-10-shaped batch."""
    check_positive("seed-cifar", batch=batch)
    gen = generator(seed)
    model = weights(seed, SeedCifarCNN)
    images = torch.randn(batch, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (batch,), generator=gen)
    return ZooModel(
        name="seed-cifar",
        model=model,
        inputs=images,
        # the labels follow the logits: a user moves the model and the images to the GPU, not this closure
        loss_fn=lambda logits: F.cross_entropy(logits, labels.to(logits.device)),
        blocks=("cnn_block_1", "cnn_block_2", "head"),
    )


_BUILDERS: dict[str, Callable[..., ZooModel]] = {
    "seed-cifar": _seed_cifar,
    "gpt2": gpt2,
    "llama": llama,
    "vit": vit,
    "resnet50": resnet50,
}


def names() -> list[str]:
    """Names :func:`build` accepts."""
    return sorted(_BUILDERS)


def options(name: str) -> dict[str, Any]:
    """The options :func:`build` accepts for model ``name``, with their defaults."""
    if name not in _BUILDERS:
        raise RematError(f"remat.zoo.options: unknown model {name!r}; known models: {', '.join(names())}.")
    return {k: p.default for k, p in inspect.signature(_BUILDERS[name]).parameters.items()}


def build(name: str, **options: Any) -> ZooModel:
    """Build zoo model ``name`` with random weights; ``options`` set its sizes (e.g. ``batch=64``).

    Every model takes ``seed`` (same seed, identical weights and batch) and
    ``batch``; the other options and their defaults are the keyword arguments of
    the builder (see the table at the top of this module).
    """
    if name not in _BUILDERS:
        raise RematError(f"remat.zoo.build: unknown model {name!r}; known models: {', '.join(names())}.")
    builder = _BUILDERS[name]
    accepted = inspect.signature(builder).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise RematError(
            f"remat.zoo.build: bad options for {name!r}: {', '.join(unknown)}; {name!r} accepts {', '.join(accepted)}."
        )
    return builder(**options)
