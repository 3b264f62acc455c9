"""Live tensor-storage accounting on any device, from inside the dispatcher.

NOTE [Why a storage tracker and not RSS or the profiler]
Process RSS rises with checkpointing on CPU (allocator caching) and the
profiler's "CPU Mem" columns sum allocations rather than give a peak
(measurements.md, point 7). Every tensor an op creates owns or shares an
``UntypedStorage``; counting each storage once, from the op that created it until
its Python object is finalised, gives the bytes of tensor data alive after every
op. This is the same accounting as ``torch.distributed._tools.mem_tracker``.
Storages alive before tracking started (parameters, buffers, inputs) are
"resting" and are counted once, separately, by the caller.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


class StorageTracker(TorchDispatchMode):
    """Counts bytes of storages created while active, until they are freed.

    ``current``/``peak`` are bytes above the storages in ``known`` (which are
    never counted). ``on_op(func, args, kwargs, out, seconds)`` is called
    after every op with its wall time, for callers that build a timeline.
    """

    def __init__(
        self,
        known: Iterable[torch.Tensor] = (),
        on_op: Callable[[Any, tuple, dict, Any, float], None] | None = None,
    ) -> None:
        super().__init__()
        self.known = {t.untyped_storage()._cdata for t in known}
        self.live: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0
        self.on_op = on_op

    def _freed(self, key: int, _ref: weakref.ref) -> None:
        nbytes = self.live.pop(key, 0)
        self._refs.pop(key, None)
        self.current -= nbytes

    def _add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.known:
            return
        nbytes = st.nbytes()
        old = self.live.get(key)
        if old is None:
            self.live[key] = nbytes
            self._refs[key] = weakref.ref(st, lambda r, k=key: self._freed(k, r))
            self.current += nbytes
        elif old != nbytes:  # resized in place (resize_, out= ops)
            self.live[key] = nbytes
            self.current += nbytes - old

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - start
        leaves, _ = tree_flatten(out)
        for t in leaves:
            if isinstance(t, torch.Tensor):
                self._add(t)
        if self.current > self.peak:
            self.peak = self.current
        if self.on_op is not None:
            self.on_op(func, args, kwargs, out, seconds)
        return out
