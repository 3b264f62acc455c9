"""A slice of the batch for auto's reference step, when no one-level plan fits the budget.

NOTE [A reference on a slice of the batch]
Below the lowest peak of one-level plans only nested plans fit, and the step verified plans
are compared with (the lowest-peak one-level plan, NOTE [The step verified plans are compared
with] in remat.planning._verify) would be over the budget: on a device the budget is the size
of, it runs out of memory and no plan is made. What that comparison catches, a nested segment
that computes another function (the parent's code between blocks, writes in place), is in
the model's code, not in its batch size: so the reference step and each nested plan's
comparison step run on the first ``b`` samples of the batch, and the plan's own step on the
whole batch gives its peak. Every tensor input with a first dimension of the batch's size is
sliced; inputs whose first dimensions differ (a sequence-first layout) cannot be, and auto
then runs the reference over the budget as before. ``b`` scales the reference's predicted
bytes above the step's fixed ones (parameters, buffers, inputs, gradients, optimizer state)
linearly in the batch, with a tenth to spare; a reference that still runs out halves ``b``.
A slice has at least ``MIN_SAMPLES`` (two): training-mode batch norm refuses one sample of a
``(N, C)`` input, and one sample has no batch statistics to compare. A step that fails on the
slice (a ``loss_fn`` with a target of the whole batch) is compared on the whole batch instead
(NOTE [A step that depends on the batch size] in remat.planning._candidates); one that runs on it
computes the reference and every plan compared with it on the same samples.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["MIN_SAMPLES", "batch_size", "reference_batch", "sliced"]

#: The share of the budget above the fixed bytes a sliced reference is sized for.
SPARE = 0.9
#: The fewest samples a slice has (NOTE [A reference on a slice of the batch]).
MIN_SAMPLES = 2


def batch_size(inputs: Any) -> int | None:
    """The first dimension every tensor input of one or more dimensions shares (None: none, or they differ)."""
    sizes = {t.shape[0] for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.dim() >= 1}
    return sizes.pop() if len(sizes) == 1 else None


def sliced(inputs: Any, b: int) -> Any:
    """``inputs`` with every tensor of one or more dimensions cut to its first ``b`` samples: a view, so that the
    slice costs no memory beside the batch, and a leaf of its own where the tensor required grad."""

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
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
