"""Regions of the selective policy by module: one cheap submodule call run under saved-tensor hooks, and
the block-wide hooks that recompute its output for the ops after it (``remat.core._by_module`` uses them).

NOTE [A region as saved-tensor hooks]
A region runs its module's forward normally, with its graph, under saved-tensor hooks:
a tensor autograd saves that shares storage with an input, parameter or buffer, or with
the region's output, is kept (alive anyway, or saved by the next Linear too), any other
is dropped for an index; the first unpack reruns the forward
(grad on, inputs detached with their ``requires_grad``, autocast and buffers as in the
forward) and hands out the tensors it saved, in order. The graph is the
un-checkpointed one, so parameters get gradients whatever the inputs'
``requires_grad`` (the seed bug) and gradients are bit-equal: a custom autograd
Function recomputing the module was not, as it sums a norm's input gradient in
another order (Llama's RMSNorm input feeds three ops and the residual). Only the few
tensors the cheap module saves pass through Python; the Linear and attention ops do
not. Inside another checkpoint's saved-tensor hooks (a nested plan) a block stays
op-level: these hooks would hide the region's tensors from the outer checkpoint.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from remat.core._recomputing import bookkeeping, observed_recomputation
from remat.core._slots import Slots
from remat.core._writes import storage_key

Writes = tuple[tuple[weakref.ref, str], ...]
"""(module, buffer name) of the buffers a region wrote on its block's first call."""


@dataclass
class _Saved:
    """A tensor a region saved: kept (its output) or dropped after the forward, recomputed by index."""

    frame: _Frame
    tensor: torch.Tensor | None
    index: int

    def kept(self) -> torch.Tensor:
        """The tensor, before the region's decision (``_Frame.finish``) could drop it."""
        if self.tensor is None:
            raise RuntimeError("remat: a cheap region's saved tensor was dropped before its forward settled")
        return self.tensor


class _Frame:
    """One cheap region call (NOTE [A region as saved-tensor hooks])."""

    def __init__(
        self,
        forward: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        module: nn.Module,
        writes: Writes,
        owner: nn.Module | None,
    ) -> None:
        self.forward = forward
        self.owner = owner
        leaves, self.spec = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        self.leaves = leaves
        self.inputs = {storage_key(t): t.numel() * t.element_size() for t in tensors}
        self.resident = set(self.inputs) | {storage_key(t) for t in (*module.parameters(), *module.buffers())}
        self.saved_inputs: set[int] = set()
        """Storages of its inputs the module saved itself: keeping them to rerun it costs nothing more."""
        self.autocast = _autocast_state(tensors)
        self.buffers = _buffers_before(writes)
        self.slots = Slots(module)  # NOTE [A module's tensors as its forward saw them] in remat.core._slots
        self.count = 0
        self.pending: list[_Saved] = []
        self.recomputed: list[torch.Tensor | None] = []
        self.consumers = 0
        """Handles to its output that ops after it saved (NOTE [Outputs recomputed for their consumers])."""
        self.direct = 0
        self.copy_bytes = 0
        """Bytes of the autocast copies of its output that consumers saved as handles."""
        self.output: torch.Tensor | None = None
        self.views: list[_OutputView] = []
        self.drew = False
        """Its forward drew random numbers: it keeps what it saved (NOTE [A region that begins to draw])."""

    def pack(self, t: torch.Tensor) -> Any:
        key = storage_key(t)
        if key in self.resident:  # an input, a parameter, a view of one: alive anyway
            if key in self.inputs:
                self.saved_inputs.add(key)
            return t
        saved = _Saved(self, t, self.count)
        self.count += 1
        self.pending.append(saved)
        return saved

    def settle(self, out: torch.Tensor) -> None:
        """After the forward: what finish() weighs (its output is followed for its consumers meanwhile). Until
        then it holds its inputs only as strongly as its module does: weakly those the module did not save,
        which an unwrapped module would let go of now (a ReLU's)."""
        self.out_key, self.out_bytes, self.version = storage_key(out), out.numel() * out.element_size(), out._version
        # Its forward is over: what it saved, and which inputs, no longer change (finish() reads them too).
        self.held = sum(n for key, n in self.inputs.items() if key not in self.saved_inputs)
        self.saved_bytes = {storage_key(t): t.numel() * t.element_size() for t in (s.kept() for s in self.pending)}
        own = sum(n for key, n in self.saved_bytes.items() if key != self.out_key)
        # Holding them pays already when what it saved besides its output outweighs them (GELU under autocast
        # saves an fp32 copy of its bf16 input): hold them. Else only consumers of its output could make it pay.
        if self.held and own <= self.held + self.out_bytes:
            self.leaves = [weakref.ref(x) if isinstance(x, torch.Tensor) else x for x in self.leaves]
            self.weak = True

    def handle(self, view: _OutputView) -> _OutputView:
        self.consumers += 1
        self.views.append(view)
        return view

    def _inputs_alive(self) -> bool:
        """True with the inputs held strongly again; False when one is gone (it cannot be rerun)."""
        if not getattr(self, "weak", False):
            return True
        leaves = [x() if isinstance(x, weakref.ref) else x for x in self.leaves]
        if any(isinstance(x, weakref.ref) and y is None for x, y in zip(self.leaves, leaves)):
            return False
        self.leaves, self.weak = leaves, False
        return True

    def finish(self) -> None:
        """At the end of the block's forward, drop what it saved where that pays (NOTE [What a region
        drops]); else keep everything, as an unwrapped module would, and let go of its inputs."""
        freed = dict(self.saved_bytes)
        if self.direct:
            freed[self.out_key] = self.out_bytes
        transient = self.out_bytes if self.consumers == 0 else 0
        if not self.drew and sum(freed.values()) + self.copy_bytes > self.held + transient and self._inputs_alive():
            for saved in self.pending:
                saved.tensor = None
            for view in self.views:
                view.held = None
        else:
            self.leaves = []
        self.pending, self.views = [], []

    def output_as(self, view: _OutputView) -> torch.Tensor:
        """The output (recomputed when gone) as the consumer saved it; let go after the last consumer."""
        if view.held is not None:  # kept (NOTE [What a region drops]): what the consumer saved, as saved
            if view.held._version != view.held_version:
                raise RuntimeError(
                    "remat: one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: the output of a cheap region under selective checkpointing (version "
                    f"{view.held_version} -> {view.held._version}); clone it before modifying it in place."
                )
            return view.held
        if self.output is None:
            self.recompute()
        out = self.output
        if out is None:  # recompute() keeps its output while consumers are left, and this is one
            raise RuntimeError("remat: a cheap region's output was let go before its last consumer unpacked it")
        self.consumers -= 1
        if self.consumers <= 0:
            self.output = None
        if view.dtype is not None:  # a copy in another dtype (autocast's), made again: fresh, from offset 0
            return out.to(view.dtype).as_strided(view.size, view.stride, view.offset)
        return out.as_strided(view.size, view.stride, out.storage_offset() + view.offset)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.tensor is not None:
            return packed.tensor
        frame, index = packed.frame, packed.index
        if index >= len(frame.recomputed) or frame.recomputed[index] is None:
            frame.recompute()
        t, frame.recomputed[index] = frame.recomputed[index], None
        return t

    def recompute(self) -> None:
        recorded: list[torch.Tensor | None] = []

        def pack(t: torch.Tensor) -> None:
            key = storage_key(t)
            if key not in self.resident and key not in stand_ins:  # as in the forward (BatchNorm saves its stats)
                recorded.append(t.detach())

        leaves = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in self.leaves]
        args, kwargs = tree_unflatten(leaves, self.spec)
        with (
            torch.enable_grad(),
            observed_recomputation(self.owner),
            self.slots.as_called(),
            self._swapped_buffers() as stand_ins,
            self._autocast(),
            torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked),
        ):
            out = self.forward(*args, **kwargs)
        self.recomputed = recorded
        self.output = out.detach() if self.consumers > 0 else None

    @contextlib.contextmanager
    def _swapped_buffers(self) -> Iterator[set[int]]:
        """The buffers as the forward began (copies), in place while recomputing; yields their storages."""
        swapped = [(m, name, m._buffers[name]) for m, name, _ in self.buffers]
        stand_ins = set()
        for m, name, before in self.buffers:
            stand_in = before.clone()
            m._buffers[name] = stand_in
            stand_ins.add(storage_key(stand_in))
        try:
            yield stand_ins
        finally:
            for m, name, original in swapped:
                m._buffers[name] = original

    def _autocast(self) -> Any:
        if self.autocast is None:
            return contextlib.nullcontext()
        device, dtype = self.autocast
        return torch.autocast(device, dtype=dtype)


def _never_unpacked(_: Any) -> torch.Tensor:
    raise RuntimeError("remat: a tensor saved while recomputing a cheap region was unpacked")  # pragma: no cover


def _autocast_state(tensors: list[torch.Tensor]) -> tuple[str, torch.dtype] | None:
    device = tensors[0].device.type if tensors else "cpu"
    if not torch.is_autocast_enabled(device):
        return None
    return device, torch.get_autocast_dtype(device)


def _buffers_before(writes: Writes) -> list[tuple[nn.Module, str, torch.Tensor]]:
    out = []
    with torch.no_grad(), bookkeeping():
        for ref, name in writes:
            module = ref()
            if module is not None and module._buffers.get(name) is not None:
                out.append((module, name, module._buffers[name].detach().clone()))
    return out


# NOTE [Outputs recomputed for their consumers]
# A Linear after a norm saves the norm's output for its weight gradient; the MLP's
# product saves its activation's output. Op-level selective recomputes those; a region
# that kept its output would keep them all, and hold more than op-level selective on a
# transformer whose every block is selective. So while a block runs the fast path,
# saved-tensor hooks around the whole block (one Python call per saved tensor, not per
# op) swap every saved tensor on a region output's storage for a handle
# (``_OutputView``: the region and the view's geometry), and the region drops its own
# copies too. The first consumer to unpack in backward reruns the region once (its
# inputs stay for that: alive anyway where the region saves them, as a norm does) and
# the output is let go after the last consumer's unpack. Only while the output is
# unchanged: an op in place on it since (ResNet's ReLU(inplace=True) after a BatchNorm)
# changed what is saved, and rerunning the region would give the values before it
# (wrong gradients). Under autocast a Linear saves
# its own copy of the output in the autocast dtype: a saved tensor whose autograd
# history is views of such a copy (``ToCopyBackward0`` of a region output) is made
# again the same way, so it is not kept either. Region calls inside the block push
# their own hooks on top, so they never see these.
# NOTE [What a region drops]
# Rerunning a region pays only where what it frees outweighs what it holds. It frees
# what its module saved (BatchNorm's statistics, GELU's intermediates) and its output
# where consumers saved it (or autocast's copies of it); it holds its inputs where its
# module did not save them itself (a ReLU saves its output, not its input), and its
# rerun in backward makes its output again for a moment where no consumer needed it.
# Weighed at the end of the block's forward, when the consumers are known: unweighed,
# the seed CNN's ReLU regions keep their inputs for nothing (a peak above keep's) and
# ResNet's BatchNorm regions free only their statistics.
# Until then everything is held as the unwrapped module holds it: what its consumers
# saved stays in their handles, and inputs the module did not save are held weakly
# unless what it saved besides its output already outweighs them (GELU under autocast
# keeps an fp32 copy of its bf16 input); a region whose input died cannot be rerun and
# keeps everything (holding them to the block's end raises the seed CNN's peak).
# Where it does not pay, the region keeps everything, as the module
# would unwrapped, and its consumers' handles hand back what they saved.
@dataclass
class _OutputView:
    """A consumer's saved tensor on a region's output: the region and where in its output it looks."""

    frame: _Frame
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int | torch.SymInt
    dtype: torch.dtype | None
    """Set when the consumer saved a copy of the output in this dtype (autocast), not the output itself."""
    held: torch.Tensor | None
    """What the consumer saved, until the region's decision (kept where rerunning does not pay)."""
    held_version: int
    """The version of ``held`` when it was saved: an op in place on it since makes its values stale."""


#: autograd nodes of views that keep a contiguous tensor's element order
_RESHAPES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})
#: autograd nodes of views: a tensor they made shares its input's storage
_VIEWS = frozenset(
    {
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "ExpandBackward0",
        "SliceBackward0",
    }
)


class _Outputs:
    """The block-wide saved-tensor hooks of one fast-path call (NOTE [Outputs recomputed for their consumers])."""

    def __init__(self) -> None:
        self.settling: list[_Frame] = []
        """Regions whose saved tensors wait for the end of the block's forward (``_Frame.finish``)."""
        self.frames: dict[int, tuple[_Frame, int | torch.SymInt, weakref.ref, int]] = {}
        self.nodes: dict[int, tuple[_Frame, Any, bool, weakref.ref, int]] = {}

    def register(self, frame: _Frame, out: torch.Tensor) -> None:
        self.settling.append(frame)
        self.frames[storage_key(out)] = (frame, out.storage_offset(), weakref.ref(out), out._version)
        self.nodes[id(out.grad_fn)] = (frame, out.grad_fn, out.is_contiguous(), weakref.ref(out), out._version)

    def pack(self, t: torch.Tensor) -> Any:
        found = self.frames.get(storage_key(t))
        # A storage key is an address: once the output is gone the allocator may hand it to another tensor.
        # An op written in place on it since (ResNet's ReLU(inplace=True) after a BatchNorm) changed what
        # is saved: rerunning the region would give the values before it.
        if found is not None and found[2]() is not None and t._version == found[3]:
            frame, base, _, _ = found
            frame.direct += 1
            return frame.handle(
                _OutputView(frame, tuple(t.shape), tuple(t.stride()), t.storage_offset() - base, None, t, t._version)
            )
        copied = self._copied_from(t)
        if copied is None:
            return t
        copied.copy_bytes += t.untyped_storage().nbytes()
        return copied.handle(
            _OutputView(copied, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t, t._version)
        )

    def _copied_from(self, t: torch.Tensor) -> _Frame | None:
        """The region whose output ``t`` is a dtype copy of (through views), if any."""
        node, hops = t.grad_fn, 0
        while node is not None and hops < 4 and type(node).__name__ in _VIEWS:
            node, hops = node.next_functions[0][0], hops + 1
        if node is None or type(node).__name__ != "ToCopyBackward0":
            return None
        source, reshaped = node.next_functions[0][0], False
        # a copy of a reshape of a contiguous output (GPT-2's Conv1D casts x.view(-1, h)) has its elements
        # in the output's order: the copy of the whole output, read through the saved geometry, is the same
        while source is not None and type(source).__name__ in _RESHAPES:
            source, reshaped = source.next_functions[0][0], True
        found = self.nodes.get(id(source))
        if found is None or found[1] is not source or (reshaped and not found[2]):
            return None
        out = found[3]()
        return found[0] if out is not None and out._version == found[4] else None

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.frame.output_as(packed) if isinstance(packed, _OutputView) else packed
