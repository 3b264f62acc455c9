"""Nested plans for a profile: the floor, and the fastest plan within a budget.

NOTE [The floor without a grid]
The least peak of any nested plan is the least budget at which the DP of NOTE [The
nested DP] (``remat.planning._nested``) finds one. A search over budgets needs a table
per budget tried, and stops above the floor where rounding refuses the budgets near
it. The same recursion with the budget as
the unknown needs no grid: ``need(s, e)``, the fewest bytes above the live bytes at s
that blocks s..e-1 and their tail need, is the least over first items of the most of
what that item asks (its peaks, its backward after the rest's gradients) and what
the rest needs shifted by what the item keeps. That is O(n^2) numpy steps over the
splits, exact in bytes (no rounding), and ties go to the faster item. Least need
first is not the fastest plan at that peak (an item whose own peak binds leaves the
rest room to spare), so one time table (on a grid up to 4x finer) is read at every
cell up to 2n above the floor, and the fastest plan whose walk stays at the floor wins
(where none does, the least-need plan stands).

NOTE [A floor that does not follow the timings]
Where choices tie on need, the faster one is taken, and the walk of tied plans may differ
(the need is the DP's view, rounded on the safe side of what it does not model): a chain
of [BatchNorm block, BatchNorm block, block] had its last block `full` in a real profile
and `selective` in a fake one (roofline times), both of one need, walking 128,936 B and
137,128 B; `remat.auto`, planning on the fake profile, refused the budget the real one
reached. So the floor's plan then moves to any single block's other allowed policy that
walks lower, round after round until no such move is left (at most three rounds).

NOTE [Aux blocks in the descent]
The DP keeps a block returning an aux loss under ``keep`` and in no segment (its tables do
not model that block's recomputation at the start of the backward), while the walk predicts
any policy for it outside segments (NOTE [A block whose backward begins early] in
``remat.planning._nested_early``). So the descent, judged by the walk, may move such a block
to any policy it may take one level deep (``_Recursion.tried``): on a generated 6-block
chain with aux blocks second and fifth, the nested floor had been above the one-level one
(189,088 B vs 164,508); the descent checkpoints the second aux block and reaches 156,320 B,
measured 156,316 B. A segment still holds none (``remat.core._segment`` runs blocks that
return one tensor).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from remat.planning._nested import (
    GRID,
    Costs,
    Node,
    _Recursion,
    _tables_at,
    best_at,
    cell,
    costs_of,
    extra_time,
    simulate,
    to_plan,
)
from remat.planning._nested_types import Tree
from remat.profiling._types import Profile

_FINE_CELLS = 2_500_000
_NEVER = np.iinfo(np.int64).max // 4
"""The need of a choice not open inside a segment: more than any budget, and safe to add to."""
_DESCENT_ROUNDS = 3
_SCALES = (0.97, 0.985, 1.0, 1.02, 1.04, 1.06, 1.08, 1.1, 1.13, 1.16, 1.2)


class _Needs(_Recursion):
    """``need[top][s, e]`` and its choice (a policy j < P, or P + k for a segment [s, k); -1 at a tail)."""

    def __init__(self, c: Costs) -> None:
        exact = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
        super().__init__(c, exact, exact)
        n = len(c.chain.blocks)
        self.need = {t: np.zeros((n + 1, n + 1), np.int64) for t in (False, True)}
        self.time = {t: np.zeros((n + 1, n + 1)) for t in (False, True)}
        self.pick = {t: np.full((n + 1, n + 1), -1) for t in (False, True)}
        self._fill_all()

    def _fill(self, s: int, e: int, top: bool) -> None:
        tail_peak, tail_delta, tail_time = self._tail(e, top)
        stop = e if top else e - 1
        if s == stop:
            self.need[top][s, e], self.time[top][s, e] = max(0, tail_peak), tail_time
            return
        after = int(self.csum[stop] - self.csum[s + 1]) + tail_delta
        rest, rest_t = self.need[top][s + 1, e], self.time[top][s + 1, e]
        by_policy = np.maximum.reduce([self.FP[s], self.FD[s] + after + self.held[s] + self.BP[s], self.FD[s] + rest])
        needs = [np.where(self.allowed(s, top), by_policy, _NEVER)]  # NOTE [Selective caches inside a segment]
        times = [self.c.chain.extra_s[s] + rest_t]
        ks = np.arange(s + 2, stop + 1)
        ks = ks[self.span_ok[s, ks]]
        if len(ks):
            kept = self.kept[s, ks]
            below = kept + (self.csum[stop] - self.csum[ks]) + tail_delta
            needs.append(
                np.maximum.reduce([self.peak[s, ks], kept + self.need[top][ks, e], below + self.need[False][s, ks]])
            )
            times.append(self.refwd[s, ks] + self.time[top][ks, e] + self.time[False][s, ks])
        need, time = np.maximum(np.concatenate(needs), 0), np.concatenate(times)
        first = int(np.lexsort((time, need))[0])  # least need, then least time
        self.need[top][s, e], self.time[top][s, e] = need[first], time[first]
        self.pick[top][s, e] = first if first < self.P else self.P + int(ks[first - self.P])

    def plan(self, s: int, e: int, top: bool) -> tuple[Node, ...]:
        code = int(self.pick[top][s, e])
        if code < 0:
            return ()
        if code < self.P:
            return (Node(s, code), *self.plan(s + 1, e, top))
        k = code - self.P
        return (Node(s, end=k, children=self.plan(s, k, False)), *self.plan(k, e, top))


def lowest_nested(c: Costs, high: int) -> tuple[int, tuple[Node, ...]] | None:
    """The lowest peak of a nested plan (NOTE [The floor without a grid]) and the plan, or None above ``high``."""
    needs = _Needs(c)
    n = len(c.chain.blocks)
    if max(c.chain.pre_peak, c.chain.start + int(needs.need[True][0, n])) > high:
        return None
    nodes = needs.plan(0, n, True)
    best = (simulate(c, nodes), extra_time(c, nodes), nodes)
    # The least-need choices are not the fastest plan at that peak where an item's own peak leaves the rest
    # room to spare. The time table finds that plan a few grid cells (its rounding: at most one per block and
    # level) above the floor: read one table at every cell up to 2n above and keep what walks within it. A
    # finer grid finds it more often (synthetic 5-block chains: 12 of 12 at 4x, 11 at 1x); up to 4x as long as
    # the table stays within _FINE_CELLS.
    fine = max(1, min(4, _FINE_CELLS // ((n + 1) ** 2 * GRID)))
    unit = max(1, -(-best[0] // (fine * GRID)))
    built = _tables_at(c, best[0] + 2 * n * unit, finest=best[0] // fine)
    if built is None:
        return best[0], best[2]
    tables, last = built
    first = cell(tables, c, best[0])
    for head in range(first, last + 1) if first is not None else ():
        found = best_at(tables, head)
        walk = simulate(c, found[0]) if found is not None else _NEVER
        if found is not None and (walk, found[1]) < best[:2]:  # a lower walk lowers the floor itself
            best = (walk, found[1], found[0])
    return _descended(c, needs, best)


def _descended(c: Costs, needs: _Needs, best: tuple[int, float, tuple[Node, ...]]) -> tuple[int, tuple[Node, ...]]:
    """``best`` (walk, extra seconds, plan) with one block's policy changed while that walks lower (NOTE [A floor
    that does not follow the timings])."""
    for _ in range(_DESCENT_ROUNDS):
        tree, lower = Tree(best[2]), best
        for k, own in tree.own.items():
            if own is None:
                continue
            for j in map(int, np.flatnonzero(needs.tried(k, not tree.path[k]))):
                if j != own.policy:
                    nodes = _with_policy(best[2], k, j)
                    lower = min(lower, (simulate(c, nodes), extra_time(c, nodes), nodes), key=_walk_then_time)
        if lower is best:
            break
        best = lower
    return best[0], best[2]


def _walk_then_time(item: tuple[int, float, tuple[Node, ...]]) -> tuple[int, float]:
    return item[0], item[1]


def _with_policy(nodes: tuple[Node, ...], k: int, policy: int) -> tuple[Node, ...]:
    """``nodes`` with block k's own node under ``policy``."""
    return tuple(
        replace(node, policy=policy)
        if node.end is None and node.start == k
        else replace(node, children=_with_policy(node.children, k, policy))
        if node.end is not None
        else node
        for node in nodes
    )


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
        lowest = None if c is None else lowest_nested(c, profile.baseline_peak_bytes)
        cached = None if c is None or lowest is None else _settled(profile, c, lowest[1])
        profile.__dict__["_remat_nested_floor"] = cached
    return cached


def _settled(profile: Profile, c: Costs, nodes: tuple[Node, ...]) -> tuple[int, tuple[Node, ...]]:
    """The floor where ``plan_nested`` finds no lower walk: the floor is what a budget at it gets planned
    (``Plan.min_peak_bytes`` is the peak of the plan for that budget), and the tables read around a budget may
    hold a plan the DP's least need did not pick that walks lower (NOTE [The nested DP])."""
    floor = (_peak(profile, c, nodes), nodes)
    for _ in range(4):
        lower = min(((peak, nodes) for _, nodes, peak in _fitting(profile, c, floor[0])), key=_first, default=floor)
        if lower[0] >= floor[0]:
            break
        floor = lower
    return floor


def _first(item: tuple[int, tuple[Node, ...]]) -> int:
    return item[0]


def _fitting(profile: Profile, c: Costs, limit: int) -> list[tuple[float, tuple[Node, ...], int]]:
    """(extra seconds, plan, predicted peak) of the plans read from the tables at budgets around ``limit`` whose
    walk fits it. The DP's view differs from the walk where a block's input is freed by another block than in
    its own run (NOTE [The nested DP]), either way: read the fastest plan at a range of DP budgets around the
    limit from one table (its grid as fine as the lowest budget's own)."""
    built = _tables_at(c, int(limit * max(_SCALES)), finest=int(limit * min(_SCALES)))
    if built is None:
        return []
    out = []
    for scale in _SCALES:
        head = cell(built[0], c, int(limit * scale))
        trial = best_at(built[0], head) if head is not None else None
        peak = _peak(profile, c, trial[0]) if trial is not None else limit + 1
        if trial is not None and peak <= limit:
            out.append((trial[1], trial[0], peak))
    return out


def plan_nested(profile: Profile, limit: int) -> tuple[dict[str, str], tuple[tuple[str, str], ...], int, float] | None:
    """(assignment, segments, predicted peak, extra seconds) of the fastest nested plan within ``limit``."""
    c = costs_of(profile)
    if c is None:
        return None
    fits = [(t, nodes) for t, nodes, _ in _fitting(profile, c, limit)]
    floor = nested_floor(profile)
    if floor is not None and floor[0] <= limit:  # the floor's plan fits wherever the floor does
        fits.append((extra_time(c, floor[1]), floor[1]))
    if not fits:
        return None
    found = min(fits, key=lambda t: t[0])[::-1]
    assignment, segments = to_plan(c, found[0])
    return assignment, segments, _peak(profile, c, found[0]), extra_time(c, found[0])
