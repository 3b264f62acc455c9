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

NOTE [A cache copy keeps only its call's layers]
A copy that kept every layer of the cache would hold, until the call's backward, the tensors
other layers' calls later replace: peft's prefix tuning hands each layer separate prefix keys
and values, which the step without checkpointing frees once that layer's ``update`` concatenates
them, and a checkpointed first layer kept the three later layers' prefixes (Llama, 4 layers:
24,576 B over the predicted peak). transformers indexes a cache by the ``layer_idx`` of the
attention module that calls it, so a copy keeps, of each ``layers`` list, the entries whose
index a module of the call carries (none carried: every entry). Any other entry keeps its
tensors by weak reference: transformers' attention reads only its own ``layer_idx``'s entry, and
a read of another finds the tensor the forward read while it is alive, or raises a
``RematError`` where it is gone (a later layer's prefix, replaced), never another tensor and a
wrong gradient. Nor does the call's region hold the user's cache (it holds the copy in its
place): held, the cache kept every tensor later calls added to it until the region's backward
(each later layer's keys and values, 40,960 B each on that Llama). A nested segment's head
checks the next blocks' arguments by weak reference, and the profile's record of how blocks
are called keeps no cache (``remat.profiling._crossing_ledger.call_form``): each held the
user's cache past the forward, the head into the next step. The profile counts what a
copy keeps among the call's inputs (``remat.profiling._crossing_ledger``), so a nested
segment, which keeps its blocks' entries until its backward, is predicted with them.

Only instances of ``transformers.cache_utils.Cache`` are copied, and only once transformers is
imported: nothing is walked for a call without one. ``remat.apply`` still turns ``use_cache``
off (``remat.core._hf``): a cache keeps every layer's keys and values for the whole step, which
a plan made to save memory should not keep.
"""

from __future__ import annotations

import copy
import functools
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from remat.errors import RematError

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
    if isinstance(obj, (*_ATOMS, _Elsewhere)) or depth > _DEPTH:
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


class _Elsewhere:
    """A layer of the cache another call owns: its structure as this call's forward found it, its tensors only
    by weak reference (NOTE [A cache copy keeps only its call's layers])."""

    def __init__(self, layer: Any) -> None:
        """``layer``: this copy's own copy of the layer (``_sharing_tensors``), which it then holds alone."""
        self.layer = layer
        self.refs = {name: weakref.ref(v) for name, v in vars(self.layer).items() if isinstance(v, torch.Tensor)}
        for name in self.refs:
            vars(self.layer)[name] = None

    def now(self) -> Any:
        """The layer the forward found, with those of its tensors no longer alive made unreadable."""
        layer = _sharing_tensors(self.layer, {})
        for name, ref in self.refs.items():
            vars(layer)[name] = ref()
        gone = tuple(name for name, ref in self.refs.items() if vars(layer)[name] is None)
        if gone:
            layer.__class__ = _unreadable(type(layer), gone)
        return layer


_UNREADABLE: dict[tuple[type, tuple[str, ...]], type] = {}


def _unreadable(kind: type, names: tuple[str, ...]) -> type:
    if (kind, names) not in _UNREADABLE:
        fields = {name: property(functools.partial(_refuse, kind.__name__, name)) for name in names}
        _UNREADABLE[kind, names] = type(f"Unreadable{kind.__name__}", (kind,), fields)
    return _UNREADABLE[kind, names]


def _refuse(kind: str, name: str, layer: Any) -> Any:
    raise RematError(
        f"remat.checkpoint: a recomputation read {name} of a {kind} of the key/value cache that no module of the "
        "call carries the layer_idx of, and the tensor its forward read there is gone: remat keeps only the layers "
        "the call's modules index (NOTE [A cache copy keeps only its call's layers] in remat.core._caches). "
        "Checkpoint a module that holds every attention it reads, or turn the cache off."
    )


def _layer_lists(cache: Any, kind: type) -> list[tuple[Any, list]]:
    """(cache, its ``layers`` list) for the cache and each cache it holds as an attribute (an encoder-decoder
    cache's two)."""
    inner = [cache, *(value for value in vars(cache).values() if isinstance(value, kind))]
    return [(c, layers) for c in inner if type(layers := getattr(c, "layers", None)) is list]


def _keep_own_layers(found: Any, memo: dict[int, Any], kind: type, indices: frozenset[int]) -> None:
    for real, layers in _layer_lists(found, kind):
        if id(real) in memo:
            own = memo[id(real)].layers
            for j in range(len(layers)):
                if j not in indices and own[j] is not layers[j]:
                    own[j] = _Elsewhere(own[j])


def _copy_of(cache: Any, kind: type, indices: frozenset[int] | None) -> Any:
    memo: dict[int, Any] = {}
    saved = _sharing_tensors(cache, memo)
    if indices is not None:
        _keep_own_layers(cache, memo, kind, indices)
    return saved


def _fresh_copy(saved: Any) -> Any:
    new = _sharing_tensors(saved, {})
    kind = _cache_class()
    for _, layers in _layer_lists(new, kind) if kind is not None else ():
        layers[:] = [item.now() if isinstance(item, _Elsewhere) else item for item in layers]
    return new


def _layer_indices(modules: Iterable[nn.Module] | None) -> frozenset[int] | None:
    """The ``layer_idx`` the call's modules carry; None where there is none (the copy keeps every layer)."""
    if modules is None:
        return None
    found = frozenset(index for m in modules if type(index := getattr(m, "layer_idx", None)) is int)
    return found or None


def _swap(tree: Any, targets: dict[int, Any], make: Callable[[Any], Any]) -> Any:
    """``tree`` with each object whose id is in ``targets`` replaced by ``make`` of its entry."""
    if id(tree) in targets:
        return make(targets[id(tree)])
    kind = type(tree)
    if kind in (tuple, list):
        items = [_swap(item, targets, make) for item in tree]
        return items if kind is list else tuple(items)
    if kind is dict:
        return {key: _swap(value, targets, make) for key, value in tree.items()}
    return tree


def _same(value: Any) -> Any:
    return value


def _tensors_kept(tree: Any, out: list[torch.Tensor], seen: set[int], depth: int = 0) -> None:
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (*_ATOMS, _Elsewhere)) or depth > _DEPTH or id(tree) in seen:
        return
    else:
        seen.add(id(tree))
        kind = type(tree)
        items = tree if kind in (list, tuple) else tree.values() if kind is dict else vars(tree).values()
        for item in items if kind in (list, tuple, dict) or hasattr(tree, "__dict__") else ():
            _tensors_kept(item, out, seen, depth + 1)


def _caches_in(value: Any) -> dict[int, Any]:
    """The caches ``value`` is or holds in tuples, lists and dicts, by id; none before transformers is imported."""
    found: dict[int, Any] = {}
    kind = _cache_class()
    if kind is not None:
        _find(value, kind, found)
    return found


def holds_cache(value: Any) -> bool:
    """Whether ``value`` is a cache or a tuple, list or dict holding one."""
    return bool(_caches_in(value))


class CacheCopies:
    """The caches among one call's arguments, as the call found them (NOTE [Caches in recomputation]).

    The call's region holds each copy in its cache's place (:meth:`stand_ins`), not the user's cache: held, that
    would keep every tensor later calls add to it until the region's backward, where the step without
    checkpointing lets go of a recomputation's cache with the recomputation."""

    def __init__(self, copies: dict[int, Any], originals: dict[int, Any]) -> None:
        self._copies = copies
        """id(user's cache) -> its copy."""
        self._originals = originals
        """id(copy) -> the user's cache, until the forward has run with it."""

    @classmethod
    def of(
        cls, args: tuple, kwargs: dict, modules: Callable[[], Iterable[nn.Module] | None] | None = None
    ) -> CacheCopies | None:
        """None where no argument (or item of a tuple, list or dict argument) is a cache; ``modules``: gives those
        the call runs (NOTE [A cache copy keeps only its call's layers]), None for every layer; called only where
        there is a cache (a generator breaks torch.compile's graph)."""
        found = _caches_in((args, kwargs))
        kind = _cache_class()
        if not found or kind is None:
            return None
        indices = _layer_indices(modules() if modules is not None else None)
        copies = {key: _copy_of(cache, kind, indices) for key, cache in found.items()}
        return cls(copies, {id(copies[key]): cache for key, cache in found.items()})

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the copies keep until the call's backward: a profile counts them as the call's inputs."""
        out: list[torch.Tensor] = []
        seen: set[int] = set()
        for saved in self._copies.values():
            _tensors_kept(saved, out, seen)
        return out

    def stand_ins(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with each cache replaced by its copy, for the region to hold."""
        return _swap(args, self._copies, _same), _swap(kwargs, self._copies, _same)

    def originals(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Stand-ins replaced by the user's caches, for the forward (once: the copy then forgets them)."""
        originals, self._originals = self._originals, {}
        return _swap(args, originals, _same), _swap(kwargs, originals, _same)

    def fresh(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Stand-ins replaced by new copies of the caches the call found, for a recomputation."""
        saved = {id(copy): copy for copy in self._copies.values()}
        return _swap(args, saved, _fresh_copy), _swap(kwargs, saved, _fresh_copy)
