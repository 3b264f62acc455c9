"""The peak model of a compiled step: a chain of blocks fitted to a few compiled measurements.

NOTE [Predicting compiled peaks]
A compiled step keeps other bytes than the eager one (fused element-wise ops store no
intermediates; the partitioner chooses what a block without checkpointing saves, across
block boundaries), so the eager profile's bytes, even scaled, mispredict mixed plans:
measured on 3-block GPT-2 and Llama under ``aot_eager``, scaling each policy's bytes to fit
the uniform plans left errors up to 14% and 13% on the 24 mixed assignments. What holds better is the
shape of a chain. With blocks ``0..n-1`` under policies ``p_i``, the compiled peak is

    resting + max( sum_i s[p_i] + h,                                  (end of forward)
                   max_k sum_{i<k} s[p_i] + s[p_k] + e[p_k] + (n-1-k) g ) (block k's backward)

``s[p]``: what a block under ``p`` holds from its forward to its backward; ``e[p]``: the
most above that during its own backward (recomputation, gradients of its activations);
``g``: what a finished block's backward leaves (its parameters' gradients, and what the
compiled backward keeps with them); ``h``: the head and loss above the saved bytes. Eight
numbers for three policies, fitted (``fit``) to the compiled peaks of ``design`` (15 compiled
steps: for every pair of policies, the last block or the second half of the blocks under
another policy than the rest). The fit minimises the largest relative error, then
``margin`` (the most any of its own measurements lies above the fit) is added to every
prediction, so the model never predicts below what it was fitted to. Measured on all 27
assignments of 3-block zoo models (hidden 32, 4 x 128 tokens, ``aot_eager``, CPU): GPT-2
within -0.4% to +4.8%, Llama -8.7% to +9.7%. Fitted to all 27, Llama's error stays up to
9.0% (on the safe side, after the margin): its peaks depend on block positions in a way
this chain, or this fit of it, does not follow. ``remat.auto`` therefore still verifies the plan.

The fitted chain is written as a ``Profile`` (``chain_profile``): the same forward and
backward segments as the eager profile, each block's costs replaced by the fitted ones,
glue outside blocks empty but for ``h``, no crossings. ``remat.plan`` and its DP then plan
for the compiled step unchanged. A model whose blocks are not a chain (a block called
twice, glue between blocks' backward segments) is not modelled: ``chain_profile`` returns
None and ``remat.auto`` falls back to verifying plans by measurement.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from remat.profiling._types import Key, Profile, SegmentCost

__all__ = ["ChainFit", "chain_profile", "design", "fit", "is_chain"]

#: Multi-start coordinate descent: starts (random, seeded), the finest step as a fraction of the largest peak.
_STARTS = 16
_FINEST = 1e-4


@dataclass(frozen=True)
class ChainFit:
    """The fitted compiled chain (NOTE [Predicting compiled peaks]); bytes above the resting bytes."""

    saved: dict[str, int]
    """Per policy: what a block holds from its forward to its backward."""
    during: dict[str, int]
    """Per policy: the most above that during the block's own backward."""
    left: int
    """What a block's finished backward leaves alive."""
    head: int
    """Head and loss above the saved bytes at the end of forward."""
    margin: int
    """The most a fitted measurement lies above the model: added to every prediction."""
    worst_error: float
    """Largest relative error of the model (margin included) on the measurements it was fitted to."""

    def predict(self, policies: Sequence[str], resting: int) -> int:
        """Predicted compiled peak of blocks under ``policies`` (in execution order)."""
        # The fitted terms are whole bytes, so the sum is whole: round only makes it an int.
        return resting + self.margin + round(_peak_above(self.saved, self.during, self.left, self.head, policies))


def _peak_above(saved: dict, during: dict, left: float, head: float, policies: Sequence[str]) -> float:
    n, below, top = len(policies), 0.0, 0.0
    for k, p in enumerate(policies):
        top = max(top, below + saved[p] + during[p] + (n - 1 - k) * left)
        below += saved[p]
    return max(top, below + head)


def design(policies: Sequence[str], n: int) -> list[tuple[str, ...]]:
    """The assignments (policy per block) whose compiled peaks ``fit`` needs, uniform ones first.

    For every pair of policies (q, p): all blocks under q but the last, under p; and the first
    half under q, the rest under p. 15 assignments for three policies (9 for two blocks).
    Fitted to the "last" ones alone, a 5-block chain was mispredicted by up to 23%: the
    halves pin how the saved bytes of several blocks add up.
    """
    last = [(q,) * (n - 1) + (p,) for q in policies for p in policies]
    halves = [(q,) * (n // 2) + (p,) * (n - n // 2) for q in policies for p in policies]
    uniform = [(p,) * n for p in policies]
    return list(dict.fromkeys([*uniform, *last, *halves]))


def _unpack(x: list[float], policies: Sequence[str]) -> tuple[dict, dict, float, float]:
    # Held bytes are never negative; ``during`` and ``head`` may be: the backward of a block can
    # free part of what it held before its own peak, and the head's peak can come after that.
    # ``x[-1]`` shifts every backward peak at once: redundant, but a direction the descent can take.
    m, base = len(policies), x[-1]
    saved = dict(zip(policies, (max(v, 0.0) for v in x[:m]), strict=True))
    during = dict(zip(policies, (v + base for v in x[m : 2 * m]), strict=True))
    return saved, during, max(x[2 * m], 0.0), x[2 * m + 1] + base


def fit(measured: dict[tuple[str, ...], int], resting: int) -> ChainFit:
    """The chain whose predictions come closest (largest relative error) to ``measured`` compiled peaks."""
    policies = sorted({p for a in measured for p in a})
    above = {a: peak - resting for a, peak in measured.items()}

    def errors(x: list[float]) -> list[float]:
        saved, during, left, head = _unpack(x, policies)
        return [abs(_peak_above(saved, during, left, head, a) - v) / measured[a] for a, v in above.items()]

    def worst(x: list[float]) -> float:
        return max(errors(x))

    def smooth(x: list[float]) -> float:  # first descend on a norm that is not a corner everywhere
        return sum(e**8 for e in errors(x))

    scale = max(above.values())
    rng = random.Random(0)
    starts = [[rng.uniform(0, scale / 2) for _ in range(2 * len(policies) + 3)] for _ in range(_STARTS)]
    best = min((_descend(worst, _descend(smooth, x, scale), scale) for x in starts), key=worst)
    saved, during, left, head = _unpack(best, policies)
    margin = max(0, max(v - round(_peak_above(saved, during, left, head, a)) for a, v in above.items()))
    fitted = ChainFit(
        {p: round(v) for p, v in saved.items()},
        {p: round(v) for p, v in during.items()},
        round(left),
        round(head),
        margin,
        0.0,
    )
    error = max(abs(fitted.predict(a, resting) - v) / v for a, v in measured.items())
    return replace(fitted, worst_error=error)


def _descend(loss: Callable[[list[float]], float], x: list[float], scale: float) -> list[float]:
    """Coordinate descent with halving steps, from ``scale / 4`` down to ``scale * _FINEST``."""
    best, step = loss(x), scale / 4
    while step > scale * _FINEST:
        improved = False
        for i in range(len(x)):
            for move in (step, -step):
                y = [*x[:i], x[i] + move, *x[i + 1 :]]
                value = loss(y)
                if value < best:
                    x, best, improved = y, value, True
        if not improved:
            step /= 2
    return x


def is_chain(prof: Profile) -> bool:
    """True when every block runs once, forward in order and backward in reverse, glue only before the blocks'
    backward segments."""
    names = [b.name for b in prof.blocks]
    forward = [k[1] for k in prof.fwd_order if k[1] is not None]
    backward = [k[1] for k in prof.bwd_order]
    first = next((i for i, b in enumerate(backward) if b is not None), len(backward))
    return forward == names and backward[first:] == names[::-1]


def chain_profile(prof: Profile, chain: ChainFit, *, label: str) -> Profile | None:
    """``prof`` with its segments replaced by the fitted chain's (None when ``prof`` is not a chain)."""
    if not is_chain(prof):
        return None
    # NOTE: a segment's peak is never below the live bytes at its start, but a fitted block's backward
    # (and the head's) may peak below them: the whole chain runs ``lift`` bytes lower than it
    # holds (the first segment frees them, the last one gives them back) and every peak is lifted.
    lift = max(0, -min(chain.head, *chain.during.values()))
    first, last = prof.fwd_order[0], prof.bwd_order[-1]
    segments: dict[str, dict[Key, SegmentCost]] = {}
    for policy in prof.policies:
        saved, during = chain.saved[policy], chain.during[policy]
        costs = {key: SegmentCost(saved if key[1] else 0, 0, 0.0) for key in prof.fwd_order}  # below the end
        for key in prof.bwd_order:
            if key[1] is None:  # the head's backward: the end-of-forward point
                costs[key] = SegmentCost(0, chain.head + chain.margin + lift, 0.0)
            else:
                costs[key] = SegmentCost(chain.left - saved, during + chain.margin + lift, 0.0)
        costs[first] = replace(costs[first], delta=costs[first].delta - lift)
        costs[last] = replace(costs[last], delta=costs[last].delta + lift)
        segments[policy] = costs
    note = (
        f"Peaks predicted for {label} by a chain fitted to {label} measurements: worst error "
        f"{chain.worst_error:.1%} on them (NOTE [Predicting compiled peaks])."
    )
    return replace(prof, segments=segments, crossings=[], recomputes=[], notes=[*prof.notes, note])
