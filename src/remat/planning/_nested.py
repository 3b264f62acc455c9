"""Nested plans: checkpointed runs of blocks with a plan of their own inside.

NOTE [The nested peak model]
A segment [s, e) is checkpointed as one region (``remat.core._segment``). In forward its
blocks run saving nothing: each block's intermediate output is freed once the next block
has run, so the walk adds block k's forward under ``full`` and frees its input (the
previous block's output, ``output_bytes``) unless it is the segment's input (a block
whose output is a view of its input hands the storage on: NOTE [A block whose output is
a view of its input] in ``remat.planning._nested_views``). In backward the segment is
recomputed: blocks s..e-2 run again under their own plan (kept, checkpointed, or
sub-segments), then the last block, recomputed from its input like a ``full`` block (the
recomputation stops at its input: torch's early stop), then the backward of the rest in
reverse. The recomputation runs on top of what the last block's backward made before it
began (NOTE [What a segment's last block makes before its recomputation] in
``remat.planning._nested_walk``). Every number comes from the profile's uniform runs
(``remat.planning._solve.Chain``); after a segment's backward the walk continues from
the live bytes the flat chain would have (the blocks' own forward plus backward deltas),
so rounding inside a segment never leaks out of it.

NOTE [Selective caches inside a segment]
A block under torch's selective checkpoint keeps its cache (the matmul outputs it saves)
in the checkpoint's own storage, not through saved-tensor hooks, so inside a segment it
is not dropped with the rest of the segment's forward: it lives from the segment's
forward to the block's backward, and every recomputation of the segment makes a second
one for a while. "selective" runs op-level there too (NOTE [A region as saved-tensor
hooks] in remat.core._cheap_regions), so it is that policy and not the profiled one by
module. Neither fits the walk above, whose segment forward keeps nothing (GPT-2 4x64:
selective-ops inside a segment predicted 4.3% under the measured peak, "selective" up to
10% off either way), and the cache held through the rest of the step would couple a
segment's forward to the plan inside it, which the DP's cells cannot hold. So inside a
segment a block is "keep", "full" or "full-fine" (``Costs.inside``; exact on GPT-2 in every
shape tried, and on conv chains); selective policies stay for the blocks between segments.
A plan made by hand may still put one inside; the walk then adds its cache (the most a
selective policy's forward keeps over ``full``'s) at every forward of the block but its
own last recomputation, live until the block's backward: never under, over by at most
one cache per such forward (the copy a recomputation makes lives "for a while", not
known how long, so it is counted until the block's backward).

NOTE [Inputs written in place inside a segment]
A checkpointed call copies, before the write, each input its forward writes in place (NOTE
[What recomputation must not repeat] in remat.core._region) and keeps the copy until its
recomputation. A segment's region does so for the segment's input, and so does every
region that begins at the same block (a sub-segment, the block itself when checkpointed),
each with its own copy; a nested region also holds the written input itself. A segment
whose last block writes its input, or that ends before such a block (whose output the next
block then writes after the segment), measured one to two inputs over the walk on a flat
conv chain. Inside a segment, though, a writer whose input the segment made (the block
before it in the same segments, both under keep) writes a tensor no region copies:
``Conv2d, BatchNorm2d, ReLU(inplace=True)`` repeated, segments from conv to conv, measured
to the byte but for BatchNorm's buffers (below). So a segment never begins or ends at a
block that writes its input (``BlockProfile.writes_input``) nor ends before one, and
inside a segment such a block and the one before it are only ``keep`` (``Costs.writes``);
the profile says so in a note. A plan made by hand may still do otherwise: the walk then
counts, for such a writer, one copy of its input per region that holds it and one more
(the written input itself), and inside a segment one more again (a region inside another's
recomputation recomputes from its copy of the value before the write, not from the tensor
handed back: NOTE [A write after a call inside a recomputation] in
remat.core._nested_writes), live from the outermost segment's forward to the end of the
step: over by at most that many inputs (none to three on generated chains), never under.
The copies of BatchNorm's buffers each region keeps for its recomputation (their values as
the forward saw them) the walk counts as NOTE [Buffers a region keeps for its
recomputation] in ``remat.planning._nested_copies`` places them.

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
Each ``best(s, e)`` takes all its first items at once (arrays over the policies and over the split k,
times the GRID budgets): O(n^2) numpy steps, O(n^3 GRID) work. A plan reads its budget and the budgets
around it from one table (``remat.planning._nested_plan``), and the floor needs no table search (NOTE
[The floor without a grid] there). The work grows as n^3, so nested plans are made for chains of at
most ``MAX_BLOCKS`` blocks (the tables then hold about 170 MB; planning times per chain length:
``benchmarks/planning_time.py``, BENCHMARKS.md), and by ``remat.plan`` only below the one-level floor.

NOTE [Who frees a shared output]
A block's output is often saved both by the block (a ReLU keeps its output) and by
the next (a Conv keeps its input): in the uniform run of a policy the next block's
backward then leaves it alive, and the block's own backward frees it, so a block's
forward plus backward delta depends on its neighbour's policy (``Costs.holds``). The
DP bounds what the blocks after s leave at s's backward by the most, per block, of
its delta with that sharing moved to the block that holds the output (``held``), and
adds block s's own share for its policy. Taking the most of the raw deltas per block
instead counts each shared output twice on a flat chain (Conv, BatchNorm, ReLU
as single layers): one more output per three layers, enough that no time table fits
below the baseline where the floor is a fifth of it.

NOTE [What the parent does with a block's output]
A segment hands the parent, for each of its blocks but the last, the segment's output
(``remat.core._segment``): right only when the parent does nothing with a block's
output but pass it to the next block. Reading it (``hidden.append(x)`` summed into a
loss, ``x += bias``, a skip added after two blocks) would read the wrong values, and
nothing at run time can see a read. The profile can: its run without checkpointing
records every forward op that reads a block's output outside the next block
(``Profile.unchained``). Such a block is never inside a segment (``Costs.chained``), and
the rest of the chain still gets segments of its own. Not even as a segment's last block:
the read may be an in-place write (``x += bias`` in the parent), and a segment whose
output is written after it holds one output more than the walk (NOTE [Inputs written in
place inside a segment]); the profile does not tell a read from a write there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from remat.core._policy_registry import FULL, KEEP
from remat.planning._nested_costs import MAX_BLOCKS, costs_of
from remat.planning._nested_types import Costs, Node
from remat.planning._nested_views import freed_at
from remat.planning._nested_walk import extra_time, simulate

__all__ = ["MAX_BLOCKS", "Costs", "Node", "costs_of", "extra_time", "simulate", "solve_nested", "to_plan"]

GRID = 256


def _shift_rows(values: np.ndarray, by: np.ndarray) -> np.ndarray:
    """out[r, m] = values[r, m - by[r]] (``values[m - by[r]]`` for one row of values): each row's rest gets
    ``by[r]`` units less (more, for ``by`` < 0: clamped to the top, which costs at least as much, so on the
    safe side); inf where nothing is left."""
    size = values.shape[-1]
    index = np.arange(size)[None, :] - by[:, None]
    clipped = np.minimum(np.maximum(index, 0), size - 1)
    out = values[clipped] if values.ndim == 1 else values[np.arange(len(by))[:, None], clipped]
    out[index < 0] = np.inf
    return out


class _Recursion:
    """What the time DP (``_Tables``) and the floor's recursion (``remat.planning._nested_plan``) share: the
    chain's numbers with sizes made by ``up`` and frees by ``down`` (grid units, rounded safe, or bytes), the
    runs of blocks that save nothing, each cell's tail, and the order cells (s, e, top) are filled in (every
    cell after those it reads); the subclass fills a cell (``_fill``)."""

    def __init__(self, c: Costs, up: Callable[[Any], np.ndarray], down: Callable[[Any], np.ndarray]) -> None:
        ch, f = c.chain, c.full
        self.c, self.f, self.P = c, f, ch.fwd_delta.shape[1]
        self.inside = c.inside if c.inside is not None else np.ones(self.P, dtype=bool)
        n = len(ch.blocks)
        # span_ok[s, e]: blocks s..e-1 may form a segment: it neither begins nor ends at a block that writes its
        # input, nor ends before one (NOTE [Inputs written in place inside a segment])
        writes = np.append(c.writes if c.writes is not None else np.zeros(n, bool), False)
        ends_at_writer = np.append(False, writes[:-1])  # [e]: block e-1 writes its input
        self.span_ok = ~writes[:, None] & ~writes[None, :] & ~ends_at_writer[None, :]
        # inside_of[k]: the policies block k may take inside a segment; a writer and the block before it only keep
        self.inside_of = np.tile(self.inside, (n, 1))
        self.inside_of[writes[:-1] | writes[1:]] = np.array([p == KEEP for p in ch.policies])
        # outside_of[k]: the policies block k may take outside every segment (NOTE [A lone layer is kept one level
        # deep] in remat.planning._solve)
        self.outside_of = ch.outside if ch.outside is not None else np.ones((n, self.P), dtype=bool)
        self.alone_of = self.outside_of  # the same, for the walk's descent (NOTE [Aux blocks in the descent])
        early = np.bincount([o.receivers[0] for o in c.outputs], minlength=n)[:n] > 1
        if early.any():  # kept, in no segment: NOTE [A block whose backward begins early] in _nested_early
            self.outside_of = np.where(early[:, None], np.array([p == KEEP for p in ch.policies]), self.outside_of)
            runs = np.concatenate([[0], np.cumsum(early)])
            self.span_ok &= runs[None, :] == runs[:, None]
        if c.chained is not None:  # and hand their output to the next block only
            cut = np.concatenate([[0], np.cumsum(~c.chained)])
            self.span_ok &= cut[None, :] == cut[:, None]
        if c.without_grad is not None:  # NOTE [A block run without gradients is kept] in remat.planning._solve
            runs = np.concatenate([[0], np.cumsum(c.without_grad)])
            self.span_ok &= runs[None, :] == runs[:, None]
        if c.same_args is not None:  # and get the same arguments: none of blocks s+1..e-1 gets others than before
            moved = np.concatenate([[0], np.cumsum(~c.same_args)])
            moved = np.append(moved, moved[-1])
            self.span_ok &= moved[None, :-1] == moved[1:, None]
        self.FP, self.FD, self.BP, self.BD = up(ch.fwd_peak), up(ch.fwd_delta), up(ch.bwd_peak), up(ch.bwd_delta)
        self.csum, self.held = self._leftovers(c, up, down)
        self.post = (int(up(ch.post_peak.max())), int(up(ch.post_delta.max())))
        # kept[s, e], peak[s, e]: live bytes left and most reached by blocks s..e-1 run saving nothing;
        # refwd[s, e]: their forward time but the last block's (a segment's recomputation before its tail).
        self.kept, self.peak = np.zeros((n + 1, n + 1), dtype=np.int64), np.zeros((n + 1, n + 1), dtype=np.int64)
        self.refwd = np.zeros((n + 1, n + 1))
        for s in range(n):
            live = top = 0
            for k in range(s, n):
                top = max(top, live + int(self.FP[k, f]))
                live += int(self.FD[k, f]) - int(down(freed_at(c, s, k)))
                self.kept[s, k + 1], self.peak[s, k + 1] = live, top
                self.refwd[s, k + 1] = float(c.fwd_s[s:k].sum())

    @staticmethod
    def _leftovers(
        c: Costs, up: Callable[[Any], np.ndarray], down: Callable[[Any], np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray]:
        """(csum, held): csum[e] - csum[s], at most what blocks s..e-1 leave after their forward and backward,
        under any policies; held[s, j]: what block s under policy j adds to what the next block leaves (its
        output, which it holds until its own backward: NOTE [Who frees a shared output])."""
        ch, n, P = c.chain, len(c.chain.blocks), c.chain.fwd_delta.shape[1]
        holds = c.holds if c.holds is not None else np.zeros((n, P), dtype=bool)
        held = up(c.out)[:, None] * holds
        net = up(ch.fwd_delta) + up(ch.bwd_delta) + held
        net[1:] -= down(c.out)[:-1, None] * holds[:-1]
        return np.concatenate([[0], np.cumsum(net.max(axis=1))]), held

    def allowed(self, s: int, top: bool) -> np.ndarray:
        """[P]: the policies block s may take, outside every segment (``top``) or inside one."""
        return self.outside_of[s] if top else self.inside_of[s]

    def tried(self, s: int, top: bool) -> np.ndarray:
        """[P]: the policies the walk may try for block s (NOTE [Aux blocks in the descent] in
        ``remat.planning._nested_plan``): those of ``allowed``, and any one-level policy outside segments."""
        return self.alone_of[s] if top else self.inside_of[s]

    def _fill_all(self) -> None:
        n = len(self.c.chain.blocks)
        for length in range(1, n + 1):
            for s in range(n - length + 1):
                self._fill(s, s + length, False)
        for s in range(n, -1, -1):
            self._fill(s, n, True)

    def _fill(self, s: int, e: int, top: bool) -> None:
        raise NotImplementedError

    def _tail(self, e: int, top: bool) -> tuple[int, int, float]:
        if top:
            return (*self.post, 0.0)
        return int(self.BP[e - 1, self.f]), int(self.BD[e - 1, self.f]), float(self.c.chain.extra_s[e - 1, self.f])


class _Tables(_Recursion):
    """``best(s, e, top)`` as arrays over every budget m = 0..H grid units (NOTE [The nested DP]), built by
    increasing length with numpy over m and over the first segment's end k, with the choice per m for
    rebuilding the plan (codes: a policy j < P, or P + k)."""

    def __init__(self, c: Costs, unit: int, head: int) -> None:
        super().__init__(
            c, lambda a: -(-np.asarray(a, dtype=np.int64) // unit), lambda a: np.asarray(a, dtype=np.int64) // unit
        )
        self.unit, self.m = unit, np.arange(head + 1)
        n = len(c.chain.blocks)
        self.cost = {top: np.full((n + 1, n + 1, len(self.m)), np.inf) for top in (False, True)}
        self.pick = {top: np.full((n + 1, n + 1, len(self.m)), -1) for top in (False, True)}
        self._fill_all()

    def _fill(self, s: int, e: int, top: bool) -> None:
        ch, m, P = self.c.chain, self.m, self.P
        tail_peak, tail_delta, tail_time = self._tail(e, top)
        stop = e if top else e - 1
        if s == stop:
            self.cost[top][s, e, m >= tail_peak] = tail_time
            return
        after = int(self.csum[stop] - self.csum[s + 1]) + tail_delta
        rest = self.cost[top][s + 1, e]
        ok = (m[None, :] >= self.FP[s, :, None]) & (
            m[None, :] >= (self.FD[s] + after + self.held[s] + self.BP[s])[:, None]
        )
        ok &= self.allowed(s, top)[:, None]
        by_policy = ch.extra_s[s, :, None] + _shift_rows(rest, self.FD[s])
        options = [np.where(ok, by_policy, np.inf)]
        ks = np.arange(s + 2, stop + 1)
        ks = ks[self.span_ok[s, ks]]
        if len(ks):  # the first item a segment [s, k): the rest after its output, its own backward below
            kept = self.kept[s, ks]
            below = kept + (self.csum[stop] - self.csum[ks]) + tail_delta
            by_split = (
                _shift_rows(self.cost[top][ks, e], kept)
                + _shift_rows(self.cost[False][s, ks], below)
                + self.refwd[s, ks][:, None]
            )
            options.append(np.where(m[None, :] >= self.peak[s, ks][:, None], by_split, np.inf))
        table = np.concatenate(options)
        first = np.argmin(table, axis=0)  # the first of equal options, as a scan with strict < would keep
        best = table[first, m]
        codes = np.concatenate([np.arange(P), P + ks])
        self.cost[top][s, e] = best
        self.pick[top][s, e] = np.where(np.isfinite(best), codes[first], -1)

    def plan(self, s: int, e: int, top: bool, m: int) -> tuple[Node, ...]:
        code = int(self.pick[top][s, e, min(max(m, 0), len(self.m) - 1)])
        if code < 0:
            return ()
        if code < self.P:
            return (Node(s, code), *self.plan(s + 1, e, top, min(m - int(self.FD[s, code]), len(self.m) - 1)))
        k = code - self.P
        stop = e if top else e - 1
        kept = int(self.kept[s, k])
        below = kept + int(self.csum[stop] - self.csum[k]) + self._tail(e, top)[1]
        children = self.plan(s, k, False, min(m - below, len(self.m) - 1))
        return (Node(s, end=k, children=children), *self.plan(k, e, top, min(m - kept, len(self.m) - 1)))


def _tables_at(c: Costs, budget: int, finest: int | None = None) -> tuple[_Tables, int] | None:
    """The DP's tables up to ``budget`` and the budget's cell, or None where not even the glue fits. The grid
    is 1/GRID of ``finest`` (default ``budget``): one table answers every budget from ``finest`` up, each
    with at least that resolution (``cell``)."""
    unit = max(1, -(-int(max(finest if finest is not None else budget, 1)) // GRID))
    head = int(math.floor((budget - c.chain.start) / unit))
    if c.chain.pre_peak > budget or head < 0:
        return None
    return _Tables(c, unit, head), head


def cell(tables: _Tables, c: Costs, budget: int) -> int | None:
    """The cell of ``budget`` in ``tables`` (None where the glue does not fit)."""
    head = int(math.floor((budget - c.chain.start) / tables.unit))
    return None if c.chain.pre_peak > budget or head < 0 else min(head, len(tables.m) - 1)


def best_at(tables: _Tables, head: int) -> tuple[tuple[Node, ...], float] | None:
    n = len(tables.c.chain.blocks)
    cost = float(tables.cost[True][0, n, head])
    return None if not math.isfinite(cost) else (tables.plan(0, n, True, head), cost)


def solve_nested(c: Costs, budget: int) -> tuple[tuple[Node, ...], float] | None:
    """The nested plan of least extra time whose peak fits ``budget`` (NOTE [The nested DP]); None if none."""
    built = _tables_at(c, budget)
    return None if built is None else best_at(*built)


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
                assignment[names[node.end - 1]] = FULL
                visit(node.children)

    visit(nodes)
    return assignment, tuple(segments)
