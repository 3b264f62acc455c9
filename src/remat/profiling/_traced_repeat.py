"""A traced chain whose middle segments repeat: one short chain profiled, the profile widened to all of them.

NOTE [Identical segments are profiled once]
A forward that loops a function (seed 002's ``HeavyModel``: 1000 calls of 100 ops) is cut into
segments that run the same ops on a carry of the same shape. A profile runs every op of the step
under several dispatch layers, once per policy, so profiling 100,000 ops takes many minutes, yet
every middle segment costs what the others do. When the segments between the first and the last
run the same ops (same targets, arguments in the same places, carries of the same shape and dtype),
remat profiles a short chain instead: the first segment, ``MIDDLE`` middle ones and the last, which
is a chain like the whole (each segment takes the previous one's carry). Its profile is widened to
the whole chain: each middle segment takes the costs of the short chain's middle one at the same
distance from the ends, and whatever a record of it names (a crossing's producer, receivers and
freeing segment, a recomputation's host) moves with it. Three middle segments give every place a
segment can have: after the first, between two middles, before the last. A record that names a
segment further away than its neighbour, or anything else this widening cannot place, keeps the
full profile. The plan's peak is verified by measuring the whole model, as for any plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import fx

from remat.profiling._crossing import Crossing
from remat.profiling._types import Key, Profile

__all__ = ["MIDDLE", "short_chain", "widen"]

#: Middle segments in the short chain (NOTE [Identical segments are profiled once]).
MIDDLE = 3


# --- which segments repeat ------------------------------------------------------------------------


def _signature(nodes: list[fx.Node], lo: int, hi: int, carry_in: fx.Node | None, metas: dict) -> tuple | None:
    """What segment ``nodes[lo+1 .. hi]`` computes, with node names taken out (None: not comparable)."""
    values = [node for node in nodes[lo + 1 : hi + 1] if node.op not in ("placeholder", "get_attr")]
    local = {node: k for k, node in enumerate(values)}

    def ref(a: Any) -> Any:
        if not isinstance(a, fx.Node):
            return a
        if a is carry_in:
            return ("carry",)
        if a in local:
            return ("local", local[a])
        if a.op in ("placeholder", "get_attr"):
            return (a.op, str(a.target))
        raise _NotAChain

    ops = []
    try:
        for node in values:
            args = fx.node.map_aggregate(node.args, ref)
            kwargs = fx.node.map_aggregate(node.kwargs, ref)
            ops.append((node.op, node.target, args, tuple(sorted(kwargs.items())), metas.get(node)))
        signature = (metas.get(carry_in), tuple(ops))
        hash(signature)
    except (_NotAChain, TypeError):  # an unhashable constant: no comparison, the full profile runs
        return None
    return signature


class _NotAChain(Exception):
    """A segment reads a value of another segment besides its carry."""


def short_chain(
    nodes: list[fx.Node], carries: dict[int, fx.Node], cuts: list[int], metas: dict | None
) -> tuple[list[int], list[int]] | None:
    """The cuts, and the segments to profile (first, MIDDLE middle ones, last), when the middle segments repeat:
    at ``cuts``, or at cuts the same number of ops apart; None when neither repeats, or too few segments."""
    n = len(cuts) + 1
    if metas is None or n < MIDDLE + 3:
        return None
    for chain in (cuts, _even(nodes, carries, n)):
        if chain is not None and _repeats(nodes, carries, chain, metas):
            return chain, [0, *range(1, MIDDLE + 1), n - 1]
    return None


def _even(nodes: list[fx.Node], carries: dict[int, fx.Node], n: int) -> list[int] | None:
    """n - 1 cuts after every ``ops // n`` ops (the last segment takes the rest), where each is a carry."""
    at = [i for i, node in enumerate(nodes) if node.op not in ("placeholder", "get_attr", "output")]
    step = len(at) // n
    cuts = [at[k * step - 1] for k in range(1, n)]
    return cuts if step and all(c in carries for c in cuts) else None


def _repeats(nodes: list[fx.Node], carries: dict[int, fx.Node], cuts: list[int], metas: dict) -> bool:
    bounds = [-1, *cuts]
    first = _signature(nodes, bounds[1], bounds[2], carries.get(bounds[1]), metas)
    return first is not None and all(
        _signature(nodes, bounds[k], bounds[k + 1], carries.get(bounds[k]), metas) == first
        for k in range(2, len(bounds) - 1)
    )


# --- the profile widened --------------------------------------------------------------------------


def widen(prof: Profile, short: list[str], full: list[str]) -> Profile | None:
    """``prof`` (of the chain ``short``) as the profile of the chain ``full`` (NOTE [Identical segments are
    profiled once]); None when a record cannot be placed."""
    n, m = len(full), len(short)
    middle = MIDDLE - 1  # the short chain's middle segment between two middle ones: the one copied
    source = [i if i <= middle else (m - (n - i) if i >= n - 2 else middle) for i in range(n)]
    index = {name: s for s, name in enumerate(short)}
    try:
        fwd, fwd_groups = _grouped(prof.fwd_order, index)
        bwd, bwd_groups = _grouped(prof.bwd_order, index)
        new_fwd, new_fwd_groups = _order("fwd", fwd, fwd_groups, source, full, bwd=False)
        new_bwd, new_bwd_groups = _order("bwd", bwd, bwd_groups, source, full, bwd=True)
    except KeyError:
        return None
    where = {key: ("fwd", owner, j) for owner, keys in fwd_groups.items() for j, key in enumerate(keys)}
    where.update({key: ("bwd", owner, j) for owner, keys in bwd_groups.items() for j, key in enumerate(keys)})
    groups = {"fwd": new_fwd_groups, "bwd": new_bwd_groups}

    def mover(i: int) -> Callable[[Key], Key]:
        """Keys of the short chain named by a record of full owner ``i`` -> the full chain's keys."""
        anchor = _src(i, source)

        def move(key: Key) -> Key:
            phase, owner, j = where[key]
            if owner < 0 or abs(owner - anchor) <= 1:  # a neighbour: at the same distance
                target = owner if owner < 0 else i + owner - anchor
            elif anchor != middle and owner != middle:  # an end of the chain, named from near another end
                target = owner if owner < middle else n - (m - owner)
            else:
                raise KeyError(key)
            return groups[phase][target][j]

        return move

    if any(r.swap for r in prof.recomputes):  # excesses of other runs' hosts: not placed here
        return None
    owned = [(i, key) for i in range(-1, n) for g in (fwd_groups, bwd_groups) for key in g.get(_src(i, source), [])]
    try:
        segments = {policy: {mover(i)(key): costs[key] for i, key in owned} for policy, costs in prof.segments.items()}
        crossings = []
        for c in prof.crossings:
            if _to_every_block(c, where, m):  # NOTE [Identical blocks are profiled once] in _repeated_blocks
                crossings.append(_broadcast(c, mover(0), where, groups, source))
            else:
                crossings += [_moved_crossing(c, mover(i)) for i in _copies(c, where, source)]
        recomputes = [
            replace(r, block=full[i], at={p: mover(i)(k) for p, k in r.at.items()})
            for r in prof.recomputes
            for i in range(n - 1, -1, -1)  # backward's order, as the run lists them
            if source[i] == index[r.block]
        ]
    except KeyError:
        return None
    blocks = tuple(replace(prof.blocks[source[i]], name=full[i]) for i in range(n))
    copied = prof.blocks[middle]
    step = prof.step_time_s + (n - m) * (copied.fwd_time_s + copied.bwd_time_s)
    note = (
        f"Segments 2 to {n - 1} of the traced forward run the same ops: profiled once on a chain of {m} "
        "(NOTE [Identical segments are profiled once])."
    )
    return replace(
        prof,
        blocks=blocks,
        fwd_order=new_fwd,
        bwd_order=new_bwd,
        segments=segments,
        crossings=crossings,
        recomputes=recomputes,
        step_time_s=step,
        unchained=tuple(full[i] for i in range(n) if short[source[i]] in prof.unchained),
        new_arguments=tuple(full[i] for i in range(n) if short[source[i]] in prof.new_arguments),
        notes=[*prof.notes, note],
    )


def _src(i: int, source: list[int]) -> int:
    return -1 if i < 0 else source[i]


def _grouped(order: list[Key], index: dict[str, int]) -> tuple[list[int], dict[int, list[Key]]]:
    """The owners in order (-1: glue before any block) and each one's keys: a block's own, then the glue after it."""
    owners: list[int] = [-1]
    groups: dict[int, list[Key]] = {-1: []}
    for key in order:
        if key[1] is not None:
            owner = index[key[1]]
            if owner not in groups:
                owners.append(owner)
                groups[owner] = []
            groups[owner].append(key)
        else:
            groups[owners[-1]].append(key)
    return owners, groups


def _order(
    phase: str, owners: list[int], groups: dict[int, list[Key]], source: list[int], full: list[str], *, bwd: bool
) -> tuple[list[Key], dict[int, list[Key]]]:
    """The full chain's segment order of ``phase`` and each full owner's keys, glue renumbered in order."""
    n = len(full)
    sequence = [-1, *(range(n - 1, -1, -1) if bwd else range(n))]
    if owners != [-1, *sorted(set(owners) - {-1}, reverse=bwd)]:
        raise KeyError(phase)
    glue = 0
    order: list[Key] = []
    new_groups: dict[int, list[Key]] = {}
    for i in sequence:
        keys: list[Key] = []
        for key in groups.get(_src(i, source), []):
            if key[1] is None:
                keys.append((phase, None, glue))
                glue += 1
            else:
                keys.append((phase, full[i], key[2]))
        new_groups[i] = keys
        order.extend(keys)
    return order, new_groups


def _copies(c: Crossing, where: dict[Key, tuple[str, int, int]], source: list[int]) -> list[int]:
    """The full owners a crossing is copied for: those whose source is its producer's owner."""
    anchor = where[c.producer][1] if c.producer is not None else where[c.receivers[0]][1]
    if anchor < 0:
        return [-1]
    return [i for i, s in enumerate(source) if s == anchor]


def _moved_crossing(c: Crossing, move: Callable[[Key], Key]) -> Crossing:
    return replace(
        c,
        producer=None if c.producer is None else move(c.producer),
        receivers=tuple(move(k) for k in c.receivers),
        freed=_moved_freed(c, move),
    )


def _moved_freed(c: Crossing, move: Callable[[Key], Key]) -> dict[str, Key | None]:
    return {p: None if k is None else move(k) for p, k in c.freed.items()}


def _to_every_block(c: Crossing, where: dict[Key, tuple[str, int, int]], m: int) -> bool:
    """A storage the glue made and handed to every block of the short chain, once each (a mask, rotary tables)."""
    return c.producer is None and sorted(where[k][1] for k in c.receivers) == list(range(m))


def _broadcast(
    c: Crossing,
    move: Callable[[Key], Key],
    where: dict[Key, tuple[str, int, int]],
    groups: dict[str, dict[int, list[Key]]],
    source: list[int],
) -> Crossing:
    """A storage handed to every block, handed to every block of the full chain: each receives it where its
    source block did."""
    received = {where[k][1]: where[k] for k in c.receivers}
    receivers = []
    for i, s in enumerate(source):
        phase, _, j = received[s]
        receivers.append(groups[phase][i][j])
    return replace(c, receivers=tuple(receivers), freed=_moved_freed(c, move))
