"""Where the time of a remat call goes: seconds and counts per phase, logged at INFO (``remat profile -v``).

NOTE [Where the time goes]
``remat.auto`` runs a fake profile, maybe a real one, planning and verification steps; which
of them dominates depends on the model (a fake profile costs a fixed time per op, heavy on
models of many small ops; a real step costs the model's step). ``costs(api)`` opens a ledger
for one call and logs it when the call ends; ``spent(phase)`` charges the time of a phase to
the open ledger, if any (nothing is recorded outside a call that opened one). Phases nest, and
a phase is charged only its own time (its inner phases' time is theirs), so the phases add up
to the call's time, less what the log calls "other".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

__all__ = ["Costs", "costs", "spent"]

log = logging.getLogger("remat")


@dataclass
class Costs:
    """The ledger of one call: per phase, its own seconds and how many times it ran."""

    api: str
    start: float = field(default_factory=time.perf_counter)
    end: float | None = None
    """When the call ended (None: still running)."""
    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    _inner: list[float] = field(default_factory=lambda: [0.0])
    """Per open phase (the call itself at the bottom), the seconds its inner phases took."""

    def total(self) -> float:
        """Seconds of the call, so far while it runs."""
        return (time.perf_counter() if self.end is None else self.end) - self.start

    def summary(self, step_s: float | None = None) -> str:
        total = self.total()
        parts = [f"{p} {s:.2f} s ({self.counts[p]}x)" for p, s in sorted(self.seconds.items(), key=lambda i: -i[1])]
        other = total - sum(self.seconds.values())
        steps = f", {total / step_s:.1f} training steps of {step_s * 1e3:.0f} ms" if step_s else ""
        return f"{self.api}: {total:.2f} s{steps}: " + ", ".join([*parts, f"other {other:.2f} s"])


_ledger: ContextVar[Costs | None] = ContextVar("remat_costs", default=None)


@contextmanager
def costs(api: str) -> Iterator[Costs]:
    """Open a ledger for one call of ``api`` and log it at INFO when the call ends; inside another call's
    ledger, the phases go to that one (the outer call logs them)."""
    outer = _ledger.get()
    if outer is not None:
        yield outer
        return
    ledger = Costs(api)
    token = _ledger.set(ledger)
    try:
        yield ledger
    finally:
        ledger.end = time.perf_counter()
        _ledger.reset(token)
        log.info("%s", ledger.summary())


@contextmanager
def spent(phase: str) -> Iterator[None]:
    """Charge the time of ``phase`` (less its inner phases') to the open ledger; free without one."""
    ledger = _ledger.get()
    if ledger is None:
        yield
        return
    ledger._inner.append(0.0)
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        inner = ledger._inner.pop()
        ledger._inner[-1] += elapsed
        ledger.seconds[phase] = ledger.seconds.get(phase, 0.0) + elapsed - inner
        ledger.counts[phase] = ledger.counts.get(phase, 0) + 1
