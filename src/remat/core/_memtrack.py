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

NOTE [Sharded parameters: subclasses and resized storages]
Under FSDP2 a parameter is a DTensor, a wrapper whose own storage is a stand-in
of the global size; its data is the local shard, so storages are taken from the
plain tensors inside wrapper subclasses. FSDP2 also frees and re-allocates the
all-gathered parameters with ``UntypedStorage.resize_``, which the dispatcher
never sees; while tracking, that method is wrapped so that the live bytes follow
it (as ``torch.distributed._tools.mem_tracker`` does).

NOTE [Resting storages nobody listed]
Some storages live across steps without being parameters, buffers or inputs:
DDP's gradient buckets, allocated when DDP is built and written by its reducer
in every backward. A storage whose first appearance is as the written argument of
an in-place or ``out=`` op, while it was neither created under tracking nor
known, existed before the step: it is counted in ``discovered`` (resting, for the
whole step), not in ``current``. A storage first seen otherwise (a view of a
buffer that a collective allocated without dispatch, say) is counted from then
on, as before.

NOTE [Cyclic garbage during a counted step]
A tensor that only a reference cycle holds (``torch.distributions``' transforms keep their
``loc`` and ``scale`` in one) is freed when the garbage collector next runs, and when that is
depends on how many Python objects the step has made. The profile's recorder makes objects the
plain step does not, so the same tensor died before the peak in one run and after it in the
other: Informer's step measured 16 B over the prediction in some runs and not in others.
While a step is counted, collections are paused (``collections_paused``): such a tensor lives
to the end of the step in every run, the most it can hold, so every count of the step agrees
and no run a collection spares is over the prediction.

NOTE [The first op under a dispatch mode]
The first op a process runs under a Python dispatch mode (the storage tracker, torch's selective
checkpoint) imports half of torch (``torch._dynamo``, sympy: 1.7 s on a CPU), and that import
leaves reference cycles holding the frames that called it: the step's own, with the forward's
output in them. With collections paused they lived through the whole first counted step of a
process (the output of a stack of MLPs, 8192 B over every later count of the same step). So
before the first pause, one op runs under a bare mode and the collector runs once: the import
is paid where it would have been, outside the count.
"""

from __future__ import annotations

import functools
import gc
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from remat.core._collectives import is_cpu_collective, run_settled
from remat.core._parameter_writes import note_writes
from remat.core._writes import written_tensors

T = TypeVar("T")


_WRAPPERS: dict[type, bool] = {}


class _Bare(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        return func(*args, **(kwargs or {}))


_DISPATCH_READY: list[bool] = []


def _dispatch_ready() -> None:
    """Once per process: torch's lazy imports for dispatch modes done and their garbage collected (NOTE [The
    first op under a dispatch mode])."""
    if _DISPATCH_READY:
        return
    _DISPATCH_READY.append(True)
    with _Bare():
        torch.zeros(1).add_(1)
    gc.collect()


@contextmanager
def collections_paused() -> Iterator[None]:
    """No garbage collection inside (NOTE [Cyclic garbage during a counted step]; NOTE [The first op under a
    dispatch mode]); as it was afterwards."""
    _dispatch_ready()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold ``t``'s data: ``t`` itself, or the inner tensors of a
    wrapper subclass (a DTensor's local shard); see NOTE [Sharded parameters]."""
    kind = type(t)
    wrapper = _WRAPPERS.get(kind)
    if wrapper is None:  # the protocol is the class's: asked once per class, not once per tensor of every op
        wrapper = _WRAPPERS[kind] = is_traceable_wrapper_subclass_type(kind)
    if not wrapper:
        return [t]
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]  # a wrapper subclass: its class says so
    inner = (getattr(t, n) for n in names)
    return [p for x in inner if isinstance(x, torch.Tensor) for p in plain_tensors(x)]


def op_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs, in pytree's order.

    NOTE [Op arguments without pytree]
    Dispatch modes run this on every op (a fake profile's cost is per op): aten ops take and
    return tensors, scalars and lists, tuples and dicts of them, so a plain walk of those
    finds every tensor pytree would, at a fraction of the cost of its general tree.
    """
    if isinstance(value, torch.Tensor):  # most ops' output
        return [value]
    found: list[torch.Tensor] = []
    if isinstance(value, (tuple, list, dict)):
        _collect(value, found)
    return found


def _collect(value: tuple | list | dict, found: list[torch.Tensor]) -> None:
    # the leaves here, not in a call each: most are ints (sizes, strides) or tensors
    for v in value.values() if isinstance(value, dict) else value:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (tuple, list, dict)):
            _collect(v, found)


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    return [p.untyped_storage() for p in plain_tensors(t)]


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements on this process (the local shard of a DTensor)."""
    return sum(p.numel() * p.element_size() for p in plain_tensors(t))


BlockBytes = Callable[[int], int]
"""What an allocator counts for a storage of so many bytes (a fake profile's CUDA target rounds them up)."""


def storage_bytes(tensors: Iterable[torch.Tensor], block_bytes: BlockBytes | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors``, each as ``block_bytes`` counts it (None: exactly)."""
    seen: dict[int, int] = {}
    for t in tensors:
        for st in storages(t):
            seen[st._cdata] = st.nbytes()
    if block_bytes is None:
        return sum(seen.values())
    return sum(block_bytes(n) for n in seen.values())


def grad_bytes(params: Iterable[torch.Tensor], block_bytes: BlockBytes | None = None) -> int:
    """Bytes of the gradients ``params`` get, one storage each, as ``block_bytes`` counts them (None: exactly)."""
    sizes = (tensor_bytes(p) for p in params)
    return sum(sizes) if block_bytes is None else sum(block_bytes(n) for n in sizes)


class StorageTracker(TorchDispatchMode):
    """Counts bytes of storages created while active, until they are freed.

    ``current``/``peak`` are bytes above the storages in ``known`` (which are
    never counted). ``on_op(func, args, kwargs, out, seconds)`` is called
    after every op with its wall time, for callers that build a timeline, and
    ``on_free(key, nbytes)`` when a counted storage is freed. ``block_bytes``: what the
    allocator counts for a storage of so many bytes (a fake profile's CUDA target, NOTE [Blocks
    the caching allocator hands out] in remat.profiling._allocator); None counts them exactly.
    """

    def __init__(
        self,
        known: Iterable[torch.Tensor] = (),
        on_op: Callable[[Any, tuple, dict, Any, float], None] | None = None,
        on_free: Callable[[int, int], None] | None = None,
        block_bytes: BlockBytes | None = None,
    ) -> None:
        super().__init__()
        self.block_bytes = block_bytes
        self.known = {st._cdata for t in known for st in storages(t)}
        self.live: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0
        self.discovered = 0
        """Bytes of unlisted storages that existed before tracking (NOTE [Resting storages nobody listed])."""
        self.on_op = on_op
        self.on_free = on_free
        self.made = 0
        """How many storages it has seen made (a clock of allocations, for the profiler)."""
        self._born: dict[int, int] = {}
        """Called with a storage's key and bytes right after it is freed (``current`` already lowered)."""

    def _counted(self, st: torch.UntypedStorage) -> int:
        return st.nbytes() if self.block_bytes is None else self.block_bytes(st.nbytes())

    def _freed(self, key: int, _ref: weakref.ref) -> None:
        nbytes = self.live.pop(key, 0)
        self._refs.pop(key, None)
        self._born.pop(key, None)
        self.current -= nbytes
        if self.on_free is not None and nbytes:
            self.on_free(key, nbytes)

    def made_since(self, made: int) -> list[int]:
        """Keys of the live storages made after the clock read ``made``: a storage's key is its address, which a
        storage made later may reuse, so a set of keys taken earlier cannot say which ones are new."""
        return [key for key, born in self._born.items() if born > made]

    def _add(self, t: torch.Tensor) -> None:
        for st in storages(t):
            self._add_storage(st)

    def _add_storage(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        if key in self.known:
            return
        nbytes = self._counted(st)
        old = self.live.get(key)
        if old is None:
            self.made += 1
            self._born[key] = self.made
            self.live[key] = nbytes
            self._refs[key] = weakref.ref(st, functools.partial(self._freed, key))
            self.current += nbytes
        elif old != nbytes:  # resized in place (resize_, out= ops)
            self.live[key] = nbytes
            self.current += nbytes - old

    def _discover(self, func: Any, args: tuple, kwargs: dict) -> None:
        if not getattr(getattr(func, "_schema", None), "is_mutable", False):
            return
        for t in written_tensors(func, args, kwargs):
            for st in storages(t):
                if st._cdata not in self.live and st._cdata not in self.known:
                    self.known.add(st._cdata)
                    self.discovered += self._counted(st)

    def _resized(self, st: torch.UntypedStorage) -> None:
        if st._cdata in self.live or st.nbytes() > 0:
            self._add_storage(st)
            self.peak = max(self.peak, self.current)

    def __enter__(self) -> StorageTracker:
        original = torch.UntypedStorage.resize_

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = original(st, size)
            self._resized(st)
            return out

        self._original_resize = original
        # see NOTE [Sharded parameters]; patched on purpose, which the stubs (a method, on _StorageBase) refuse
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        self._collections = collections_paused()
        self._collections.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]  # put back
            self._collections.__exit__(None, None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        note_writes(func, args, kwargs)  # NOTE [A step that writes parameters]
        start = time.perf_counter()
        if is_cpu_collective(func, args, kwargs):  # NOTE [A collective's buffers die on the step's thread]
            out = run_settled(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        seconds = time.perf_counter() - start
        self._discover(func, args, kwargs)
        for t in op_tensors(out):
            self._add(t)
        if self.current > self.peak:
            self.peak = self.current
        if self.on_op is not None:
            self.on_op(func, args, kwargs, out, seconds)
        return out


class CudaAllocator:
    """The CUDA caching allocator's own count of live bytes on one device, above a base.

    NOTE [Peaks as the allocator counts them]
    The storage tracker sees tensors; the allocator also hands out workspace that no
    tensor owns (a reduction's staging buffer, cuBLAS and attention-backward
    scratch), freed before the op returns, and rounds every block up. On CUDA a
    profile therefore reads ``memory_allocated`` at segment boundaries and
    ``max_memory_allocated`` over each segment (peak statistics reset at its start),
    synchronised, so that segment excesses hold what ``remat.measure`` will count.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        torch.cuda.synchronize(device)
        self.base = torch.cuda.memory_allocated(device)
        """Bytes allocated when counting began (the resting bytes, as the allocator sees them)."""

    def live(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device) - self.base

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        """Most live bytes since :meth:`reset_peak`, above the base."""
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base


def empty_device_cache() -> None:
    """Hand the CUDA caching allocator's unused blocks back to the device (a no-op before CUDA is used).

    After a step ran out of memory its tensors are freed into the allocator's cache, where
    they stay reserved: the next, smaller step would run out beside them.
    """
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def allocator_peak(fn: Callable[[], T]) -> tuple[int, T]:
    """Most bytes the CPU allocator had handed out at once while ``fn()`` ran, above the start, and what
    ``fn`` returned.

    For code the dispatcher never sees, such as kernels generated by
    ``torch.compile``: it sums the allocator's own allocation and free reports
    (the profiler's memory events) in order. On eager code it agrees with
    ``StorageTracker`` to within a few bytes per step (the allocator also sees
    small scratch buffers that no tensor owns).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, collections_paused():
        result = fn()
    cpu = torch._C._autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    current = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        current += event.nbytes()
        peak = max(peak, current)
    return peak, result
