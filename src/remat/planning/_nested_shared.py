"""Where the profile's storages that cross blocks are freed, placed in the nested walk (``Costs.shared`` and
``Costs.outputs``; NOTE [Storages handed to a segment from outside] and NOTE [Outputs the parent keeps that nothing
saves] in ``remat.planning._nested_walk``), and what a block's backward made before its recomputation
(``Costs.made_first``), and where a block is recomputed outside its own backward (``Costs.early``)."""

from __future__ import annotations

import numpy as np

from remat.core._policy_registry import FULL
from remat.planning._nested_types import Early, Place, Shared
from remat.planning._solve import Chain
from remat.profiling._types import Key, Profile


def _places(profile: Profile) -> dict[Key, Place]:
    """Every segment key of the profile -> the walk's place that holds it."""
    out: dict[Key, Place] = {}
    block, index = -1, dict[str, int]()
    for key in profile.fwd_order:
        if key[1] is not None:
            block = index.setdefault(key[1], len(index))
        out[key] = ("fwd", block) if block >= 0 else ("pre", -1)
    seen = False
    for key in profile.bwd_order:
        name = key[1]
        seen = seen or name is not None
        out[key] = ("bwd", index[name]) if name is not None else ("bwd" if seen else "post", -1)
    return out


def shared_storages(profile: Profile, chain: Chain, outputs: bool = False) -> tuple[Shared, ...]:
    """The glue-made storages handed to blocks, with each run's free placed in the walk (``Costs.shared``);
    with ``outputs``, the blocks' outputs instead, ``receivers`` then the block that made it (``Costs.outputs``)."""
    places, index = _places(profile), {b: i for i, b in enumerate(chain.blocks)}
    groups: dict[Place, list[Key]] = {}
    for key in (*profile.fwd_order, *profile.bwd_order):
        groups.setdefault(places[key], []).append(key)
    out = []
    for crossing in profile.crossings:
        receivers = [index.get(r[1] or "") for r in crossing.receivers]
        if outputs:
            receivers = [index.get(crossing.producer[1] or "")] if crossing.producer is not None else [None]
        if (crossing.producer is not None and not outputs) or None in receivers:
            continue
        freed: dict[int, Place | None] = {}
        after: dict[int, int] = {}
        for j, pol in enumerate(chain.policies):
            where = crossing.freed.get(pol, ("?", None, -1))
            if where is not None and where not in places:
                break  # freed where the walk has no place: leave it to the runs' own numbers
            freed[j] = None if where is None else places[where]
            if where is not None:
                after[j] = _after_free(profile, pol, groups[places[where]], where, crossing.after.get(pol, 0))
        else:
            out.append(Shared(crossing.nbytes, tuple(r for r in receivers if r is not None), freed, after))
    return tuple(out)


def _after_free(profile: Profile, policy: str, group: list[Key], key: Key, after: int) -> int:
    """Most live bytes above the start of ``group`` (a place's segments) after the free in ``key``."""
    costs = profile.segments[policy]
    live, top, found = 0, 0, False
    for k in group:
        cost = costs[k]
        if k == key:
            top, found = live + after, True
        elif found:
            top = max(top, live + cost.excess)
        live += cost.delta + cost.cast_release
    return top


def made_first(profile: Profile, chain: Chain) -> np.ndarray:
    """[n]: live bytes block k's backward under ``full`` has made when its recomputation begins (NOTE [What a
    segment's last block makes before its recomputation] in ``remat.planning._nested_walk``), as the profile
    recorded it; in an older profile, which did not, at most its backward's peak less the recomputation's own;
    where the full run recomputed it elsewhere or not at all, its backward's peak (on the safe side)."""
    out = np.array(chain.bwd_peak[:, chain.policies.index(FULL)], dtype=np.int64)
    index = {b: i for i, b in enumerate(chain.blocks)}
    for r in profile.recomputes:
        k = index.get(r.block)
        if k is not None and r.index == 0 and r.at.get(FULL) == ("bwd", r.block, 0):
            out[k] = r.before[FULL] if FULL in r.before else out[k] - r.excess.get(FULL, 0)
    return out


def early_recomputes(profile: Profile, chain: Chain) -> tuple[Early, ...]:
    """The chain's blocks some run recomputed outside their own backward (``Costs.early``; NOTE [A block whose
    backward begins early] in ``remat.planning._nested_early``), each run's recomputation placed in the walk."""
    places, index = _places(profile), {b: i for i, b in enumerate(chain.blocks)}
    pol = {p: j for j, p in enumerate(chain.policies)}
    out = []
    for r in profile.recomputes:
        k = index.get(r.block)
        own = ("bwd", r.block, r.index)
        if k is None or r.index != 0 or all(key == own for key in r.at.values()):
            continue
        if any(key not in places or p not in pol for p, key in r.at.items()):
            continue  # run where the walk has no place: left to the runs' own numbers
        hosts = {key for key in r.at.values() if key != own}
        swap = {}
        if len(hosts) == 1 and r.swap:
            (host,) = hosts
            swap = {
                (pol[q], pol[m]): v - profile.segments[q][host].excess
                for q, row in r.swap.items()
                for m, v in row.items()
                if q in pol and m in pol
            }
        at = {pol[p]: places[key] for p, key in r.at.items()}
        kept = {pol[p]: r.kept(p) for p in r.at}
        out.append(Early(k, at, kept, {pol[p]: v for p, v in r.excess.items() if p in pol}, swap))
    return tuple(out)
