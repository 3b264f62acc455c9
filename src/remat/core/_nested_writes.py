"""The versions of the inputs checkpointed calls were given inside another checkpoint's recomputation.

NOTE [A write after a call inside a recomputation]
A region checks that no input was written in place between its call and its recomputation,
by the version its tensor had then (NOTE [An input's version is its tensor's] in
remat.core._region). A region inside another checkpoint (NOTE [Regions inside regions] in
remat.core.checkpoint) is recomputed by torch with the tensors of the *outer*
recomputation's run of the same call, which the region never saw: when the outer function
wrote one of them after the call (``z = checkpoint(h, y); y.add_(1)``), the inner
recomputation read the written tensor, and the gradients were wrong with no error (torch's
nested checkpoint gives the same). So every call made during a recomputation records, when
its forward ends, the version of each input, by the view (storage, offset, shape, strides)
torch later hands back; the region refuses to recompute from a view whose version has
moved since. Where the call itself wrote an input (its version moved during the forward),
the region recomputes from its own copy of the value before, kept from the forward by
storage, which the handed tensor does not share (found by the argument's position); before,
it recomputed from the written tensor, right for ReLU(inplace=True), which is idempotent,
and wrong for ``x.mul_(0.5)`` in a block inside a segment made by hand. The
outer run's tensor itself is gone by then: torch hands back its ``detach()``, which shares
its version counter, so the handed tensor's version is read. A record counts only for a region
whose forward ended before it was made: torch stops a recomputation early once it has what
backward needs, so a call may not run again, and an older record of the same view (the same
parameter, a step earlier) says nothing of it. Records hold their storages
weakly (torch keeps one Python object per live storage) and go with them, so a storage
freed and another allocated at its address is never compared.
"""

from __future__ import annotations

import functools
import itertools
import weakref

import torch

from remat.core._writes import storage_key

View = tuple[int, int, tuple[int, ...], tuple[int, ...]]

# Process-wide: on CUDA the outer recomputation and the inner one run on autograd's device thread.
_versions: dict[View, tuple[weakref.ref, int, int, int]] = {}
"""view -> (its storage, weakly; its tensor's version as the call began, and as its forward ended; when)"""

_clock = itertools.count()


def now() -> int:
    """A number larger than every record's made so far."""
    return next(_clock)


def _view(t: torch.Tensor) -> View:
    return storage_key(t), int(t.storage_offset()), tuple(t.shape), tuple(t.stride())


def _forget(key: View, ref: weakref.ref) -> None:
    if key in _versions and _versions[key][0] is ref:
        del _versions[key]


def remember(inputs: list[torch.Tensor], entry: list[int]) -> None:
    """Record the versions of a call's inputs (``entry``: as the call began) as its forward ends, inside a
    recomputation."""
    for t, began in zip(inputs, entry):
        key = _view(t)
        _versions[key] = (weakref.ref(t.untyped_storage(), functools.partial(_forget, key)), began, t._version, now())


def recorded(t: torch.Tensor, since: int) -> tuple[int, int] | None:
    """(version as the call began, as its forward ended) of the input ``t`` views, recorded by :func:`remember`
    after ``since``; None where none is (a storage freed since and another allocated at its address is not the
    same)."""
    found = _versions.get(_view(t))
    if found is None or found[3] < since or found[0]() is not t.untyped_storage():
        return None
    return found[1], found[2]


def written_error(t: torch.Tensor, then: int, now: int, *, handed: bool) -> Exception:
    """The error for a recomputation from input ``t``, written in place since the call (``handed``: inside another
    checkpoint's recomputation)."""
    from remat.errors import RecomputeError

    where = (
        " (the call ran inside another checkpoint's recomputation, whose function wrote the tensor after it)"
        if handed
        else ""
    )
    return RecomputeError(  # torch's own check raises a RuntimeError here (NOTE [Caught like torch's] in remat.errors)
        "remat.checkpoint: an input of a checkpointed function was modified in place "
        f"after the call{where} (version {then} -> {now}, shape "
        f"{tuple(t.shape)}); recomputing from it would give wrong gradients. Clone the "
        "tensor before modifying it, or modify it inside the checkpointed function."
    )
