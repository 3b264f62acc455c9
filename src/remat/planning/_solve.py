"""The planner's solver: a dynamic program over blocks and (rounded) live bytes.

NOTE [Why a DP, and why it is exact up to rounding]
The peak of a step is the largest ``live + excess`` over its segments (see
``remat.profile``). For a chain of blocks (forward 1..n, backward n..1) the live
bytes at block k's forward are ``L0 + S(k-1)`` and at its backward
``L0 + S(k) + U(k) + post``, where ``S(k)`` is the sum of the forward deltas of
blocks 1..k under their policies and ``U(k)`` the sum over later blocks of what
a block leaves behind after its own backward (its gradients: the same under every
policy, since every activation it kept is freed by then; where the profile says
otherwise the largest value is used). Every constraint is therefore a function
of the prefix ``S`` and the block's own policy, so a DP over k with state ``S``
finds the plan of least extra time. ``S`` is rounded *up* to a grid of
``span / 2**15`` bytes (span: the range of S): the DP never accepts a plan whose true predicted peak
exceeds the budget, and it misses a better plan only if that plan has less than
``n * grid`` bytes of slack (0.6% of the span for 200 blocks).

NOTE [A lone layer is kept one level deep]
``remat.apply`` refuses to checkpoint a lone single-op torch layer (a Linear, a LayerNorm,
a Dropout) on its own: its backward keeps its input, which checkpointing it keeps too, so
the most it frees is the op's own small state (a LayerNorm's mean and rstd), not worth a
recomputation a user asked for by name. The profile measures those few bytes and a solver
free to choose would take them: a flat ``Sequential``'s lowest-peak one-level plan
checkpointed its LayerNorms, a plan apply refused, so ``remat.auto`` could not run the
step it compares plans with, nor reach the floor it advertised. So the planner follows
apply's rule: such a block (``BlockProfile.single_op``) takes only ``keep`` one level deep
(``Chain.outside``), in every solver (this DP, the nested DP's top level, the greedy
fallback, the uniform and hand-made strategies). Inside a nested segment it may take any
policy, as apply allows there: the segment recomputes the run of layers around it.

NOTE [A block run without gradients is kept]
A block whose every forward in the step runs with gradients off (under the parent's
``torch.no_grad``, or inside an autograd Function's forward, as Reformer's reversible
layers run) saves nothing for a backward, so checkpointing it frees nothing there. What
its policy does change happens elsewhere, where nothing hooks it: Reformer's Function
calls the layer's parts again in its own backward, with gradients on, so a fine policy
checkpoints them there. The profile's uniform runs measured that saving, but against the
wrong block: a plan keeping layer 0 and checkpointing layer 1 was predicted 9.3% below
its measured peak, and the mirror plan above it. So every solver keeps such a block
(``BlockProfile.without_grad``), one level deep as a lone layer (``Chain.outside``) and
in no nested segment (``Costs.without_grad``): the floor is what the rest of the model
frees. A plan made by hand that checkpoints one is predicted as if it kept it
(``Profile.timeline``): what that frees in the Function's backward is not counted, and
the mis-credited saving is not taken either (Reformer's every mix: measured at or below
the prediction).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from remat.core._policy_registry import KEEP
from remat.profiling._types import BlockProfile, Key, Profile, SegmentCost

_GRID_STEPS = 2**15


@dataclass(frozen=True)
class Chain:
    """The profile reduced to per-block, per-policy numbers (see the NOTE)."""

    blocks: list[str]
    policies: list[str]
    fwd_delta: np.ndarray  # [n, P]
    fwd_peak: np.ndarray  # [n, P] most above the block's start, its following glue included
    bwd_peak: np.ndarray  # [n, P] block's backward excess
    after: np.ndarray  # [n] U(k): sum over i > k of max_p (fwd + bwd delta of block i)
    post_delta: np.ndarray  # [P] backward glue (head, loss) delta, by the last block's policy
    post_peak: np.ndarray  # [P]
    start: int  # L0: resting bytes plus the forward glue before the first block
    pre_peak: int  # most live during that glue
    extra_s: np.ndarray  # [n, P]
    bwd_delta: np.ndarray | None = None  # [n, P] block's backward delta (nested plans, planning/_nested.py)
    outside: np.ndarray | None = None  # [n, P] policies a block may take one level deep (None: any)


class _Casts:
    """A segment with autocast's cached weight casts freed by a fixed amount (NOTE [Autocast's weight
    casts outlive their block] in ``remat.profiling._trace``). The true amount is what every block's
    policy left to the cache, which one DP state cannot hold; the chain frees ``credit`` bytes where
    autocast exits instead. ``credit=0`` is safe (copies kept until backward); a positive credit can
    be too much, so plans made with one are checked with the exact peak model (``remat.plan``)."""

    def __init__(self, cost: SegmentCost, credit: int) -> None:
        self.delta = cost.delta + cost.cast_release - credit
        self.excess = max(cost.excess, cost.excess_released)


def cast_credits(profile: Profile, steps: int = 8) -> list[int]:
    """Credits to try: 0 up to the most any assignment can free (empty without autocast casts)."""
    segs = profile.segments.values()
    if not any(c.cast_release for costs in segs for c in costs.values()):
        return []
    keys = {k for costs in segs for k in costs}
    most = sum(max(costs[k].cast_cache for costs in segs if k in costs) for k in keys)
    return [most * i // steps for i in range(steps + 1)]


def chain_of(profile: Profile, credit: int = 0) -> Chain | None:
    """The chain view of ``profile``, or None when blocks are not a simple chain (``credit``: see ``_Casts``)."""
    fwd_blocks = [k[1] for k in profile.fwd_order if k[1] is not None]
    bwd_blocks = [k[1] for k in profile.bwd_order if k[1] is not None]
    if len(set(fwd_blocks)) != len(fwd_blocks) or bwd_blocks != fwd_blocks[::-1] or not fwd_blocks:
        return None
    first_bwd_block = next(i for i, k in enumerate(profile.bwd_order) if k[1] is not None)
    if any(k[1] is None for k in profile.bwd_order[first_bwd_block:]):
        return None
    pols = list(profile.policies)
    releases = {k for costs in profile.segments.values() for k, c in costs.items() if c.cast_release}
    seg = {
        p: {k: _Casts(c, credit if k in releases else 0) for k, c in costs.items()}
        for p, costs in profile.segments.items()
    }
    n, P = len(fwd_blocks), len(pols)
    fwd_delta, fwd_peak = np.zeros((n, P), np.int64), np.zeros((n, P), np.int64)
    bwd_delta, bwd_peak = np.zeros((n, P), np.int64), np.zeros((n, P), np.int64)
    groups: list[list[Key]] = []
    pre: list[Key] = []
    for key in profile.fwd_order:
        if key[1] is not None:
            groups.append([key])
        elif groups:
            groups[-1].append(key)
        else:
            pre.append(key)
    for i, group in enumerate(groups):
        for j, pol in enumerate(pols):
            live = top = 0
            for key in group:
                top = max(top, live + seg[pol][key].excess)
                live += seg[pol][key].delta
            fwd_delta[i, j], fwd_peak[i, j] = live, top
    bwd_key = {k[1]: k for k in profile.bwd_order if k[1] is not None}
    for i, name in enumerate(fwd_blocks):
        for j, pol in enumerate(pols):
            bwd_delta[i, j] = seg[pol][bwd_key[name]].delta
            bwd_peak[i, j] = seg[pol][bwd_key[name]].excess
    post = profile.bwd_order[:first_bwd_block]
    post_delta, post_peak = np.zeros(P, np.int64), np.zeros(P, np.int64)
    for j, pol in enumerate(pols):
        live = top = 0
        for key in post:
            top = max(top, live + seg[pol][key].excess)
            live += seg[pol][key].delta
        post_delta[j], post_peak[j] = live, top
    live = top = 0
    for key in pre:
        top = max(top, live + seg[KEEP][key].excess)
        live += seg[KEEP][key].delta
    net = (fwd_delta + bwd_delta).max(axis=1)
    after = np.concatenate([np.cumsum(net[::-1])[::-1][1:], [0]])
    by_name = {b.name: b for b in profile.blocks}
    extra = np.array([[by_name[b].extra_time_s[p] for p in pols] for b in fwd_blocks])
    return Chain(
        fwd_blocks,
        pols,
        fwd_delta,
        fwd_peak,
        bwd_peak,
        after,
        post_delta,
        post_peak,
        profile.resting_bytes + live,
        profile.resting_bytes + top,
        extra,
        bwd_delta,
        np.array([[p == KEEP or not kept_one_level(by_name[b]) for p in pols] for b in fwd_blocks]).reshape(n, P),
    )


def kept_one_level(block: BlockProfile) -> bool:
    """Kept one level deep (NOTE [A lone layer is kept one level deep], NOTE [A block run without gradients is
    kept])."""
    return block.single_op or block.without_grad


def _grid(chain: Chain) -> tuple[int, int, int]:
    """(grid bytes, lowest reachable S, number of cells)."""
    lo = int(min(0, np.cumsum(chain.fwd_delta.min(axis=1)).min()))
    hi = int(max(0, np.cumsum(chain.fwd_delta.max(axis=1)).max()))
    grid = max(1, -(-(hi - lo) // _GRID_STEPS))
    # Rounding up adds at most one cell per block.
    return grid, lo, (hi - lo) // grid + chain.fwd_delta.shape[0] + 2


def _shift(values: np.ndarray, by: int) -> np.ndarray:
    out = np.full_like(values, np.inf)
    if by >= 0:
        out[by:] = values[: len(values) - by]
    else:
        out[:by] = values[-by:]
    return out


def solve(chain: Chain, budget: float, *, minimise_peak: bool = False) -> tuple[list[int], float] | None:
    """Policy index per block minimising extra time with peak <= budget, and that time.

    With ``minimise_peak`` the objective is the peak itself (``budget`` ignored)
    and the number returned is the minimum peak, rounded up to the grid.
    Returns None when no plan fits.
    """
    grid, lo, cells = _grid(chain)
    n, P = chain.fwd_delta.shape
    levels = lo + grid * np.arange(cells, dtype=np.int64)  # upper bound of S in each cell
    shifts = -(-chain.fwd_delta // grid)  # ceil: the state only ever rounds up
    if not minimise_peak and chain.pre_peak > budget:
        return None
    best: tuple[list[int], float] | None = None
    # The last block's policy matters beyond its own segments only through the head's
    # backward glue; solve once per distinct glue cost (usually one), not once per policy.
    distinct: dict[tuple[int, int], int] = {}
    for j in range(P):
        distinct.setdefault((int(chain.post_delta[j]), int(chain.post_peak[j])), j)
    for last in sorted(distinct.values()):
        allowed_last = [
            j
            for j in range(P)
            if (int(chain.post_delta[j]), int(chain.post_peak[j]))
            == (int(chain.post_delta[last]), int(chain.post_peak[last]))
        ]
        value = np.full(cells, np.inf)
        value[-lo // grid] = float(chain.pre_peak) if minimise_peak else 0.0
        choices = np.zeros((n, cells), np.int8)
        for k in range(n):
            candidates = np.full((P, cells), np.inf)
            for j in allowed_last if k == n - 1 else range(P):
                if chain.outside is not None and not chain.outside[k, j]:
                    continue  # NOTE [A lone layer is kept one level deep], [A block run without gradients is kept]
                fwd_top = chain.start + levels + chain.fwd_peak[k, j]
                bwd_top = (
                    chain.start
                    + levels
                    + chain.fwd_delta[k, j]
                    + chain.after[k]
                    + chain.post_delta[last]
                    + chain.bwd_peak[k, j]
                )
                top = np.maximum(fwd_top, bwd_top)
                if minimise_peak:
                    cost = np.maximum(value, top)
                else:
                    cost = np.where(top <= budget, value + chain.extra_s[k, j], np.inf)
                candidates[j] = _shift(cost, int(shifts[k, j]))
            choices[k] = np.argmin(candidates, axis=0)
            value = candidates[choices[k], np.arange(cells)]
        final_top = chain.start + levels + chain.post_peak[last]
        total = np.maximum(value, final_top) if minimise_peak else np.where(final_top <= budget, value, np.inf)
        if not np.isfinite(total).any():
            continue
        # Least time first; among (near-)ties the lowest memory cell, so a smaller
        # budget never picks a plan with a larger peak than a larger budget's.
        cell = int(np.flatnonzero(total <= total.min() * (1 + 1e-9) + 1e-12)[0])
        found = float(total[cell])
        if best is None or found < best[1] - 1e-12:
            picks = [0] * n
            for k in range(n - 1, -1, -1):
                picks[k] = int(choices[k, cell])
                cell -= int(shifts[k, picks[k]])
            best = (picks, found)
    return best


def relax(profile: Profile, assignment: dict[str, str], limit: int) -> dict[str, str]:
    """``assignment`` with every block kept whose checkpointing the exact peak model shows is not needed.

    NOTE [Rounding never costs time]
    The DP rounds live bytes up, so a plan with less slack than its rounding (keeping
    every block at a budget of exactly the peak without checkpointing) looks over the
    budget to it and it checkpoints a block for nothing. Each checkpointed block, the
    costliest first, is tried kept with the exact peak model; kept where the plan still fits.
    """
    by_name = {b.name: b for b in profile.blocks}
    current = dict(assignment)
    for name in sorted(current, key=lambda n: -by_name[n].extra_time_s.get(current[n], 0.0)):
        if current[name] == KEEP:
            continue
        trial = {**current, name: KEEP}
        if profile.predict_peak(trial) <= limit and profile.predict_time(trial) <= profile.predict_time(current):
            current = trial
    return current
