"""What the doctor's checks read and write: a finding, the records of a step, the measured costs,
and the phrases (modules, call sites, the fix for reentrant calls) their messages share."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from remat.core.measure import Measurement
from remat.diagnosis._calls import ROOT, CheckpointCall

ERROR, WARNING = "error", "warning"


@dataclass(frozen=True)
class Finding:
    """One problem the doctor found, with the numbers behind it and how to fix it."""

    code: str
    """Stable identifier: ``frozen-by-checkpoint``, ``wrong-gradients``, ``rng-not-preserved``,
    ``saved-random-op``, ``rng-stream-changed``, ``buffers-updated-twice``, ``side-effects-repeated``,
    ``not-reproducible``, ``checkpoint-does-not-pay``, ``risky-call`` or ``illusory-speedup``."""
    severity: str
    """``"error"``: training differs from the model without checkpointing; ``"warning"``:
    training is right but the checkpointing is wasteful, risky or misread."""
    message: str
    """What happened, with the numbers, and why."""
    fix: str
    """What to change."""
    modules: tuple[str, ...] = ()
    """Qualified names of the modules involved (``<root>`` for the model itself)."""
    params: tuple[str, ...] = ()
    """Parameter names involved, worst first where there is an order."""
    sites: tuple[str, ...] = ()
    """``file:line`` of the checkpoint calls involved."""
    numbers: dict[str, float] = field(default_factory=dict)
    """The measured numbers the message quotes, by name."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass
class StepRecord:
    """What one observed training step left behind."""

    loss: float
    grads: dict[str, torch.Tensor | None]
    """Gradient of every trainable parameter (None: received none)."""
    buffers: dict[str, torch.Tensor]
    python: dict[tuple[str, str], Any]
    """Watched Python values after the step (``remat.diagnosis._python_state``)."""
    calls: list[CheckpointCall]
    forward_calls: dict[str, int]
    """Module forwards started in forward, by module name."""
    backward_calls: dict[str, int]
    """Module forwards started during backward (recomputation)."""
    completed: dict[str, int]
    """Module forwards that returned (their forward hooks ran), forward and backward."""
    rng: list[torch.Tensor] = field(default_factory=list)
    """The RNG states after the step: CPU, then each CUDA device (when CUDA is initialised)."""


@dataclass
class Costs:
    """Measured steps: reference (no checkpointing), as written, and without one checkpoint each (every call of
    one target at one site)."""

    reference: Measurement
    checkpointed: Measurement | None
    without: dict[tuple[str, str], Measurement]


MISSING = object()
"""A Python attribute a step did not leave set (in one of two ``StepRecord.python``)."""


def same_python(a: StepRecord, b: StepRecord, key: tuple[str, str]) -> bool:
    """Whether two steps left the Python attribute ``key`` alike (NaN equal to NaN: a loss scale's NaN stays)."""
    x, y = a.python.get(key, MISSING), b.python.get(key, MISSING)
    return x == y or (isinstance(x, float) and isinstance(y, float) and x != x and y != y)


def owner_of(param: str) -> str:
    return param.rpartition(".")[0] or ROOT


def collapse(chosen: Iterable[str], every: Iterable[str]) -> tuple[str, ...]:
    """The outermost modules below the root all of whose parameters (among ``every``) are in ``chosen``."""
    chosen, every = list(chosen), list(every)
    picked = set(chosen)
    out: list[str] = []
    for name in chosen:
        parts = name.split(".")[:-1]
        for i in range(min(1, len(parts)), len(parts) + 1):
            prefix = ".".join(parts[:i])
            under = [p for p in every if not prefix or p.startswith(prefix + ".")]
            if all(p in picked for p in under):
                module = prefix or ROOT
                if module not in out:
                    out.append(module)
                break
    return tuple(out)


def union_of(groups: Iterable[Iterable[str]]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(m for g in groups for m in g))


def where_called(calls: Iterable[CheckpointCall]) -> str:
    seen = dict.fromkeys(f"{c.api}({c.label})" + (f" at {c.site}" if c.site else "") for c in calls)
    return "; ".join(seen)


def call_sites(calls: Iterable[CheckpointCall]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(c.site for c in calls if c.site))


def within_module(call: CheckpointCall, module: str) -> bool:
    return module in call.modules or any(module == m or module.startswith(m + ".") for m in call.module_names)


def reentrant_fix(calls: Iterable[CheckpointCall]) -> str:
    apis = {c.api for c in calls}
    fixes = ["use remat.checkpoint(fn, *args) or remat.wrap(module), which never freeze parameters"]
    if "Hugging Face gradient checkpointing" in apis:
        fixes.append('call model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})')
    if "torch checkpoint_wrapper" in apis:
        fixes.append("pass checkpoint_impl=CheckpointImpl.NO_REENTRANT to checkpoint_wrapper")
    if apis & {"torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint_sequential"}:
        fixes.append("pass use_reentrant=False")
    text = "; or ".join(fixes)
    return text[0].upper() + text[1:] + "."


def fastest(m: Measurement) -> float:
    """The fastest timed step: other work on the machine only ever adds time, so comparisons use it."""
    return min(m.step_times_s)
