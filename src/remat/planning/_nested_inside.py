"""What blocks inside a segment add to the nested walk (NOTE [Selective caches inside a segment] and NOTE [Inputs
written in place inside a segment] in ``remat.planning._nested``): selective caches kept across recomputations, and
copies of inputs written in place."""

from __future__ import annotations

import numpy as np

from remat.core._policy_registry import KEEP
from remat.planning._nested_types import Costs, Tree, Walk

__all__ = ["selective_caches", "written_inputs"]


def selective_caches(c: Costs, tree: Tree, walk: Walk) -> dict[int, tuple[int, int]]:
    """A selective block inside a segment keeps a cache from every forward of it but its own last recomputation
    until its backward (NOTE [Selective caches inside a segment] in remat.planning._nested): per step index,
    (bytes added to its delta, least its peak reaches)."""
    if c.inside is None:
        return {}
    ch = c.chain
    out: dict[int, tuple[int, int]] = {}
    for k, own in tree.own.items():  # a segment's last block runs full, not selective
        if own is None or bool(c.inside[p := own.policy]):
            continue
        cache = max(int(ch.fwd_delta[k, j] - ch.fwd_delta[k, c.full]) for j in np.flatnonzero(~c.inside))
        made = [i for i in walk.at[("fwd", k)] if walk.steps[i].run != p]
        if cache <= 0 or not made:
            continue
        for i in made:  # a forward of it under its segment: its cache on top of the full run's numbers
            d, least = out.get(i, (0, 0))
            out[i] = (d + cache, max(least, walk.steps[i].peak + d + cache))
        bwd = walk.at[("bwd", k)][0]
        d, least = out.get(bwd, (0, 0))
        out[bwd] = (d - cache * len(made), least)  # let go with its backward (live through all of it: safe)
    return out


def written_inputs(c: Costs, tree: Tree, walk: Walk) -> dict[int, tuple[int, int]]:
    """Copies of a written input a block inside a segment, or right after one, makes (NOTE [Inputs written in
    place inside a segment] in remat.planning._nested), per step index: on the safe side, one per region that
    holds the block and one more, and inside a segment one more again, live from the outermost segment's
    forward to the end of the step."""
    if c.writes is None or not c.writes.any():
        return {}
    out: dict[int, tuple[int, int]] = {}
    for k in map(int, np.flatnonzero(c.writes)):
        path, path_before = tree.path[k], tree.path[k - 1] if k > 0 else ()
        if not (path or path_before) or _written_inside(c, tree, k):
            continue
        first = min(p[0].start for p in (path, path_before) if p)
        copies = max(len(path), len(path_before)) + (2 if path else 1)
        extra = copies * int(c.out[k - 1] if k > 0 else c.first_input)
        at = walk.at[("fwd", first)][0]
        d, least = out.get(at, (0, 0))
        out[at] = (d + extra, max(least, walk.steps[at].peak + d + extra))
    return out


def _written_inside(c: Costs, tree: Tree, k: int) -> bool:
    """Block k writes its input inside every segment that holds it, which all hold block k-1 too, and neither
    block is a region of its own or a segment's last (both under keep): the write is on a tensor the segments
    made, so no region copies it (NOTE [Inputs written in place inside a segment] in remat.planning._nested)."""
    if k == 0 or KEEP not in c.chain.policies:
        return False
    keep = c.chain.policies.index(KEEP)
    held, held_before, own, own_before = tree.path[k], tree.path[k - 1], tree.own[k], tree.own[k - 1]
    same = bool(held) and len(held) == len(held_before) and all(a is b for a, b in zip(held, held_before))
    return same and all(node is not None and node.policy == keep for node in (own, own_before))
