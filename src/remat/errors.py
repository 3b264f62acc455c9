"""The one exception family remat raises."""

from __future__ import annotations

from torch.utils.checkpoint import CheckpointError

__all__ = ["RecomputeError", "RematError"]


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
