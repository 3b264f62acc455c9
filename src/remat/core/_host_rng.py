"""Python's and NumPy's generators across a checkpointed call's recomputation.

NOTE [Host generators in recomputation]
torch's checkpoint puts torch's generators back for a recomputation, so dropout draws the
same masks again. A block that draws from Python's ``random`` or NumPy's global generator
(a mask from ``np.random``, ``random.random()`` deciding a branch) draws other numbers when
it is recomputed, and its gradients are silently those of another function, under
``torch.utils.checkpoint`` too. Taking both states costs tens of microseconds a call
(NumPy's ``get_state`` builds a dictionary), which a fast GPU would pay at every block, so
a callable's first forward learns whether it moves either generator (its states before and
after compared), and only the callables that do pay from then on: their forward keeps the
states it started from, and each recomputation runs from them and puts back the states that
were current. A callable that draws only on some calls, never on its first, is not seen;
nor is a draw in a cheap region of ``"selective"`` by module, whose submodules (norms,
activations) are recomputed by their own hook.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from remat.core._state import host_rng, set_host_rng

__all__ = ["HOST_DRAWS", "HostDraws", "same_host_rng"]

#: Per callable, whether its first forward moved Python's or NumPy's generator.
HOST_DRAWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def same_host_rng(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    """Whether two :func:`remat.core._state.host_rng` states are the same (neither generator drew between)."""
    (python_a, numpy_a), (python_b, numpy_b) = a, b
    if python_a != python_b:
        return False
    if numpy_a is None or numpy_b is None:
        return numpy_a is numpy_b
    # ('MT19937', keys, pos, has_gauss, cached_gaussian): the position moves with every draw, the keys when it wraps
    return bool(numpy_a[2] == numpy_b[2] and numpy_a[3:] == numpy_b[3:] and (numpy_a[1] == numpy_b[1]).all())


class HostDraws:
    """One checkpointed call's host generators (NOTE [Host generators in recomputation])."""

    def __init__(self, draws: bool | None, remember: Callable[[bool], None]) -> None:
        self.draws = draws
        """What earlier calls learned: True (it draws), False (it does not), None (not known yet)."""
        self.remember = remember
        self.start: tuple[Any, Any] | None = None

    def forward(self, fn: Callable[[], Any]) -> Any:
        """Run the forward ``fn``, keeping the states it starts from where the callable draws (or may)."""
        if self.draws is False:
            return fn()
        self.start = host_rng()
        out = fn()
        if self.draws is None:
            moved = not same_host_rng(self.start, host_rng())
            self.remember(moved)
            if not moved:
                self.start = None
        return out

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        """A recomputation, from the states the forward started from; the current ones are put back after it."""
        if self.start is None:
            yield
            return
        current = host_rng()
        set_host_rng(self.start)
        try:
            yield
        finally:
            set_host_rng(current)
