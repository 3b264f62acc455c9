"""Key/value caches handed to a checkpointed call.

NOTE [Caches in recomputation]
A Hugging Face attention layer called with a cache (``past_key_values=``) writes to it:
self-attention appends this call's keys and values, cross-attention stores the encoder's
projections on its first call and reads them back on later ones. T5's and BART's decoders
make such a cache by themselves whenever ``use_cache`` is on, in training too. Recomputed in
backward, a layer would find the cache its forward left: self-attention over the keys twice,
cross-attention skipping its projections. torch's checkpoint then fails on the count of saved
tensors (a T5 decoder block: 51 in the forward, 47 in recomputation), and where the counts
happen to agree it would differentiate other values.

So a checkpointed call keeps, for each cache among its arguments, a copy of the cache's
structure as the call found it: its layer objects, lists and dicts, sharing every tensor (a
dynamic cache replaces its tensors when it grows, and never writes them). Each recomputation
runs on a fresh copy of that: the forward fills the user's cache once, as without
checkpointing, and the recomputation sees the cache the forward saw and fills a copy that is
dropped. Bit-equal to the step without checkpointing, cache on (``tests/core/test_caches.py``).
A cache class that writes its tensors in place (``StaticCache``, made for generation) is
copied the same way, so a recomputation rewrites the values the forward wrote there.

Only instances of ``transformers.cache_utils.Cache`` are copied, and only once transformers is
imported: nothing is walked for a call without one. ``remat.apply`` still turns ``use_cache``
off (``remat.core._hf``): a cache keeps every layer's keys and values for the whole step, which
a plan made to save memory should not keep.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
from torch import nn

_ATOMS = (type(None), bool, int, float, complex, str, bytes, type, torch.Tensor, torch.device, torch.dtype, nn.Module)
_DEPTH = 8
"""How deep a cache's structure is copied: a cache holds layers holding tensors (3 levels with containers)."""


def _cache_class() -> type | None:
    module = sys.modules.get("transformers.cache_utils")
    return getattr(module, "Cache", None) if module is not None else None


def _find(tree: Any, kind: type, out: dict[int, Any]) -> None:
    if isinstance(tree, kind):
        out[id(tree)] = tree
    elif type(tree) in (tuple, list):
        for item in tree:
            _find(item, kind, out)
    elif type(tree) is dict:
        for item in tree.values():
            _find(item, kind, out)


def _sharing_tensors(obj: Any, memo: dict[int, Any], depth: int = 0) -> Any:
    """A copy of ``obj``'s containers and plain objects; tensors, modules, classes and scalars shared."""
    if isinstance(obj, _ATOMS) or depth > _DEPTH:
        return obj
    if id(obj) in memo:
        return memo[id(obj)]
    kind = type(obj)
    if kind in (list, tuple):
        new: Any = [_sharing_tensors(item, memo, depth + 1) for item in obj]
        new = new if kind is list else tuple(new)
    elif kind is dict:
        new = {key: _sharing_tensors(value, memo, depth + 1) for key, value in obj.items()}
    elif hasattr(obj, "__dict__") and not callable(obj):
        new = copy.copy(obj)
        memo[id(obj)] = new
        for name, value in vars(obj).items():
            vars(new)[name] = _sharing_tensors(value, memo, depth + 1)
        return new
    else:
        return obj
    memo[id(obj)] = new
    return new


def _replace(tree: Any, copies: dict[int, Any]) -> Any:
    if id(tree) in copies:
        return _sharing_tensors(copies[id(tree)], {})
    kind = type(tree)
    if kind in (tuple, list):
        items = [_replace(item, copies) for item in tree]
        return items if kind is list else tuple(items)
    if kind is dict:
        return {key: _replace(value, copies) for key, value in tree.items()}
    return tree


class CacheCopies:
    """The caches among one call's arguments, as the call found them (NOTE [Caches in recomputation])."""

    def __init__(self, copies: dict[int, Any]) -> None:
        self._copies = copies

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> CacheCopies | None:
        """None where no argument (or item of a tuple, list or dict argument) is a cache."""
        kind = _cache_class()
        if kind is None:
            return None
        found: dict[int, Any] = {}
        _find((args, kwargs), kind, found)
        if not found:
            return None
        return cls({key: _sharing_tensors(cache, {}) for key, cache in found.items()})

    def fresh(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with each cache replaced by a new copy of the one the call found."""
        return _replace(args, self._copies), _replace(kwargs, self._copies)
