"""The one exception family remat raises."""

from __future__ import annotations

__all__ = ["RematError"]


class RematError(Exception):
    """Raised for every error remat detects.

    Messages start with the API that was called, give the numbers involved and
    say how to fix the problem.
    """
