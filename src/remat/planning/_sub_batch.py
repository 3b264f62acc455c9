"""A slice of the batch for auto's reference step, when the step without checkpointing is over the budget.

NOTE [A reference on a slice of the batch]
Below the peak without checkpointing, the step verified plans are compared with (that step,
NOTE [The step verified plans are compared with] in remat.planning._verify) would be over the
budget: on a device the budget is the size of, it runs out of memory and no plan is made. What
that comparison catches, a block or a nested segment that computes another function (a buffer
rebound in the forward, the parent's code between blocks, writes in place), is in the model's
code, not in its batch size: so the reference step and each plan's
comparison step run on the first ``b`` samples of the batch, and the plan's own step on the
whole batch gives its peak. The batch size is the first dimension most tensor inputs share (a
tie: the one of the most elements), and every tensor input with that first dimension is sliced;
the others are handed whole: a table every sample reads (Flux's ``img_ids`` of one row per
token, a ``(1, seq)`` ``position_ids`` that broadcasts) is no sample's, and requiring every
input to share the first dimension left such models with no slice, their reference over the
budget. An input of another first dimension that is per sample (a sequence-first layout beside
a batch-first one) makes the step on the slice fail on a shape, and that step is compared on
the whole batch as below. ``b`` scales the reference's predicted bytes above the step's fixed
ones (parameters, buffers, inputs, gradients, optimizer state) linearly in the batch, with a
tenth to spare; a reference that still runs out halves ``b``. A slice may be one sample: the batches
of two or three long sequences that fine-tuning uses, and a batch whose parameters and gradients
leave room for one sample's activations only, had no slice of two, and their plans were compared
with the lowest-peak plan, which sees less. A step that fails on the slice (training-mode batch norm
refuses one sample of a ``(N, C)`` input; a ``loss_fn`` with a target of the whole batch) is compared
on the whole batch instead (NOTE [A step that depends on the batch size] in
remat.planning._candidates); one that runs on it computes the reference and every plan compared
with it on the same samples.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["MIN_SAMPLES", "batch_size", "reference_batch", "sliced"]

#: The share of the budget above the fixed bytes a sliced reference is sized for.
SPARE = 0.9
#: The fewest samples a slice has (NOTE [A reference on a slice of the batch]).
MIN_SAMPLES = 1


def batch_size(inputs: Any) -> int | None:
    """The first dimension most tensor inputs of one or more dimensions share, of those as many share the one
    holding the most elements (None: no such input, or a tie on both)."""
    shares: dict[int, list[int]] = {}
    for t in tree_flatten(inputs)[0]:
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            share = shares.setdefault(t.shape[0], [0, 0])
            share[0], share[1] = share[0] + 1, share[1] + t.numel()
    top = sorted(shares.items(), key=lambda item: item[1], reverse=True)[:2]
    return top[0][0] if top and (len(top) == 1 or top[0][1] != top[1][1]) else None


def sliced(inputs: Any, b: int, batch: int) -> Any:
    """``inputs`` with every tensor whose first dimension is ``batch`` cut to its first ``b`` samples: a view, so
    that the slice costs no memory beside the batch, and a leaf of its own where the tensor required grad."""

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != batch:
            return t
        return t.detach()[:b].requires_grad_(t.requires_grad)

    return tree_map(cut, inputs)


def reference_batch(batch: int, predicted: int, fixed: int, limit: int) -> int | None:
    """The samples of ``batch`` whose reference step, predicted at ``predicted`` bytes on the whole batch of which
    ``fixed`` do not scale with it, fits ``limit`` (None: not even ``MIN_SAMPLES`` are predicted to)."""
    if predicted <= limit:
        return batch
    scaling = predicted - fixed
    room = SPARE * (limit - fixed)
    if scaling <= 0 or room <= 0:
        return None
    b = min(batch // 2, int(batch * room / scaling))
    return b if b >= MIN_SAMPLES else None
