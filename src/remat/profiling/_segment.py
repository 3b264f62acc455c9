"""One stretch of a traced step (:class:`Segment`), and the tensors a block is called with or returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


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
    cast_cache: int = 0
    """Bytes of autocast weight casts made here and freed by the autocast cache in a later segment."""
    cast_release: int = 0
    """Bytes of such casts freed here (NOTE [Autocast's weight casts outlive their block] in remat.profiling._trace)."""
    max_released: int = 0
    """Most live after the first release here, plus the bytes released so far; 0 without one."""
    writes_input: bool = False
    """A block's forward: an op in it wrote in place to a storage the block was called with."""
    buffer_copies: int = 0
    """A block's forward: bytes of the copies of module buffers a checkpointed region made in it and still holds
    at its end (NOTE [Buffers a region keeps for its recomputation] in remat.planning._nested_copies)."""
    buffer_snapshots: int = 0
    """A block's forward: bytes of the buffers up to ``SNAPSHOT_BYTES`` of the modules under it that it does not
    write (NOTE [Buffers a segment copies and drops] in remat.planning._nested_copies)."""
    views_input: bool = False
    """A block's forward: the first tensor it returned shares storage with the first tensor it was called with
    (NOTE [A block whose output is a view of its input] in remat.planning._nested_views)."""
    without_grad: bool = False
    """A block's forward: it began with gradients off (NOTE [A block run without gradients is kept] in
    remat.planning._solve)."""

    @property
    def key(self) -> tuple[str, str | None, int]:
        return (self.phase, self.block, self.occurrence)

    @property
    def delta(self) -> int:
        return self.end_live - self.start_live

    @property
    def excess(self) -> int:
        return self.max_live - self.start_live

    @property
    def excess_released(self) -> int:
        return self.max_released - self.start_live if self.cast_release else 0


def tensors_in(value: Any) -> list[torch.Tensor]:
    if hasattr(value, "to_tuple"):  # transformers ModelOutput
        value = value.to_tuple()
    leaves, _ = tree_flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor)]
