"""A training step cut into segments: glue and blocks, forward and backward.

NOTE [How a step is segmented]
Forward: a block's segment runs from its forward pre-hook to its forward hook;
what runs between blocks (embeddings, the head, the loss) is glue. Backward:
autograd does not enter modules, so a block's backward segment starts when the
gradient of its output is computed (a tensor hook registered in its forward
hook) and lasts until the next block's starts; the glue before the first block
marker is the head's and the loss's backward. Every segment records the live
bytes at its start and end and the most live at any op inside it, so that the
peak of any mix of policies can be composed from uniform-policy runs
(``remat.profile``).

NOTE [Autocast's weight casts outlive their block]
Under autocast, the lower-precision copy of a weight is cached until the
outermost autocast region exits (usually the end of the model's forward). A block
that saves its matmul inputs keeps the copy for backward anyway; a checkpointed
block leaves it to the cache alone, and the cache frees it at the exit, in a
later segment, whose own policy does not decide how much is freed. So a copy
(``_to_copy`` of a float32 leaf that requires grad, to a lower precision) freed
during forward in another segment is booked twice: ``cast_cache`` on the segment
that made it, ``cast_release`` on the one that freed it; the peak model releases,
at such a segment, what the composed step's own segments booked
(``Profile.timeline``). Live bytes after a release are recorded as if it had not
happened (``max_released``), for the same reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from remat.core._memtrack import CudaAllocator, StorageTracker, storage_bytes, storages
from remat.core._recomputing import in_bookkeeping, recompute_observer
from remat.core._region import REGION_BUFFER_MODULES, SNAPSHOT_BYTES
from remat.core._slots import Slots
from remat.core._timing import WallClock
from remat.core._writes import written_tensors
from remat.core.checkpoint import SAVE_OPS
from remat.profiling._crossing_ledger import CrossingLedger
from remat.profiling._flops import op_flops
from remat.profiling._segment import Segment, tensors_in

_TO_COPY = torch.ops.aten._to_copy.default
_CLONE = torch.ops.aten.clone.default


def _weight_cast(src: Any, out: Any) -> bool:
    """An autocast-style cast of a weight: float32 leaf that requires grad, to a lower precision."""
    return (
        isinstance(src, torch.Tensor)
        and isinstance(out, torch.Tensor)
        and src.is_leaf
        and src.requires_grad
        and src.dtype == torch.float32
        and out.dtype in (torch.bfloat16, torch.float16)
    )


OpCost = Callable[[Any, tuple, dict, Any, int], float]
"""Modelled seconds of one op: (func, args, kwargs, out, flops)."""
OpWorkspace = Callable[[Any, tuple, dict, Any], int]
"""Bytes an op holds while it runs beyond what it returns: (func, args, kwargs, out)."""


class SegmentRecorder:
    """Hooks the blocks and records :class:`Segment` s; optionally tracks memory and FLOPs."""

    def __init__(
        self,
        model: nn.Module,
        blocks: Iterable[str],
        *,
        tracker: StorageTracker | None = None,
        op_cost: OpCost | None = None,
        workspace: OpWorkspace | None = None,
        allocator: CudaAllocator | None = None,
        clock: Any = None,
    ) -> None:
        """``allocator``: live and peak bytes from the CUDA allocator rather than the tracker
        (NOTE [Peaks as the allocator counts them]); ``clock``: how segments and recomputations
        are timed (NOTE [Clocks]; host time by default)."""
        self.modules = dict(model.named_modules())
        self.blocks = list(blocks)
        self.tracker = tracker
        self._block_bytes = tracker.block_bytes if tracker is not None else None
        self.op_cost = op_cost
        self.workspace = workspace
        self.allocator = allocator
        self.clock = clock if clock is not None else WallClock()
        self._marks: list[tuple[Segment, Any, Any, str]] = []
        self.segments: list[Segment] = []
        self.io_bytes: dict[str, tuple[int, int]] = {}
        self._counts: dict[tuple[str, str | None], int] = {}
        self._handles: list[Any] = []
        self._current: Segment | None = None
        own = {b: Slots(m) for b in self.blocks if (m := self.modules.get(b)) is not None}
        self.ledger = CrossingLedger(tracker, self._live, own)
        """Storages across blocks (NOTE [Storages across blocks] in remat.profiling._crossing), reads of outputs."""
        self.recomputes: dict[tuple[str, int], dict[str, Any]] = {}
        """Each block's recomputations: (block, k-th) -> segment it ran in, delta and excess of live bytes."""
        self._recomputing: list[Any] | None = None
        self.trajectories: dict[tuple, list[tuple[int, int, int]]] = {}
        """Per segment, after each op: (allocating ops outside recomputations so far, live, top) above its
        start (NOTE [Where a recomputation runs] in remat.profiling._crossing); with a tracker only."""
        self._trajectory: list[tuple[int, int, int]] | None = None
        self._allocs, self._made_seen = 0, 0
        self._rebuilt: dict[int, dict[str, Any]] = {}
        """Storages a recomputation made, still live after it, by key -> its record (freed later in the segment?)."""
        self._names = {id(m): n for n, m in self.modules.items() if n in set(self.blocks)}
        self._casts: dict[int, Segment] = {}
        self._call_inputs: set[int] = set()
        """Storages the running block was called with (``Segment.writes_input``)."""
        self._buffers: set[int] = set()
        self._copies: dict[int, Segment] = {}
        """Copies of buffers a region made in the running block's forward, by key (``Segment.buffer_copies``)."""
        self._snapshots: dict[int, int] = {}
        """The running block's small buffers not yet seen written, by key -> bytes (``Segment.buffer_snapshots``)."""
        if tracker is not None:
            tracker.on_op = self._on_op
            tracker.on_free = self._on_free

    # -- segment bookkeeping ---------------------------------------------------
    def _live(self) -> int:
        if self.allocator is not None:
            return self.allocator.live()
        return self.tracker.current if self.tracker is not None else 0

    def _close(self) -> None:
        seg = self._current
        if seg is not None:
            seg.end_live = self._live()
            self._top(seg, seg.end_live)
            if self.allocator is not None:  # everything the allocator held inside the segment
                seg.max_live = max(seg.max_live, self.allocator.peak())
            self._marks.append((seg, self._opened, self.clock.mark(), "seconds"))
            self.ledger.close_segment(seg.end_live - seg.start_live)
            if self._trajectory is not None:
                end = seg.end_live - seg.start_live
                self._trajectory.append((self._allocs, end, end))
        self._current = None
        self._trajectory = None
        self._rebuilt = {}
        self._copies = {}

    @staticmethod
    def _top(seg: Segment, live: int) -> None:
        if seg.cast_release:
            seg.max_released = max(seg.max_released, live + seg.cast_release)
        else:
            seg.max_live = max(seg.max_live, live)

    def _on_free(self, key: int, nbytes: int) -> None:
        self._cast_freed(key, nbytes)
        if self._copies.pop(key, None) is not None and self._current is not None:
            self._current.buffer_copies -= nbytes
        self.ledger.freed(key, self._current, self._recomputing[0] if self._recomputing is not None else None)
        record = self._rebuilt.pop(key, None)
        if record is not None:  # NOTE [Where a recomputation runs]: what it rebuilt and the segment frees again
            record["frees"].append((len(self._trajectory or ()), self._allocs, nbytes))

    def _cast_freed(self, key: int, nbytes: int) -> None:
        made = self._casts.pop(key, None)
        seg = self._current
        if made is not None and seg is not None and seg.phase == "fwd" and made is not seg:
            made.cast_cache += nbytes
            seg.cast_release += nbytes

    def begin(self, phase: str, block: str | None, occurrence: int | None = None) -> None:
        self._close()
        if occurrence is None:
            occurrence = self._counts.get((phase, block), 0)
            self._counts[(phase, block)] = occurrence + 1
        live = self._live()
        if self.allocator is not None:
            self.allocator.reset_peak()
        self._opened = self.clock.mark()
        self._current = Segment(phase, block, occurrence, live, live, live)
        self.segments.append(self._current)
        if self.tracker is not None and self.allocator is None:
            self._trajectory = self.trajectories[self._current.key] = []
            self._allocs = 0

    def finish(self) -> None:
        """Close the last segment and read every time mark (one synchronisation on CUDA)."""
        self._close()
        self.clock.settle()
        for seg, start, end, field in self._marks:
            seconds = self.clock.seconds(start, end)
            if field == "seconds":
                seg.seconds = seconds
            else:
                seg.recompute_s += seconds
        self._marks.clear()

    def _on_op(self, func: Any, args: tuple, kwargs: dict, out: Any, seconds: float) -> None:
        seg, tracker = self._current, self.tracker
        if seg is None:
            return
        if tracker is None:
            raise RuntimeError("op callbacks come only from a storage tracker")
        # NOTE [Workspace no tensor owns] in remat.profiling._workspace: live only inside the op
        extra = self.workspace(func, args, kwargs, out) if self.workspace is not None else 0
        if self.allocator is None:  # else the allocator's peak, read when the segment closes
            self._top(seg, tracker.current + extra)
        live = self._live()
        self.ledger.raise_after(live + extra - seg.start_live)
        if self._recomputing is not None:
            self._recomputing[2] = max(self._recomputing[2], live + extra)
        if self._trajectory is not None:
            if self._recomputing is None and tracker.made != self._made_seen:
                self._allocs += 1
            self._made_seen = tracker.made
            self._trajectory.append((self._allocs, live - seg.start_live, live + extra - seg.start_live))
        if func is _TO_COPY and _weight_cast(args[0], out):  # autocast's cache: its own account (_casts)
            for st in storages(out):
                self._casts[st._cdata] = seg
        elif seg.phase == "fwd" and seg.block is not None and in_bookkeeping():
            self._note_copy(seg, func, args, out)
        elif seg.phase == "fwd" and seg.block is not None and self.tracker is not None:
            self.ledger.note_made(seg, out, self._casts)
            if func._schema.is_mutable:
                self._note_writes(seg, func, args, kwargs)
        if seg.phase == "fwd":
            self.ledger.note_reads(seg.block, (args, kwargs))
        packet = func._overloadpacket
        flops = op_flops(packet, args, kwargs, out)
        seg.flops += flops
        if self.op_cost is not None:
            seconds = self.op_cost(func, args, kwargs, out, flops)
        seg.op_s += seconds
        if func in SAVE_OPS:
            seg.save_op_s += seconds

    def _note_writes(self, seg: Segment, func: Any, args: tuple, kwargs: dict) -> None:
        """A block's in-place op: a written buffer is no snapshot the region drops; a written input marks
        the segment ``writes_input``."""
        written = {st._cdata for t in written_tensors(func, args, kwargs) for st in storages(t)}
        for key in written & self._snapshots.keys():
            del self._snapshots[key]
        seg.writes_input = seg.writes_input or bool(written & self._call_inputs)

    def _note_copy(self, seg: Segment, func: Any, args: tuple, out: Any) -> None:
        """A region's copy of a module buffer (NOTE [What recomputation must not repeat] in remat.core._region):
        counted in ``seg.buffer_copies`` until it is freed, if that is before the segment ends."""
        if (
            func is not _CLONE
            or self.tracker is None
            or not any(st._cdata in self._buffers for st in storages(args[0]))
        ):
            return
        for st in storages(out):
            if st._cdata in self.tracker.live and st._cdata not in self._copies:
                self._copies[st._cdata] = seg
                seg.buffer_copies += self.tracker.live[st._cdata]

    # -- hooks -----------------------------------------------------------------
    def _pre_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.begin("fwd", name)
            seg = self._current
            if seg is None:
                raise RuntimeError("begin() opens a segment")
            self.ledger.note_inputs(name, seg.occurrence, args, kwargs, module)
            seg.without_grad = not torch.is_grad_enabled()
            if self.tracker is not None:
                self._call_inputs = {st._cdata for t in tensors_in((args, kwargs)) for st in storages(t)}
                self._snapshots = _small_buffers(module)
            if name not in self.io_bytes:
                self.io_bytes[name] = (storage_bytes(tensors_in((args, kwargs)), self._block_bytes), 0)

        return hook

    def _post_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            occurrence = self._current.occurrence if self._current is not None else 0
            outs = tensors_in(output)
            self.ledger.note_outputs(name, occurrence, output, outs)
            seg, ins = self._current, tensors_in((args, kwargs))
            if seg is not None and seg.key == ("fwd", name, occurrence):
                seg.buffer_snapshots, self._snapshots = sum(self._snapshots.values()), {}
                # NOTE [A block whose output is a view of its input] in remat.planning._nested_views
                seg.views_input = bool(outs and ins) and bool(
                    {st._cdata for st in storages(outs[0])} & {st._cdata for st in storages(ins[0])}
                )
            self.io_bytes[name] = (self.io_bytes.get(name, (0, 0))[0], storage_bytes(outs, self._block_bytes))
            self.begin("fwd", None)
            grad_out = next((t for t in outs if t.requires_grad), None)
            if grad_out is not None:
                self._hook_backward(name, occurrence, grad_out)

        return hook

    def _hook_backward(self, name: str, occurrence: int, out: torch.Tensor) -> None:
        """Begin the block's backward segment when the gradient of its output ``out`` is computed.

        NOTE [A view written in place after its block]
        A tensor hook stays on the autograd node the tensor had when it was registered. A block output
        that is a view (BatchNorm between transposes) and that the parent then changes in place gets a
        new node: autograd rebuilds the base's history around the write (``CopySlices``) and the view's
        old node leaves the graph, so its hook never fires and the block's backward would run inside
        the segment before it, where the peak model cannot find it (a checkpointed block's inputs are
        freed in its backward). The base's own old node stays in the graph under the write, so the
        hook goes on the base too, and the first of the two to fire begins the segment.
        """
        began = False

        def begin(_grad: torch.Tensor) -> None:
            nonlocal began
            if not began:
                began = True
                self.begin("bwd", name, occurrence)

        out.register_hook(begin)
        base = out._base
        if base is not None and base.requires_grad and base.grad_fn is not None:
            base.register_hook(begin)

    def _on_recompute_start(self, owner: nn.Module | None) -> None:
        live = self._live()
        span = len(self._trajectory) if self._trajectory is not None else None
        self._recomputing = [
            self._names.get(id(owner)),
            live,
            live,
            span,
            self._allocs,
            self.tracker.made if self.tracker is not None else 0,
        ]

    def _on_recompute(self, start: Any, end: Any) -> None:
        if self._current is not None:
            self._marks.append((self._current, start, end, "recompute_s"))
        event, self._recomputing = self._recomputing, None
        if event is None or event[0] is None or self.tracker is None or self._current is None:
            return
        block, begun, top, start, allocs, made = event
        span = None
        if start is not None:
            if self._trajectory is None:
                raise RuntimeError("a recomputation began on a trajectory that is gone")
            span = (start, len(self._trajectory))
        k = sum(1 for b, _ in self.recomputes if b == block)
        record = self.recomputes[(block, k)] = {
            "segment": self._current.key,
            "delta": self._live() - begun,
            "excess": max(top, self._live()) - begun,
            "before": begun - self._current.start_live,
            "allocs": allocs,
            "span": span,
            "frees": [],
        }
        for key in self.tracker.made_since(made):
            self._rebuilt[key] = record

    def __enter__(self) -> SegmentRecorder:
        self._buffers = {
            st._cdata for m in self.modules.values() for b in m._buffers.values() if b is not None for st in storages(b)
        }
        self._observing = recompute_observer(self._on_recompute, self.clock, self._on_recompute_start)
        self._observing.__enter__()
        for name in self.blocks:
            module = self.modules[name]
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._close()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._observing.__exit__(*exc)


def _small_buffers(module: nn.Module) -> dict[int, int]:
    """The buffers a region copies on entering their modules on a later call and drops unless written (those up to
    ``SNAPSHOT_BYTES``: NOTE [Watching only when needed] in remat.core._region), of the modules under ``module``
    and those its code reads (a traced segment's), by storage key -> bytes."""
    modules = [*module.modules(), *module.__dict__.get(REGION_BUFFER_MODULES, ())]
    out: dict[int, int] = {}
    for m in modules:
        for b in m._buffers.values():
            if b is not None and b.untyped_storage().nbytes() <= SNAPSHOT_BYTES:
                out.update((st._cdata, st.nbytes()) for st in storages(b))
    return out
