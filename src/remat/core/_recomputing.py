"""Whether remat is recomputing or copying for itself, and who is told of each recomputation.

Thread-local depths: ``is_recomputing()`` is public (``remat.is_recomputing``), the bookkeeping flag lets the
profiler tell the model's storages from remat's copies, and the observer times each outermost recomputation.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from remat.core._timing import WallClock

__all__ = ["bookkeeping", "in_bookkeeping", "is_recomputing", "observed_recomputation", "recompute_observer"]

_local = threading.local()


def is_recomputing() -> bool:
    """True while remat is rerunning a checkpointed function in backward.

    Guard side effects that must happen once per step (counters, logging, caches)
    with ``if not remat.is_recomputing(): ...``.
    """
    return getattr(_local, "recomputing", 0) > 0


def in_bookkeeping() -> bool:
    """True while remat copies a buffer or input for itself (not an op of the user's model)."""
    return getattr(_local, "bookkeeping", 0) > 0


@contextlib.contextmanager
def bookkeeping() -> Iterator[None]:
    # The profiler tells the model's own storages from remat's copies by this flag (NOTE [Storages
    # across blocks] in remat.profiling._crossing): a copy exists only in checkpointed runs.
    _local.bookkeeping = getattr(_local, "bookkeeping", 0) + 1
    try:
        yield
    finally:
        _local.bookkeeping -= 1


_observer: list[tuple[Callable[[Any, Any], None], Any, Any]] = []
"""The profiler's recompute observer. Process-wide, not per thread: on CUDA autograd runs
backward, and so every recomputation, on a device thread of its own, which a thread-local
observer set by the profiling thread would never reach (recompute time read as 0)."""


@contextlib.contextmanager
def recompute_observer(
    callback: Callable[[Any, Any], None], clock: Any = None, on_start: Callable[[nn.Module | None], None] | None = None
) -> Iterator[None]:
    """Call ``on_start(module)`` before and ``callback(start, end)`` after every outermost recomputation, on
    any thread (profiling); ``module`` is the one whose forward is recomputed (None for a function).

    ``start`` and ``end`` are ``clock.mark()`` values (``remat.core._timing``; host seconds by default).
    """
    _observer.append((callback, clock if clock is not None else WallClock(), on_start))
    try:
        yield
    finally:
        _observer.pop()


@contextlib.contextmanager
def observed_recomputation(owner: nn.Module | None) -> Iterator[None]:
    """One recomputation of ``owner``'s forward: ``is_recomputing()`` inside, told to the observer when
    outermost (a region inside another's recomputation is in the outer's time)."""
    depth = getattr(_local, "recomputing", 0)
    _local.recomputing = depth + 1
    observer = _observer[-1] if depth == 0 and _observer else None
    if observer is not None and observer[2] is not None:
        observer[2](owner)
    start = observer[1].mark() if observer is not None else None
    try:
        yield
    finally:
        _local.recomputing -= 1
        if observer is not None:
            observer[0](start, observer[1].mark())
