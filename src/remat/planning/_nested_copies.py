"""The copies of buffers the regions of a nested plan keep (``Costs.copies``), placed in the nested walk.

NOTE [Buffers a region keeps for its recomputation]
A checkpointed region copies each buffer its forward writes (BatchNorm's running
statistics, an EMA, a counter) and keeps the copy until it dies, so that a recomputation
starts from the values the forward saw; a recomputation runs on a second copy, swapped in
for the buffers while it runs (NOTE [What recomputation must not repeat] in
``remat.core._region``). The uniform runs hold one such region per block: the full run's
forward of a block keeps its copy until the block's backward, which also holds the
recomputation's copy, so a walk step taken from a run has that run's copies in it (the
profile records their bytes per block and policy: ``BlockProfile.buffer_copies``). A
nested plan holds others. For a block k whose forward writes b bytes of buffers, inside
segments (a flat ``Sequential`` of BatchNorm and conv blocks under two nested segments:
the walk was two copies, 272 B, under the measured peak):

* every segment that holds k, at any depth, copies them in the first forward, at k's
  forward, and keeps the copy until the segment dies at the end of its first block's
  backward; so does k's own region (k under a policy that is not keep, or a segment's
  last block), until the end of k's backward;
* a segment's recomputation swaps in one more copy for its whole run, which ends when the
  backward of its last block goes on (before that step's own peak); where k runs there
  under keep, its saved tensors may hold that copy until k's backward (BatchNorm saves its
  running statistics), so the walk keeps all of it until the end of k's backward: over by
  the buffers k's ops do not save (BatchNorm's 8-byte counter, an average only added in:
  72 B on a generated chain), never under;
* and it runs the regions inside it again (the sub-segments that hold k, k's own region
  unless k is the segment's last block, which it does not run), each making a copy at k's
  forward that dies with the recomputation.

The walk takes k's forwards from the runs of their steps (the full run inside a segment's
forward: one copy each, whatever k's own policy) and lets them go only where k's backward
is taken from a run that holds one. So ``buffer_copies_at_peak`` counts the copies above
as they are, and those the steps' runs hold as the walk has them, and adds the difference
to every step's peak (negative where a run's copy outlives the plan's). Exact where the
runs' copies are those of the plan's regions, but for the bound above; "selective" inside
a segment runs op by op (NOTE [Selective caches inside a segment] in
``remat.planning._nested``) while its run went by module, which may hold other copies. A
profile saved before remat recorded the copies has none (``Costs.copies`` is None): the
walk is under by them, as it was.

NOTE [Buffers a segment copies and drops]
A region's later calls run without the dispatch mode that copies a buffer before its first
write: they copy every buffer up to 64 KiB of each module their forward enters, and drop
the copies of those left unwritten when the forward ends (NOTE [Watching only when needed]
in ``remat.core._region``). A block's own region drops them within the block's forward, a
step the runs measured; a segment's region holds them until its last block's forward has
run: every segment that holds block k, in the first forward, and every segment a
recomputation runs again (those inside the one recomputed), each from k's forward to the
end of its own last block's forward (blocks holding a rotary ``inv_freq`` under three
nested segments: the walk was two copies, 256 B, under the measured peak).
``snapshots_at_peak`` adds them (``BlockProfile.buffer_snapshots``: the small buffers of
the modules under the block that its forward did not write; the written ones are the
copies above) at each step's peak: exact where the block enters every module under it,
over by the buffers of a module it does not enter, and by one copy per segment of a
buffer several blocks share (a region copies a storage once). A profile saved before remat
recorded them has none (``Costs.snapshots`` is None): the walk is under by them, as it was.
"""

from __future__ import annotations

import numpy as np

from remat.planning._nested_types import Costs, Step, Tree, Walk
from remat.planning._solve import Chain
from remat.profiling._types import Profile


def copies_of(profile: Profile, chain: Chain) -> np.ndarray | None:
    """[n, P]: ``BlockProfile.buffer_copies`` per block and policy (``Costs.copies``); None where the profile did
    not record them."""
    by_name = {b.name: b for b in profile.blocks}
    blocks = [by_name[b] for b in chain.blocks]
    if not any(b.buffer_copies for b in blocks):
        return None
    return np.array([[b.buffer_copies.get(p, 0) for p in chain.policies] for b in blocks], dtype=np.int64)


def buffer_copies_at_peak(c: Costs, tree: Tree, walk: Walk) -> np.ndarray:
    """[steps]: bytes of buffer copies the plan's regions hold at each step's peak less those its run's numbers
    hold there (NOTE [Buffers a region keeps for its recomputation])."""
    # events at positions 2i (the start of step i, before its peak) and 2i + 2 (its end)
    steps, first = walk.steps, walk.first
    events = np.zeros(2 * len(steps) + 2, dtype=np.int64)
    if c.copies is None:
        return events[:-2:2]
    again = {(s.place, s.tail): i for i, s in enumerate(steps) if s.again}
    began = {s.tail: i for i, s in reversed(list(enumerate(steps))) if s.again}
    for k in map(int, np.flatnonzero(c.copies.any(axis=1))):
        path, own = tree.path[k], tree.own[k]
        if not path:
            continue  # its steps are its own run's
        for i in walk.at[("fwd", k)]:  # what the runs hold: from the forward of k to the backward that frees it
            events[2 * i] -= int(c.copies[k, steps[i].run])
        for i in walk.at[("bwd", k)]:
            events[2 * i + 2] += int(c.copies[k, steps[i].run])
        tails = [n.end - 1 for n in path if n.end is not None]  # each segment's last block, outermost first
        held = int(c.copies[k, c.full])
        own_copy = int(c.copies[k, c.full if own is None else own.policy])  # none under keep
        # (bytes, where its first forward's dies): each segment holding k, outermost first, then k's own region
        regions = [(held, ("bwd", n.start)) for n in path] + [(own_copy, ("bwd", k))]
        for depth, (size, dies) in enumerate(regions):
            events[2 * first(("fwd", k))] += size  # the first forward's, until its end
            events[2 * first(dies) + 2] -= size
            for tail in tails[:depth]:  # made again by each recomputation of a segment around it that runs k
                at = again.get((("fwd", k), tail))
                if at is not None:
                    events[2 * at] += size
                    events[2 * first(("bwd", tail))] -= size
        for depth, tail in enumerate(tails):  # the copy a recomputation runs on; a kept block's saved tensors
            events[2 * began[tail]] += held  # may hold it until that block's backward
            kept = depth == len(tails) - 1 and own is not None and own_copy == 0
            events[2 * first(("bwd", k)) + 2 if kept else 2 * first(("bwd", tail))] -= held
    return np.cumsum(events)[:-2:2]


def snapshots_of(profile: Profile, chain: Chain) -> np.ndarray | None:
    """[n]: ``BlockProfile.buffer_snapshots`` per block (``Costs.snapshots``); None where none has any."""
    by_name = {b.name: b for b in profile.blocks}
    out = np.array([by_name[b].buffer_snapshots for b in chain.blocks], dtype=np.int64)
    return out if out.any() else None


def snapshots_at_peak(c: Costs, tree: Tree, steps: list[Step]) -> np.ndarray:
    """[steps]: bytes of the copies of unwritten small buffers the segments' regions hold at each step's peak (NOTE
    [Buffers a segment copies and drops])."""
    events = np.zeros(2 * len(steps) + 2, dtype=np.int64)
    if c.snapshots is None:
        return events[:-2:2]
    at = {(s.place, s.tail if s.again else None): i for i, s in enumerate(steps) if s.place[0] == "fwd"}
    for seg, end, above in tree.segments:
        size = c.snapshots[seg.start : end]
        if not size.any():
            continue
        # its forwards: the first, and one in every recomputation of a segment that holds it
        for tail in [None, *(a.end - 1 for a in above if a.end is not None)]:
            for k in range(seg.start, end):
                events[2 * at[(("fwd", k), tail)]] += int(size[k - seg.start])
            events[2 * at[(("fwd", end - 1), tail)] + 2] -= int(size.sum())
    return np.cumsum(events)[:-2:2]
