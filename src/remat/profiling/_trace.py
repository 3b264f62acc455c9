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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from remat.core._memtrack import StorageTracker, storage_bytes
from remat.core._region import recompute_observer
from remat.core.checkpoint import SAVE_OPS


@dataclass
class Segment:
    """One stretch of a traced step."""

    phase: str
    """"fwd" or "bwd"."""
    block: str | None
    """The block's qualified name; None for glue."""
    occurrence: int
    """k-th time this block (or glue) appears in this phase."""
    start_live: int = 0
    end_live: int = 0
    max_live: int = 0
    seconds: float = 0.0
    flops: int = 0
    op_s: float = 0.0
    """Time spent inside ops (measured, or modelled on fake tensors)."""
    save_op_s: float = 0.0
    """Part of ``op_s`` in the ops the selective policy keeps (matmul, conv, attention)."""
    recompute_s: float = 0.0
    """Time spent recomputing checkpointed forwards (part of ``seconds``)."""

    @property
    def key(self) -> tuple[str, str | None, int]:
        return (self.phase, self.block, self.occurrence)

    @property
    def delta(self) -> int:
        return self.end_live - self.start_live

    @property
    def excess(self) -> int:
        return self.max_live - self.start_live


def tensors_in(value: Any) -> list[torch.Tensor]:
    if hasattr(value, "to_tuple"):  # transformers ModelOutput
        value = value.to_tuple()
    leaves, _ = tree_flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


OpCost = Callable[[Any, tuple, dict, Any, int], float]
"""Modelled seconds of one op: (func, args, kwargs, out, flops)."""


class SegmentRecorder:
    """Hooks the blocks and records :class:`Segment` s; optionally tracks memory and FLOPs."""

    def __init__(
        self,
        model: nn.Module,
        blocks: Iterable[str],
        *,
        tracker: StorageTracker | None = None,
        op_cost: OpCost | None = None,
    ) -> None:
        self.modules = dict(model.named_modules())
        self.blocks = list(blocks)
        self.tracker = tracker
        self.op_cost = op_cost
        self.segments: list[Segment] = []
        self.io_bytes: dict[str, tuple[int, int]] = {}
        self._counts: dict[tuple[str, str | None], int] = {}
        self._handles: list[Any] = []
        self._current: Segment | None = None
        if tracker is not None:
            tracker.on_op = self._on_op

    # -- segment bookkeeping ---------------------------------------------------
    def _live(self) -> int:
        return self.tracker.current if self.tracker is not None else 0

    def _close(self) -> None:
        seg = self._current
        if seg is not None:
            seg.end_live = self._live()
            seg.max_live = max(seg.max_live, seg.end_live)
            seg.seconds = time.perf_counter() - seg.seconds
        self._current = None

    def begin(self, phase: str, block: str | None, occurrence: int | None = None) -> None:
        self._close()
        if occurrence is None:
            occurrence = self._counts.get((phase, block), 0)
            self._counts[(phase, block)] = occurrence + 1
        live = self._live()
        self._current = Segment(phase, block, occurrence, live, live, live, time.perf_counter())
        self.segments.append(self._current)

    def finish(self) -> None:
        self._close()

    def _on_op(self, func: Any, args: tuple, kwargs: dict, out: Any, seconds: float) -> None:
        seg = self._current
        if seg is None:
            return
        seg.max_live = max(seg.max_live, self.tracker.current)
        packet = func._overloadpacket
        flops = int(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0
        seg.flops += flops
        if self.op_cost is not None:
            seconds = self.op_cost(func, args, kwargs, out, flops)
        seg.op_s += seconds
        if func in SAVE_OPS:
            seg.save_op_s += seconds

    # -- hooks -----------------------------------------------------------------
    def _pre_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.begin("fwd", name)
            if name not in self.io_bytes:
                self.io_bytes[name] = (storage_bytes(tensors_in((args, kwargs))), 0)

        return hook

    def _post_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            occurrence = self._current.occurrence if self._current is not None else 0
            outs = tensors_in(output)
            self.io_bytes[name] = (self.io_bytes.get(name, (0, 0))[0], storage_bytes(outs))
            self.begin("fwd", None)
            grad_out = next((t for t in outs if t.requires_grad), None)
            if grad_out is not None:
                grad_out.register_hook(lambda _grad: self.begin("bwd", name, occurrence))

        return hook

    def _on_recompute(self, seconds: float) -> None:
        if self._current is not None:
            self._current.recompute_s += seconds

    def __enter__(self) -> SegmentRecorder:
        self._observing = recompute_observer(self._on_recompute)
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

