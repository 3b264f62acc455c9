"""What the calls of one checkpointed callable share: a device marker per device, and what its first call
learned (the buffers it wrote, its cheap submodules), kept per callable across calls."""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_MARKERS: dict[torch.device, torch.Tensor] = {}


def device_markers(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One empty tensor per device of ``inputs``, handed to torch's checkpoint in their place."""
    # torch infers the device (RNG, autocast) from tensor arguments (NOTE [Why a wrapper around torch's
    # non-reentrant checkpoint] in remat.core.checkpoint). A marker is never written or saved, so one per
    # device serves every call; fake and meta runs get their own.
    devices = {t.device: type(t) in (torch.Tensor, nn.Parameter) and t.device.type != "meta" for t in inputs}
    return [_marker(d) if plain else torch.empty(0, device=d) for d, plain in devices.items()]


def _marker(device: torch.device) -> torch.Tensor:
    marker = _MARKERS.get(device)
    if marker is None:
        marker = _MARKERS[device] = torch.empty(0, device=device)
    return marker


#: What each callable's first forward wrote, per training flag (see remat.core._region).
_LEARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Each callable's cheap submodules under "selective", per training flag (remat.core._by_module).
STRUCTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def memo_key(fn: Callable) -> tuple[Any, Any] | None:
    """(weakly held owner, key within it) naming ``fn`` across calls; None when it has no stable identity."""
    if isinstance(fn, functools.partial):
        return None  # rebuilt on every call (e.g. by Hugging Face layers)
    # isinstance, not getattr(fn, "__self__"): on a module that getattr raises inside Module.__getattr__, a cost
    # paid at every call of every checkpointed block
    if isinstance(fn, types.MethodType):  # a bound method: a new object on every access
        owner = fn.__self__
        return owner, (fn.__func__, getattr(owner, "training", None))
    return fn, (None, getattr(fn, "training", None))


def learned_memo(fn: Callable, memo: weakref.WeakKeyDictionary = _LEARNED) -> tuple[Any, Callable[[Any], None]]:
    """What ``fn``'s earlier calls left in ``memo`` (None: nothing yet), and how to leave it there."""
    key = memo_key(fn)
    try:
        table = memo.get(key[0]) if key is not None else None
    except TypeError:  # not weakly referenceable or not hashable
        key = table = None
    if key is None:
        return None, lambda learned: None

    def remember(learned: Any) -> None:
        memo.setdefault(key[0], {})[key[1]] = learned

    return (table or {}).get(key[1]), remember
