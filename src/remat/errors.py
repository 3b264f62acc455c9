"""The one exception family remat raises.

NOTE [Caught like torch's]
Code written for ``torch.utils.checkpoint`` catches what torch raises: a
``CheckpointError`` (a ``RuntimeError``) when recomputation goes wrong, a
``RuntimeError`` when an input was modified in place before backward, a
``ValueError`` for an option value torch refuses. Where remat refuses the same
thing, its error is a :class:`RematError` that is also the exception torch would
raise there, so ``except RuntimeError`` / ``except CheckpointError`` /
``except ValueError`` keep working, and so does ``except remat.RematError``.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointError

__all__ = [
    "CheckpointOptionError",
    "HostDrawError",
    "OutOfMemory",
    "RandomBranchWarning",
    "RecomputeError",
    "RematError",
    "TransformError",
]


class RematError(Exception):
    """Raised for every error remat detects.

    Messages start with the API that was called, give the numbers involved and
    say how to fix the problem.
    """


class RecomputeError(RematError, CheckpointError):
    """A checkpointed call failed, or cannot be rerun exactly, in backward (NOTE [Caught like torch's]).

    Also torch's ``CheckpointError`` and so a ``RuntimeError``: torch raises those for a failed
    recomputation and for an input modified in place before backward.
    """


class CheckpointOptionError(RematError, ValueError):
    """An option of ``torch.utils.checkpoint.checkpoint`` that ``remat.checkpoint`` refuses (its value, or
    an option remat cannot honour); a ``ValueError``, as torch's refusals of option values are."""


class TransformError(RematError, RuntimeError):
    """A checkpointed call inside a ``torch.func`` transform that differentiates (``grad``, ``vjp``,
    ``jacrev``, ``hessian``), where torch's checkpoint cannot run either; a ``RuntimeError``, as torch's is."""


class HostDrawError(RematError, RuntimeError):
    """A checkpointed call drew from Python's or NumPy's generator where its first call did not, so its
    recomputation could not draw the same numbers (NOTE [Host generators in recomputation])."""


class OutOfMemory(RematError, torch.OutOfMemoryError):
    """A step remat ran did not fit the device; the model was restored.

    NOTE [Out of memory, told and still caught]
    A bare ``torch.OutOfMemoryError`` from ``remat.profile`` or ``remat.measure`` says neither
    that remat's own step ran out (not the user's), nor how much the step needs, nor what to do.
    remat raises this instead, with the numbers and the fix; it is also a
    ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` is the same class), so code that
    catches out-of-memory to try a smaller batch keeps working.
    """


class RandomBranchWarning(UserWarning):
    """A profiled forward branches on random draws, so a later step may take another path (``remat.profile``;
    NOTE [Branches on random draws] in remat.profiling._random_branches)."""
