"""What differs between two recorded steps, and the finding for a model whose plain step differs from itself.

NOTE [A model must agree with itself before checkpointing is blamed]
The doctor blames checkpointing for whatever differs between the step without it and the
step with it. That holds only if the step without it is reproducible from what the doctor
restores (weights, buffers, RNG states, Python attributes). Some models are not: Hugging
Face's Reformer re-seeds its layers with ``torch.seed()`` in training, and a model may read
a clock, a generator of its own or a global counter. So when the checkpointed step differs
from the plain one, the doctor runs the plain step once more: what differs between the two
plain steps is noise, not evidence. The correctness checks leave those parameters, buffers,
streams and attributes out, and a ``not-reproducible`` warning names them; the rest is
still checked. A model that agrees with itself pays nothing for this (no extra step).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from remat.diagnosis._calls import ROOT
from remat.diagnosis._findings import WARNING, Finding, StepRecord, collapse, owner_of, same_python


@dataclass(frozen=True)
class Differences:
    """What two recorded steps from the same starting state leave differently."""

    grads: tuple[str, ...] = ()
    """Parameters whose gradients differ beyond the tolerance (or that get one in only one step), worst first."""
    max_grad_error: float = 0.0
    """The largest of those differences, relative to the first step's largest gradient of that parameter."""
    buffers: tuple[str, ...] = ()
    """Buffers that end the steps unequal."""
    python: tuple[tuple[str, str], ...] = ()
    """Watched Python attributes (module, attribute) that end the steps unequal."""
    rng: bool = False
    """True when the RNG states after the steps differ."""
    losses: tuple[float, float] = (0.0, 0.0)
    """Both steps' losses."""

    def __bool__(self) -> bool:
        return bool(self.grads or self.buffers or self.python or self.rng)


def _grad_error(a: torch.Tensor | None, b: torch.Tensor | None, rtol: float, atol: float) -> float | None:
    """``b``'s error relative to ``a``'s largest value when beyond ``atol + rtol * max|a|``, else None."""
    if a is None and b is None:
        return None
    if a is None or b is None:
        nonzero = a if a is not None else b
        return float("inf") if nonzero is not None and bool(nonzero.any()) else None
    err = float((b.double() - a.double()).abs().max())
    scale = float(a.abs().max())
    if err <= atol + rtol * scale:
        return None
    return err / scale if scale else float("inf")


def differences(first: StepRecord, second: StepRecord, rtol: float, atol: float) -> Differences:
    """Everything the doctor's comparisons would see differ between ``first`` and ``second``."""
    errors = []
    for name in dict.fromkeys([*first.grads, *second.grads]):
        err = _grad_error(first.grads.get(name), second.grads.get(name), rtol, atol)
        if err is not None:
            errors.append((err, name))
    errors.sort(reverse=True)
    buffers = tuple(
        n
        for n, b in first.buffers.items()
        if n in second.buffers and (b.shape != second.buffers[n].shape or not torch.equal(b, second.buffers[n]))
    )
    python = tuple(key for key in dict.fromkeys([*first.python, *second.python]) if not same_python(first, second, key))
    rng = len(first.rng) != len(second.rng) or not all(torch.equal(a, b) for a, b in zip(first.rng, second.rng))
    return Differences(
        grads=tuple(n for _, n in errors),
        max_grad_error=errors[0][0] if errors else 0.0,
        buffers=buffers,
        python=python,
        rng=rng,
        losses=(first.loss, second.loss),
    )


def without_noise(record: StepRecord, noise: Differences) -> StepRecord:
    """``record`` with what varies between two plain steps taken out, so that no check compares it."""
    grads = {n: g for n, g in record.grads.items() if n not in noise.grads}
    buffers = {n: b for n, b in record.buffers.items() if n not in noise.buffers}
    python = {k: v for k, v in record.python.items() if k not in noise.python}
    rng = [] if noise.rng else record.rng
    return StepRecord(
        record.loss,
        grads,
        buffers,
        python,
        record.calls,
        record.forward_calls,
        record.backward_calls,
        record.completed,
        rng,
    )


def _listed(count: int, what: str, names: Iterable[str]) -> str:
    names = list(names)
    more = ", ..." if len(names) > 3 else ""
    return f"{count} {what}{'' if count == 1 else 's'} ({', '.join(names[:3])}{more})"


def _covering(params: tuple[str, ...], every: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Whole modules where every parameter is in ``params``, and the parameters outside those."""
    modules = collapse(params, every)
    rest = tuple(p for p in params if not any(m == ROOT or p.startswith(m + ".") for m in modules))
    return modules, rest


def check_reproducible(noise: Differences, every_param: Iterable[str]) -> list[Finding]:
    """The warning for a plain step that differs from itself: what could not be checked, and how to fix that."""
    if not noise:
        return []
    whole, rest = _covering(noise.grads, list(every_param))
    parts = []
    if noise.grads:
        parts.append(
            f"the gradients of {_listed(len(noise.grads), 'parameter', (*whole, *rest))}, up to "
            f"{noise.max_grad_error:.3g} of the largest gradient"
        )
    if noise.buffers:
        parts.append(_listed(len(noise.buffers), "buffer", noise.buffers))
    if noise.python:
        parts.append(_listed(len(noise.python), "Python attribute", (a for _, a in noise.python)))
    if noise.rng:
        parts.append("the random number streams")
    a, b = noise.losses
    message = (
        "Two training steps without checkpointing, from the same weights, buffers, RNG states and Python attributes, "
        f"differ (loss {a:.6g}, then {b:.6g}): in {'; '.join(parts)}. The model draws on state the doctor cannot "
        "restore (torch.seed(), a generator of its own, a clock, a global counter), so those were not compared "
        "with the checkpointed step; everything else was."
    )
    fix = (
        "Make one step reproducible (seed with torch.manual_seed, not torch.seed(); draw from the default "
        "generators; torch.use_deterministic_algorithms(True)), then run the doctor again to check the rest."
    )
    modules = tuple(dict.fromkeys([*whole, *(owner_of(p) for p in rest)]))
    numbers = {
        "params": len(noise.grads),
        "buffers": len(noise.buffers),
        "python": len(noise.python),
        "rng_streams": float(noise.rng),
        "max_rel_grad_difference": noise.max_grad_error,
    }
    return [Finding("not-reproducible", WARNING, message, fix, modules, noise.grads, (), numbers)]
