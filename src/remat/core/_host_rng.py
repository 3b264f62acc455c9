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
were current. A callable that did not draw on its first call may draw on a later one (a
branch on the data, a schedule); the states before such a call are gone by the time it is seen,
so every call of a callable that did not draw reads where the generators stand before and after
(``host_clock``, a microsecond), and one that moved them stops the step in its forward, before
any gradient exists, with a ``HostDrawError``: its recomputation would draw other numbers. From
then on the calls of that callable, and of every callable running the same code (the other layers
of its class, which the stopped forward never reached), keep their states, so the step run again
is exact. Not seen: a draw in a cheap region of ``"selective"`` by module, whose submodules
(norms, activations) are recomputed by their own hook.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from remat.core._host_clock import host_clock
from remat.core._state import host_rng, set_host_rng
from remat.errors import HostDrawError

__all__ = ["HOST_DRAWS", "HostDraws", "same_host_rng"]

#: Per callable, whether its first forward moved Python's or NumPy's generator.
HOST_DRAWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: The functions (a module's ``forward``) seen drawing on a later call: every callable running them keeps its states.
_DRAWS_LATER: weakref.WeakSet = weakref.WeakSet()


def _code_of(fn: Callable) -> Any:
    """The function ``fn`` runs, shared by the layers of one class."""
    if isinstance(fn, types.MethodType):
        return fn.__func__
    forward = getattr(type(fn), "forward", None)
    return forward if forward is not None else fn


def _name_of(fn: Callable) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


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

    def __init__(self, draws: bool | None, remember: Callable[[bool], None], fn: Callable) -> None:
        code = _code_of(fn)
        try:
            later = code in _DRAWS_LATER
        except TypeError:  # not weakly referenceable
            code, later = None, False
        self.draws = None if draws is False and later else draws
        """What earlier calls learned: True (it draws), False (it does not), None (not known yet)."""
        self.remember = remember
        self.start: tuple[Any, Any] | None = None
        self.fn, self.code = fn, code

    def forward(self, fn: Callable[[], Any]) -> Any:
        """Run the forward ``fn``, keeping the states it starts from where the callable draws (or may)."""
        if self.draws is False:
            before = host_clock()
            out = fn()
            if host_clock() != before:
                self.remember(True)
                if self.code is not None:
                    _DRAWS_LATER.add(self.code)
                raise HostDrawError(
                    f"remat.checkpoint: {_name_of(self.fn)} drew from Python's or NumPy's random generator on "
                    "this call but not on its first checkpointed call, so the generators' states before it were "
                    "not kept: its recomputation in backward would draw other numbers and give the gradients of "
                    "another function. The step is stopped in its forward, before any gradient. remat keeps the "
                    "generator states of this function (and of every layer running its code) from now on: run the "
                    "step again (or draw with torch's generator, which checkpointing replays: torch.rand instead "
                    "of np.random.rand)."
                )
            return out
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
