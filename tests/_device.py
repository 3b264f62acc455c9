"""A simulated device for tests: a memory capacity on the CPU, for code that must fit a GPU without one.

NOTE [The simulated device counts every storage]
``SimulatedDevice(capacity, resting=...)`` is a dispatch mode that counts the bytes of every
real tensor storage alive while it is entered, as ``remat.core._memtrack.StorageTracker``
does (a storage is counted once, from the op that made it, or first showed it, until its
Python object is finalised), but unlike the tracker it counts the storages alive before it
was entered too: those in ``resting`` (parameters, inputs) from the start, any other the
first time an op sees it. An op whose new storages would take the live bytes past
``capacity`` raises ``torch.OutOfMemoryError``, as CUDA's allocator does, with its output
dropped. ``peak`` is the most bytes it admitted at once. Fake and meta tensors hold no memory
and are not counted; remat's own dispatch modes, entered inside it, send their ops through it.
FSDP2 frees and re-allocates its all-gathered parameters with ``UntypedStorage.resize_``,
which no dispatch mode sees: while entered, that method is wrapped to count (and refuse) the
growth, as remat's tracker does (NOTE [Sharded parameters: subclasses and resized storages]).
remat's snapshots of the model (``remat.core._state._copy``) share the memory of the step on
the CPU and go to host memory on CUDA: ``snapshots_on_host=True`` makes the device a GPU's
there, the storages that function makes kept out of the count (counted, 280 B of BatchNorm
buffers refused a plan predicted at the budget, which CUDA would have run).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from remat.core import _state
from remat.core._memtrack import storages


class SimulatedDevice(TorchDispatchMode):
    """A device of ``capacity`` bytes (NOTE [The simulated device counts every storage])."""

    def __init__(self, capacity: int, resting: Iterable[torch.Tensor] = (), *, snapshots_on_host: bool = False) -> None:
        super().__init__()
        self.capacity = capacity
        self.snapshots_on_host = snapshots_on_host
        self.live: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0
        self.refused = 0
        """How many ops it refused (each raised an OutOfMemoryError)."""
        self._hosting = 0
        self._host: dict[int, weakref.ref] = {}  # remat's snapshots: host memory on CUDA
        for t in resting:
            self._admit(self._new(t))

    def _freed(self, key: int, _ref: weakref.ref) -> None:
        self.current -= self.live.pop(key, 0)
        self._refs.pop(key, None)

    def _new(self, t: Any) -> list[torch.UntypedStorage]:
        if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor) or t.device.type == "meta":
            return []
        return [st for st in storages(t) if st._cdata not in self.live and st._cdata not in self._host]

    def _host_copy(self, copy: Any) -> Any:
        """``remat.core._state._copy``, its storages kept out of the count (host memory on CUDA)."""

        def hosted(t: Any) -> Any:
            self._hosting += 1
            try:
                out = copy(t)
            finally:
                self._hosting -= 1
            for st in [] if out is None else storages(out):
                self._host[st._cdata] = weakref.ref(st, lambda r, k=st._cdata: self._host.pop(k, None))
            return out

        return hosted

    def _admit(self, new: list[torch.UntypedStorage]) -> None:
        for st in new:
            if st._cdata in self.live:
                continue
            self.live[st._cdata] = st.nbytes()
            self._refs[st._cdata] = weakref.ref(st, lambda r, k=st._cdata: self._freed(k, r))
            self.current += st.nbytes()
        self.peak = max(self.peak, self.current)

    def __enter__(self) -> SimulatedDevice:
        original = self._original_resize = torch.UntypedStorage.resize_

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            if st.device.type == "meta":  # a fake tensor's
                return original(st, size)
            grow = size - self.live.get(st._cdata, 0)
            if grow > 0 and self.current + grow > self.capacity:
                self.refused += 1
                raise torch.OutOfMemoryError(f"SimulatedDevice: resizing a storage to {size} bytes would pass {self}")
            out = original(st, size)
            if st._cdata in self.live:
                self.live[st._cdata] = size
                self.current += grow
            else:
                self._admit([st])
            self.peak = max(self.peak, self.current)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._original_copy = _state._copy
        if self.snapshots_on_host:
            _state._copy = self._host_copy(self._original_copy)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
            _state._copy = self._original_copy

    def __repr__(self) -> str:
        return f"SimulatedDevice(capacity {self.capacity}, live {self.current})"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self._hosting:  # a snapshot to host memory (remat.core._state._copy)
            return func(*args, **kwargs)
        seen = [st for t in tree_flatten((args, kwargs))[0] for st in self._new(t)]
        self._admit(seen)  # alive before this op: counted whatever the op does
        out = func(*args, **kwargs)
        new = {st._cdata: st for t in tree_flatten(out)[0] for st in self._new(t)}
        grow = sum(st.nbytes() for st in new.values())
        if self.current + grow > self.capacity:
            self.refused += 1
            del out, new
            raise torch.OutOfMemoryError(
                f"SimulatedDevice: {func} would take live bytes to {self.current + grow} (capacity {self.capacity})"
            )
        self._admit(list(new.values()))
        return out


def resting(model: torch.nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """What sits on the device before a call: parameters, buffers, gradients, inputs."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [*model.parameters(), *model.buffers(), *grads, *inputs]
