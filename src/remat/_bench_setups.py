"""Today's options, set up on a zoo model so they can be measured beside remat.

Each setup is a pair of callables: ``on(model)`` installs it, ``off(model)``
removes it; nothing here changes parameter names or values.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.utils.checkpoint as tc
from torch import nn

import remat
from remat.checkpoint import SAVE_OPS, _save_compute_intensive
from remat.plan import Plan


@dataclass
class Setup:
    """One way of running the step."""

    name: str
    """Row label."""
    kind: str
    """``baseline`` or ``remat``."""
    on: Callable[[nn.Module], None]
    off: Callable[[nn.Module], None]
    plan: Plan | None = None
    """remat's plan, for remat rows."""


def _torch_forward(module: nn.Module, context_fn: Callable | None = None) -> None:
    inner = type(module).forward.__get__(module)
    extra = {"context_fn": context_fn} if context_fn is not None else {}

    def forward(*args: Any, **kwargs: Any) -> Any:
        return tc.checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward


def _clear(modules: Sequence[nn.Module]) -> None:
    for m in modules:
        m.__dict__.pop("forward", None)


def every_block(blocks: Sequence[nn.Module]) -> Setup:
    """torch's non-reentrant checkpoint on every block (what HF's gradient_checkpointing_enable does)."""

    def on(model: nn.Module) -> None:
        # transformers 5 names it activation_checkpointing_enable (gradient_* is a deprecated alias).
        enable = getattr(model, "activation_checkpointing_enable", None)
        if getattr(model, "supports_gradient_checkpointing", False) and enable is not None:
            try:
                enable({"use_reentrant": False})
                return
            except ValueError:  # transformers 5 refuses it for ResNet; do what it would do
                pass
        for b in blocks:
            _torch_forward(b)

    def off(model: nn.Module) -> None:
        flag = getattr(model, "is_activation_checkpointing", False)
        if flag() if callable(flag) else flag:
            model.activation_checkpointing_disable()
        _clear(blocks)

    return Setup("every block (torch)", "baseline", on, off)


def torch_selective(blocks: Sequence[nn.Module]) -> Setup:
    """torch's selective checkpointing on every block, saving matmul/conv/attention outputs."""
    context = functools.partial(tc.create_selective_checkpoint_contexts, _save_compute_intensive)

    def on(model: nn.Module) -> None:
        for b in blocks:
            _torch_forward(b, context)

    return Setup(f"torch SAC ({len(SAVE_OPS)} ops saved)", "baseline", on, lambda model: _clear(blocks))


def sqrt_segments(blocks: Sequence[nn.Module]) -> Setup:
    """``checkpoint_sequential``-style: ceil(sqrt(n)) segments of consecutive blocks, the last one kept.

    The blocks of a layer list are called one after another with the same extra
    arguments, so a segment is run by its first block (one checkpoint over all of
    them) while the others pass their input through.
    """
    n = len(blocks)
    count = math.ceil(math.sqrt(n))
    size = math.ceil(n / count)
    segments = [list(blocks[i:i + size]) for i in range(0, n, size)]

    def on(model: nn.Module) -> None:
        for segment in segments[:-1]:
            inners = [type(b).forward.__get__(b) for b in segment]

            def run(hidden: Any, *args: Any, _inners: list = inners, **kwargs: Any) -> Any:
                for f in _inners:
                    hidden = f(hidden, *args, **kwargs)
                return hidden

            def first(hidden: Any, *args: Any, _run: Callable = run, **kwargs: Any) -> Any:
                return tc.checkpoint(_run, hidden, *args, use_reentrant=False, **kwargs)

            segment[0].forward = first
            for b in segment[1:]:
                b.forward = lambda hidden, *args, **kwargs: hidden

    return Setup(f"sqrt(n) segments ({len(segments)})", "baseline", on, lambda model: _clear(blocks))


def no_checkpointing() -> Setup:
    return Setup("none", "baseline", lambda model: None, lambda model: None)


def remat_plan(plan: Plan, label: str) -> Setup:
    return Setup(label, "remat", lambda model: remat.apply(model, plan), remat.remove, plan)


def baselines(model: nn.Module, block_names: Sequence[str]) -> list[Setup]:
    modules = dict(model.named_modules())
    blocks = [modules[n] for n in block_names]
    return [no_checkpointing(), every_block(blocks), sqrt_segments(blocks), torch_selective(blocks)]
