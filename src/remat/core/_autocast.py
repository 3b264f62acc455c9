"""A step's backward outside the autocast region the step was called in.

NOTE [Autocast around remat's calls]
torch's mixed-precision recipe runs the forward and the loss under ``torch.autocast`` and
the backward outside it. Leaving the region frees the low-precision copies of the weights
that autocast cached for the forward, and each recomputation in backward enters autocast
again, casts again, and frees its copies when it leaves. ``remat.auto`` called inside the
user's ``with torch.autocast(...)`` (on the first batch of a loop) would run its steps'
backward inside that region: the cache would keep the forward's copies through the whole
backward and every recomputation's too, a step other than the one the loop trains. On a
bf16 residual MLP its mixed plans measured 15% over their prediction, and it advertised a
floor that a real step then refused.

So where autocast is on when a step's backward begins, the backward (and the optimizer
step) runs as the recipe's does: the cache cleared, autocast off on every device, and its
nesting count at 0, as outside every region (a recomputation's own autocast then frees its
copies when it leaves); all put back afterwards, whatever happens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["outside_autocast"]

_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def _enabled_devices() -> list[str]:
    found = []
    for device in _DEVICES:
        try:
            if torch.is_autocast_enabled(device):
                found.append(device)
        except RuntimeError:  # a device type this build does not know
            continue
    return found


def _nesting() -> int:
    """Autocast's nesting count (torch has no getter: one up and back)."""
    depth = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return depth


@contextlib.contextmanager
def outside_autocast() -> Iterator[None]:
    """Inside, autocast is as outside every region (NOTE [Autocast around remat's calls]); a no-op where it is off."""
    devices = _enabled_devices()
    if not devices:
        yield
        return
    torch.clear_autocast_cache()
    depth = _nesting()
    try:
        for device in devices:
            torch.set_autocast_enabled(device, False)
        for _ in range(depth):
            torch.autocast_decrement_nesting()
        yield
    finally:
        for _ in range(depth):
            torch.autocast_increment_nesting()
        for device in devices:
            torch.set_autocast_enabled(device, True)
