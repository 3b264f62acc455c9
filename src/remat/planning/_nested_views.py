"""Blocks whose output is a view of their input, in a segment's forward (``Costs.views``).

NOTE [A block whose output is a view of its input]
A segment's forward keeps no block's output: the walk frees block k-1's output once block
k has run (NOTE [The nested peak model] in ``remat.planning._nested``). A block whose output
shares storage with its input (a Flatten after a pool, a reshape) hands that storage on
instead: it is freed only once the block after it has run, or never in the segment's forward
when it is the segment's input, which the region holds until its backward. Taken as every
other block, the walk freed it at the view and again after the next block: a flat conv chain
whose segments held Flatten and the Linear after it was the pooled tensor (512 B) under the
measured peak per segment; a reshape inside a segment over 8 KiB outputs, one output per
segment forward run (two for a nested pair). The profile records which blocks return a view
of what they were called with (``BlockProfile.views_input``: the first tensor returned shares
storage with the first tensor passed); ``freed_at`` frees that storage once, after the first
block after it that does not return it, the size of the block that made it; the DP's runs of
blocks saving nothing (``_Recursion.kept``) and the walk's segment forwards both take it from
there. A block that writes its input in place and returns it (``ReLU(inplace=True)``) is not
taken as a view: its full run's region copies that input before the write, a copy the segment
does not make, and the free at it cancels that copy (exact on flat conv chains, as before).
A segment that ends at a view block of a block that saves nothing of it (Flatten after a pool)
stays over by the storage the recomputation rebuilds, which the walk keeps, as the keep run
did, through the backward of the block before (2048 B in ``tests/planning/test_nested_walk.py``,
as before). A profile saved before remat recorded views has none (``Costs.views`` is None):
both free every output, as they did.
"""

from __future__ import annotations

import numpy as np

from remat.planning._nested_types import Costs
from remat.planning._solve import Chain
from remat.profiling._types import Profile


def views_of(profile: Profile, chain: Chain) -> np.ndarray | None:
    """[n]: block k's output shares storage with its input and it does not write it (``Costs.views``); None where
    no block's does."""
    by_name = {b.name: b for b in profile.blocks}
    views = np.array([by_name[b].views_input and not by_name[b].writes_input for b in chain.blocks], dtype=bool)
    return views if views.any() else None


def freed_at(c: Costs, s: int, k: int) -> int:
    """Bytes block k's forward in a segment that begins at block s frees once it has run: block k-1's output,
    unless block k returns a view of it or it is a view of the segment's input (NOTE [A block whose output is a
    view of its input])."""
    if k <= s:
        return 0
    if c.views is None:
        return int(c.out[k - 1])
    if c.views[k]:
        return 0  # block k's output holds it
    maker = k - 1
    while maker >= s and c.views[maker]:
        maker -= 1
    return 0 if maker < s else int(c.out[maker])  # the segment's input: the region holds it


def hands_on(c: Costs, k: int, e: int) -> bool:
    """Block k's output storage is block e-1's: every block after it up to e-1 returns a view of its input."""
    return c.views is not None and bool(c.views[k + 1 : e].all())
