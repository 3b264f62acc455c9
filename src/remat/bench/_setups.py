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

import torch
import torch.utils.checkpoint as tc
from torch import nn

import remat
from remat.core._policies import SAVE_OPS, _save_compute_intensive
from remat.planning.plan import Plan


@dataclass
class Setup:
    """One way of running the step."""

    name: str
    """Row label."""
    kind: str
    """``baseline``, ``compile`` (a ``torch.compile`` baseline) or ``remat``."""
    on: Callable[[nn.Module], None]
    off: Callable[[nn.Module], None]
    plan: Plan | None = None
    """remat's plan, for remat rows."""


def _torch_forward(module: nn.Module, context_fn: Callable | None = None) -> None:
    inner = type(module).forward.__get__(module)
    extra: dict[str, Any] = {"context_fn": context_fn} if context_fn is not None else {}

    def forward(*args: Any, **kwargs: Any) -> Any:
        return tc.checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward


def _clear(modules: Sequence[nn.Module]) -> None:
    for m in modules:
        m.__dict__.pop("forward", None)


def _hf_prefix(model: nn.Module) -> str | None:
    """``activation`` or ``gradient``: how this transformers version names its checkpointing switch.

    NOTE [transformers renamed gradient checkpointing]
    transformers 5.2x calls it ``activation_checkpointing_enable`` /
    ``is_activation_checkpointing`` (the ``gradient_*`` names are deprecated aliases
    that warn); 4.x and 5.17 only have ``gradient_checkpointing_enable`` /
    ``is_gradient_checkpointing``. None when the model has neither.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        return None
    for prefix in ("activation", "gradient"):
        if callable(getattr(type(model), f"{prefix}_checkpointing_enable", None)):
            return prefix
    return None


def hf_checkpointing_on(model: nn.Module) -> bool:
    """True while transformers' own checkpointing is on (under either name)."""
    prefix = _hf_prefix(model)
    flag = getattr(model, f"is_{prefix}_checkpointing", False) if prefix else False
    return bool(flag() if callable(flag) else flag)


def every_block(blocks: Sequence[nn.Module]) -> Setup:
    """torch's non-reentrant checkpoint on every block (what HF's gradient_checkpointing_enable does)."""
    hooks_before: list[Any] = []

    def on(model: nn.Module) -> None:
        prefix = _hf_prefix(model)
        if prefix is not None:
            hooks_before[:] = getattr(model, "_require_grads_hooks", None) or []
            try:
                getattr(model, f"{prefix}_checkpointing_enable")({"use_reentrant": False})
                return
            except ValueError:  # transformers 5 refuses it for ResNet; do what it would do
                pass
        for b in blocks:
            _torch_forward(b)

    def off(model: nn.Module) -> None:
        if hf_checkpointing_on(model):
            getattr(model, f"{_hf_prefix(model)}_checkpointing_disable")()
            _remove_input_grad_hooks(model, hooks_before)
        _clear(blocks)

    return Setup("every block (torch)", "baseline", on, off)


def _remove_input_grad_hooks(model: nn.Module, keep: list[Any]) -> None:
    """Undo the embedding hook that HF's enable adds and its disable leaves behind (outside PEFT).

    Left alone, every enable/disable cycle stacks one more forward hook on the
    input embeddings (transformers 5.x), which also changes what torch.compile
    guards on.
    """
    hooks = getattr(model, "_require_grads_hooks", None) or []
    for hook in hooks:
        if all(hook is not k for k in keep):
            hook.remove()
    if hooks:
        model._require_grads_hooks = list(keep)  # type: ignore[assignment]  # Module.__setattr__ takes any value
        if keep:
            model._require_grads_hook = keep[0]
        else:
            model.__dict__.pop("_require_grads_hook", None)


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
    segments = [list(blocks[i : i + size]) for i in range(0, n, size)]

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


def torch_compile(budget: float) -> Setup:
    """``torch.compile`` (inductor) of the model's forward, with the min-cut partitioner's memory budget.

    ``torch._functorch.config.activation_memory_budget`` (1.0: what the default
    partitioner saves; 0.0: recompute all it can) is read when AOTAutograd
    partitions the graph, so it is set inside this setup's own backend. A
    backend per setup also keeps each budget's graphs apart in dynamo's cache
    (entries are guarded on the backend). Only the first step compiles.
    """
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
        with functorch_config.patch(activation_memory_budget=budget):
            fn = compile_fx(gm, example_inputs)
        if not callable(fn):  # only an ahead-of-time export returns paths or weights instead
            raise RuntimeError(f"remat.bench: inductor compiled the graph to a {type(fn).__name__}, not a callable")
        return fn

    compiled: dict[int, Callable] = {}

    def on(model: nn.Module) -> None:
        if id(model) not in compiled:
            compiled[id(model)] = torch.compile(type(model).forward.__get__(model), backend=backend)
        model.forward = compiled[id(model)]

    return Setup(f"torch.compile, budget {budget:g}", "compile", on, lambda model: _clear([model]))


def no_checkpointing() -> Setup:
    return Setup("none", "baseline", lambda model: None, lambda model: None)


def remat_plan(plan: Plan, label: str) -> Setup:
    def on(model: nn.Module) -> None:
        remat.apply(model, plan)

    def off(model: nn.Module) -> None:
        remat.remove(model)

    return Setup(label, "remat", on, off, plan)


def baselines(model: nn.Module, block_names: Sequence[str]) -> list[Setup]:
    modules = dict(model.named_modules())
    blocks = [modules[n] for n in block_names]
    return [no_checkpointing(), every_block(blocks), sqrt_segments(blocks), torch_selective(blocks)]
