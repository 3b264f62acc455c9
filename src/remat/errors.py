"""The one exception family remat raises."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointError

__all__ = ["OutOfMemory", "RecomputeError", "RematError"]


class RematError(Exception):
    """Raised for every error remat detects.

    Messages start with the API that was called, give the numbers involved and
    say how to fix the problem.
    """


class RecomputeError(RematError, CheckpointError):
    """A checkpointed function failed when rerun in backward.

    NOTE [Caught like torch's]
    torch raises ``torch.utils.checkpoint.CheckpointError`` (a ``RuntimeError``) when
    recomputation goes wrong, and code written for torch catches those. remat's
    recompute failures are both a :class:`RematError` and a ``CheckpointError``, so
    ``except RuntimeError``, ``except CheckpointError`` and ``except remat.RematError``
    all catch them.
    """


class OutOfMemory(RematError, torch.OutOfMemoryError):
    """A step remat ran did not fit the device; the model was restored.

    NOTE [Out of memory, told and still caught]
    A bare ``torch.OutOfMemoryError`` from ``remat.profile`` or ``remat.measure`` says neither
    that remat's own step ran out (not the user's), nor how much the step needs, nor what to do.
    remat raises this instead, with the numbers and the fix; it is also a
    ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` is the same class), so code that
    catches out-of-memory to try a smaller batch keeps working.
    """
