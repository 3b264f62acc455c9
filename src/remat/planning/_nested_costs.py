"""The nested view of a profile (``Costs``): the chain with what nested plans need, read from the profile's runs.

NOTE [Arguments a segment hands on]
A segment runs every block with its first block's other arguments (``remat.core._segment``):
right only where the parent calls them all alike. A block given a tensor its neighbour is not
(a mask only some layers take) raised on the first block's arguments, or computed with
others, before the parent's call of it could be checked. The profile records which tensors
made outside the blocks each block receives (``Profile.crossings``); a block whose set differs
from the block before it starts a new run (``Costs.same_args``): no segment holds both. The
chain's input, which the first block alone receives, is its hand-off, not an argument.
Arguments that are not tensors (their number, keywords and values: a diffusers down block calls
its resnets with ``temb=None`` and its downsampler without) the profile records as the run-time
check compares them, each value by identity (``Profile.new_arguments``), and a block called
otherwise than the block before it starts a new run too; so does one handed other tensor objects than the
block before it (a view the parent makes for each call, ``self.pos[:n]``: one storage, but the run-time check
compares identities). ``remat.core._segment`` still refuses a
chain whose calls differ at run time (a plan made by hand, a call that changes between steps).
"""

from __future__ import annotations

import numpy as np

from remat.core._policy_registry import FULL, SELECTIVES
from remat.planning._nested_copies import copies_of, snapshots_of
from remat.planning._nested_shared import early_recomputes, made_first, shared_storages
from remat.planning._nested_types import Costs
from remat.planning._nested_views import views_of
from remat.planning._solve import Chain, chain_of
from remat.profiling._types import Profile

__all__ = ["MAX_BLOCKS", "costs_of"]

#: The longest chain nested plans are made for (NOTE [The nested DP] in remat.planning._nested).
MAX_BLOCKS = 128
#: Policies that run under torch's selective checkpoint inside a segment (NOTE [Selective caches inside a segment]
#: in remat.planning._nested).
_SELECTIVE = SELECTIVES


def costs_of(profile: Profile) -> Costs | None:
    """The nested view of ``profile``: a chain of at most ``MAX_BLOCKS`` blocks with a ``full`` run; else None."""
    ch = chain_of(profile)
    if ch is None or FULL not in ch.policies or len(ch.blocks) > MAX_BLOCKS or profile.skips_layers:
        return None  # a model that skips layers at random: NOTE [LayerDrop and nested segments] in remat.core._hf
    chained = np.array([b not in profile.unchained for b in ch.blocks[:-1]] + [True])  # the last one feeds the head
    by_name = {b.name: b for b in profile.blocks}
    out = np.array([by_name[b].output_bytes for b in ch.blocks], dtype=np.int64)
    holds = np.zeros((len(ch.blocks), len(ch.policies)), dtype=bool)
    index = {b: i for i, b in enumerate(ch.blocks)}
    for crossing in profile.crossings:  # a block's output: its size, and which runs freed it in its own backward
        producer = crossing.producer
        if producer is not None and producer[1] in index:
            made_by = producer[1]
            k = index[made_by]
            out[k] = crossing.nbytes
            holds[k] = [crossing.freed.get(p) == ("bwd", made_by, producer[2]) for p in ch.policies]
    fwd = np.array([by_name[b].fwd_time_s for b in ch.blocks])
    inside = np.array([p not in _SELECTIVE for p in ch.policies])
    writes = np.array([by_name[b].writes_input for b in ch.blocks])  # NOTE [Inputs written in place inside a segment]
    shared = shared_storages(profile, ch)
    without_grad = np.array([by_name[b].without_grad for b in ch.blocks])
    return Costs(
        ch,
        out,
        fwd,
        ch.policies.index(FULL),
        holds,
        inside,
        chained,
        shared,
        writes,
        _same_args(profile, ch),
        shared_storages(profile, ch, outputs=True),
        by_name[ch.blocks[0]].input_bytes,
        made_first(profile, ch),
        copies_of(profile, ch),
        snapshots_of(profile, ch),
        views_of(profile, ch),
        without_grad if without_grad.any() else None,
        early_recomputes(profile, ch),
    )


def _same_args(profile: Profile, ch: Chain) -> np.ndarray:
    """[n]: block k receives the same tensors made outside the blocks as block k-1 (NOTE [Arguments a segment
    hands on]); the chain's input, received by the first block alone, is its hand-off, not an argument."""
    index = {b: i for i, b in enumerate(ch.blocks)}
    got: list[set[int]] = [set() for _ in ch.blocks]
    for i, crossing in enumerate(profile.crossings):
        receivers = {index.get(r[1] or "", -1) for r in crossing.receivers}
        if crossing.producer is None and receivers != {0}:
            for k in receivers - {-1}:
                got[k].add(i)
    moved = set(profile.new_arguments)
    return np.array([True] + [got[k] == got[k - 1] and ch.blocks[k] not in moved for k in range(1, len(got))])
