"""Nested plans: checkpointed runs of blocks with a plan of their own inside (issue #19).

NOTE [The nested peak model]
A segment [s, e) is checkpointed as one region (``remat.core._segment``). In forward
its blocks run saving nothing: each block's intermediate output is freed once the
next block has run, so the walk adds block k's forward under ``full`` and frees its
input (the previous block's output, ``output_bytes``) unless it is the segment's
input. In backward the segment is recomputed: blocks s..e-2 run again under their
own plan (kept, checkpointed, or sub-segments), then the last block, recomputed
from its input like a ``full`` block (the recomputation stops at its input: torch's
early stop), then the backward of the rest in reverse. Every number comes from the
profile's uniform runs (``remat.planning._solve.Chain``); after a segment's backward
the walk continues from the live bytes the flat chain would have (the blocks' own
forward plus backward deltas), so rounding inside a segment never leaks out of it.

NOTE [The nested DP]
Griewank / rotor's recursion with remat's per-block segment costs: ``best(s, e, m)``
is the least extra time to run blocks s..e-1 forward then their tail (the head's
backward glue at the top, the segment's last block inside a segment) then backward,
within ``m`` grid units above the live bytes at s. The first item is a block under a
policy (the rest gets ``m`` minus what it keeps) or a segment [s, k) (the rest gets
``m`` minus its output; its own backward is ``best(s, k-1)`` with block k-1 as tail,
within what is left after the gradients the rest leaves). Sizes are rounded up and
frees down to a grid of 1/``GRID`` of the baseline peak, so an accepted plan never
exceeds its budget in the model; the exact walk (``simulate``) gives the prediction.
O(n^3) numpy steps over the GRID budgets (0.34 s for 24 blocks; the floor takes ~10 solves, once per
profile: ``Plan.min_peak_bytes`` is the floor): used for chains of at most ``MAX_BLOCKS`` blocks, and
by ``remat.plan`` to plan only below the one-level floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from remat.planning._solve import Chain, chain_of
from remat.profiling._types import Profile

GRID = 256
MAX_BLOCKS = 24
_SCALES = (0.97, 0.985, 1.0, 1.02, 1.04, 1.06, 1.08, 1.1, 1.13, 1.16, 1.2)


@dataclass(frozen=True)
class Node:
    """A block under a policy (``end`` is None) or a segment of blocks start..end-1 with ``children``."""

    start: int
    policy: int = -1
    end: int | None = None
    children: tuple[Node, ...] = ()


@dataclass(frozen=True)
class Costs:
    """The chain plus what nested plans need: output bytes and forward time per block."""

    chain: Chain
    out: np.ndarray
    fwd_s: np.ndarray
    full: int
    holds: np.ndarray | None = None
    """[n, P]: in the run of that policy, the block keeps its own output until its backward (a ReLU's)."""


def _fwd_record(c: Costs, nodes: tuple[Node, ...], live: int, top: int) -> tuple[int, int]:
    ch = c.chain
    for node in nodes:
        if node.end is None:
            top = max(top, live + int(ch.fwd_peak[node.start, node.policy]))
            live += int(ch.fwd_delta[node.start, node.policy])
        else:
            live, top = _fwd_nosave(c, node.start, node.end, live, top)
    return live, top


def _fwd_nosave(c: Costs, s: int, e: int, live: int, top: int) -> tuple[int, int]:
    ch, f = c.chain, c.full
    for k in range(s, e):
        top = max(top, live + int(ch.fwd_peak[k, f]))
        live += int(ch.fwd_delta[k, f]) - (int(c.out[k - 1]) if k > s else 0)
    return live, top


def _holders(c: Costs, nodes: tuple[Node, ...], out: dict[int, bool]) -> dict[int, bool]:
    """Block -> whether it keeps its own output until its backward under the plan (a segment's last block does not)."""
    for node in nodes:
        if node.end is None:
            out[node.start] = c.holds is not None and bool(c.holds[node.start, node.policy])
        else:
            out[node.end - 1] = False
            _holders(c, node.children, out)
    return out


def _block_bwd(c: Costs, k: int, policy: int, holds: dict[int, bool], live: int, top: int) -> tuple[int, int]:
    """Block k's backward as in ``policy``'s run, with its input freed where the plan frees it: that run's
    previous block may have kept it (then this block's delta does not free it) where the plan's does not."""
    ch = c.chain
    top = max(top, live + int(ch.bwd_peak[k, policy]))
    live += int(ch.bwd_delta[k, policy])
    if k > 0 and c.holds is not None:
        in_run, in_plan = bool(c.holds[k - 1, policy]), holds.get(k - 1, False)
        live += (int(c.out[k - 1]) if in_plan else 0) - (int(c.out[k - 1]) if in_run else 0)
    return live, top


def _bwd(c: Costs, nodes: tuple[Node, ...], live: int, top: int, holds: dict[int, bool]) -> tuple[int, int]:
    for node in reversed(nodes):
        if node.end is None:
            live, top = _block_bwd(c, node.start, node.policy, holds, live, top)
            continue
        live, top = _fwd_record(c, node.children, live, top)
        live, top = _block_bwd(c, node.end - 1, c.full, holds, live, top)
        live, top = _bwd(c, node.children, live, top, holds)
    return live, top


def simulate(c: Costs, nodes: tuple[Node, ...]) -> int:
    """Predicted peak of the nested plan ``nodes`` (NOTE [The nested peak model])."""
    ch = c.chain
    live, top = _fwd_record(c, nodes, ch.start, ch.pre_peak)
    top = max(top, live + int(ch.post_peak.max()))
    _, top = _bwd(c, nodes, live + int(ch.post_delta.max()), top, _holders(c, nodes, {}))
    return top


def extra_time(c: Costs, nodes: tuple[Node, ...]) -> float:
    """Predicted extra step time of ``nodes``: each block's policy, plus every segment's recomputation."""
    total = 0.0
    for node in nodes:
        if node.end is None:
            total += float(c.chain.extra_s[node.start, node.policy])
        else:
            total += float(c.fwd_s[node.start:node.end - 1].sum() + c.chain.extra_s[node.end - 1, c.full])
            total += extra_time(c, node.children)
    return total


def _shift(values: np.ndarray, by: int) -> np.ndarray:
    """out[m] = values[m - by]: the rest gets ``by`` units less (more, for ``by`` < 0: clamped to the top,
    which costs at least as much, so on the safe side); inf where nothing is left."""
    index = np.arange(len(values)) - by
    out = values[np.clip(index, 0, len(values) - 1)]
    return np.where(index < 0, np.inf, out)


class _Tables:
    """``best(s, e, top)`` as arrays over every budget m = 0..H grid units (NOTE [The nested DP]), built by
    increasing length with numpy over m, with the choice per m for rebuilding the plan."""

    def __init__(self, c: Costs, unit: int, head: int) -> None:
        ch, f = c.chain, c.full
        up = lambda a: -(-np.asarray(a, dtype=np.int64) // unit)  # noqa: E731
        self.c, self.f, self.P = c, f, ch.fwd_delta.shape[1]
        self.FP, self.FD, self.BP, self.BD = up(ch.fwd_peak), up(ch.fwd_delta), up(ch.bwd_peak), up(ch.bwd_delta)
        out = np.asarray(c.out, dtype=np.int64) // unit
        self.csum = np.concatenate([[0], np.cumsum(up((ch.fwd_delta + ch.bwd_delta).max(axis=1)))])
        self.post = (int(up(ch.post_peak.max())), int(up(ch.post_delta.max())))
        self.m = np.arange(head + 1)
        n = len(ch.blocks)
        self.nosave = {}
        for s in range(n):
            live = top = 0
            for k in range(s, n):
                top = max(top, live + int(self.FP[k, f]))
                live += int(self.FD[k, f]) - (int(out[k - 1]) if k > s else 0)
                self.nosave[s, k + 1] = (live, top)
        self.cost: dict[tuple[int, int, bool], np.ndarray] = {}
        self.pick: dict[tuple[int, int, bool], np.ndarray] = {}
        for length in range(1, n + 1):
            for s in range(n - length + 1):
                self._fill(s, s + length, False)
        for s in range(n, -1, -1):
            self._fill(s, n, True)

    def _tail(self, e: int, top: bool) -> tuple[int, int, float]:
        if top:
            return (*self.post, 0.0)
        return int(self.BP[e - 1, self.f]), int(self.BD[e - 1, self.f]), float(self.c.chain.extra_s[e - 1, self.f])

    def _fill(self, s: int, e: int, top: bool) -> None:
        ch, m = self.c.chain, self.m
        tail_peak, tail_delta, tail_time = self._tail(e, top)
        stop = e if top else e - 1
        best, pick = np.full(len(m), np.inf), np.full(len(m), -1)
        if s == stop:
            best[m >= tail_peak] = tail_time
            self.cost[s, e, top], self.pick[s, e, top] = best, pick
            return
        after = int(self.csum[stop] - self.csum[s + 1]) + tail_delta
        options = []
        for j in range(self.P):
            ok = (m >= self.FP[s, j]) & (m >= self.FD[s, j] + after + self.BP[s, j])
            options.append((j, np.where(ok, ch.extra_s[s, j] + _shift(self.cost[s + 1, e, top], int(self.FD[s, j])), np.inf)))
        for k in range(s + 2, stop + 1):
            kept, peak = self.nosave[s, k]
            below = kept + int(self.csum[stop] - self.csum[k]) + tail_delta
            cost = (_shift(self.cost[k, e, top], kept) + _shift(self.cost[s, k, False], below)
                    + float(self.c.fwd_s[s:k - 1].sum()))
            options.append((self.P + k, np.where(m >= peak, cost, np.inf)))
        for code, cost in options:
            better = cost < best
            best, pick = np.where(better, cost, best), np.where(better, code, pick)
        self.cost[s, e, top], self.pick[s, e, top] = best, pick

    def plan(self, s: int, e: int, top: bool, m: int) -> tuple[Node, ...]:
        code = int(self.pick[s, e, top][min(max(m, 0), len(self.m) - 1)])
        if code < 0:
            return ()
        if code < self.P:
            return (Node(s, code), *self.plan(s + 1, e, top, min(m - int(self.FD[s, code]), len(self.m) - 1)))
        k = code - self.P
        stop = e if top else e - 1
        kept = self.nosave[s, k][0]
        below = kept + int(self.csum[stop] - self.csum[k]) + self._tail(e, top)[1]
        children = self.plan(s, k, False, min(m - below, len(self.m) - 1))
        return (Node(s, end=k, children=children), *self.plan(k, e, top, min(m - kept, len(self.m) - 1)))


def solve_nested(c: Costs, budget: int) -> tuple[tuple[Node, ...], float] | None:
    """The nested plan of least extra time whose peak fits ``budget`` (NOTE [The nested DP]); None if none."""
    ch = c.chain
    unit = max(1, -(-int(max(budget, 1)) // GRID))
    head = int(math.floor((budget - ch.start) / unit))
    if ch.pre_peak > budget or head < 0:
        return None
    tables = _Tables(c, unit, head)
    n = len(ch.blocks)
    cost = float(tables.cost[0, n, True][head])
    return None if not math.isfinite(cost) else (tables.plan(0, n, True, head), cost)


def lowest_nested(c: Costs, low: int, high: int) -> tuple[int, tuple[Node, ...]] | None:
    """The lowest budget in [low, high] (to 0.1%) at which ``solve_nested`` finds a plan, and the plan."""
    found = solve_nested(c, high)
    if found is None:
        return None
    best = (simulate(c, found[0]), found[0])
    # One table at ``high`` bounds the floor to a cell per block (rounding) above its first feasible cell.
    unit = max(1, -(-high // GRID))
    head = int(math.floor((high - c.chain.start) / unit))
    first = int(np.flatnonzero(np.isfinite(_Tables(c, unit, head).cost[0, len(c.chain.blocks), True]))[0])
    high = min(high, c.chain.start + (first + 1) * unit)
    low = max(low, c.chain.start + (first - 2 * len(c.chain.blocks)) * unit)
    while high - low > max(1, high // 1000):
        mid = (low + high) // 2
        found = solve_nested(c, mid)
        if found is None:
            low = mid
        else:
            high = mid
            best = min(best, (simulate(c, found[0]), found[0]), key=lambda t: t[0])
    return best


def costs_of(profile: Profile) -> Costs | None:
    """The nested view of ``profile``: a chain of at most ``MAX_BLOCKS`` blocks with a ``full`` run; else None."""
    ch = chain_of(profile)
    if ch is None or "full" not in ch.policies or len(ch.blocks) > MAX_BLOCKS:
        return None
    by_name = {b.name: b for b in profile.blocks}
    out = np.array([by_name[b].output_bytes for b in ch.blocks], dtype=np.int64)
    holds = np.zeros((len(ch.blocks), len(ch.policies)), dtype=bool)
    index = {b: i for i, b in enumerate(ch.blocks)}
    for crossing in profile.crossings:  # a block's output: its size, and which runs freed it in its own backward
        made_by = crossing.producer[1] if crossing.producer is not None else None
        if made_by in index:
            k = index[made_by]
            out[k] = crossing.nbytes
            holds[k] = [crossing.freed.get(p) == ("bwd", made_by, crossing.producer[2]) for p in ch.policies]
    fwd = np.array([by_name[b].fwd_time_s for b in ch.blocks])
    return Costs(ch, out, fwd, ch.policies.index("full"), holds)


def to_plan(c: Costs, nodes: tuple[Node, ...]) -> tuple[dict[str, str], tuple[tuple[str, str], ...]]:
    """(block -> policy, segments as (first block, last block)); a segment's last block is ``full``."""
    names, pols = c.chain.blocks, c.chain.policies
    assignment: dict[str, str] = {}
    segments: list[tuple[str, str]] = []

    def visit(items: tuple[Node, ...]) -> None:
        for node in items:
            if node.end is None:
                assignment[names[node.start]] = pols[node.policy]
            else:
                segments.append((names[node.start], names[node.end - 1]))
                assignment[names[node.end - 1]] = "full"
                visit(node.children)

    visit(nodes)
    return assignment, tuple(segments)


def _peak(profile: Profile, c: Costs, nodes: tuple[Node, ...]) -> int:
    """The predicted peak of ``nodes``: the walk of NOTE [The nested peak model], or for a plan without segments
    (one policy per block, ``full-fine`` among them) the profile's own peak model, which also moves storages that
    cross blocks (Llama's rotary tables: the walk is 256 bytes under there)."""
    if any(node.end is not None for node in nodes):
        return simulate(c, nodes)
    return profile.predict_peak(to_plan(c, nodes)[0])


def nested_floor(profile: Profile) -> tuple[int, tuple[Node, ...]] | None:
    """The lowest predicted peak of a nested plan (cached on the profile), or None without a nested view."""
    cached = profile.__dict__.get("_remat_nested_floor", False)
    if cached is False:
        c = costs_of(profile)
        cached = None if c is None else lowest_nested(c, c.chain.pre_peak, profile.baseline_peak_bytes)
        if cached is not None:
            cached = (_peak(profile, c, cached[1]), cached[1])
        profile.__dict__["_remat_nested_floor"] = cached
    return cached


def plan_nested(profile: Profile, limit: int) -> tuple[dict[str, str], tuple[tuple[str, str], ...], int, float] | None:
    """(assignment, segments, predicted peak, extra seconds) of the fastest nested plan within ``limit``."""
    c = costs_of(profile)
    if c is None:
        return None
    # The DP's view differs from the walk where a block's input is freed by another block than in its own run
    # (NOTE [The nested DP]), either way: solve over a range of DP budgets around the limit and keep the
    # fastest plan whose walk fits (the floor's plan fits wherever the floor does).
    fits = []
    for scale in _SCALES:
        trial = solve_nested(c, int(limit * scale))
        if trial is not None and _peak(profile, c, trial[0]) <= limit:
            fits.append((trial[1], trial[0]))
    floor = nested_floor(profile)
    if floor is not None and floor[0] <= limit:
        fits.append((extra_time(c, floor[1]), floor[1]))
    if not fits:
        return None
    found = min(fits, key=lambda t: t[0])[::-1]
    assignment, segments = to_plan(c, found[0])
    return assignment, segments, _peak(profile, c, found[0]), extra_time(c, found[0])
