"""Storages that blocks receive from outside: who frees them under a mix of policies.

NOTE [Storages across blocks]
The peak model composes an assignment's step from segments of uniform-policy runs
(NOTE [The peak model]). That is exact when each segment's change in live bytes
depends on its own block's policy only, which fails for a tensor whose lifetime
depends on *other* blocks' policies: a mask or bias built in forward and given to
every block, which kept blocks do not save (an ``add``) while checkpointed blocks
hold it among their inputs until their backward. Composed from segments, such a
tensor is freed twice or never (a shared-bias MLP under-predicted by 8%).

A block's recomputation can also run outside its own backward: when one of its
outputs feeds the loss directly (an auxiliary loss, deep supervision), that output's
backward reaches into the block's graph during the loss's backward and recomputes
the block there, and what it rebuilt stays live until the block's own backward. The
profile records where each block's recomputation ran in each policy's run and what
it added to live bytes; the walk moves it to where the block's policy under ``A``
runs it (its excess added on the safe side: where in the segment it runs is not known).

A storage can also leave a block without being returned: a forward hook on one of its
sub-modules keeps it for the loss (transformers collects Mixtral's router logits so).
A selective block keeps it in its cache until its backward, a kept or full one lets
the hook's list free it with the loss. So every storage a block's forward makes (not
remat's own copies, not autocast's weight casts, which have their own account) is
followed too, and kept in the profile when some run frees it outside the block's own
forward and backward (measured: 38 of 81 Mixtral mixes were under by up to one
layer's router logits per selective block before).

So the profile records every storage a block call receives or returns that is not
resting, and every storage a block makes that some run frees elsewhere (a *crossing*
storage): its size, the call that made it (if a block did), the
calls that receive it, and, per policy run, the segment in which it was freed and the
most live bytes after the free in that segment. In the run of policy ``p`` it is freed
at the latest release of its holders: the Python lifetime and glue that saves it (the
same in every run), the block that made it (a kept block may save its own output, a
checkpointed one may not), and the receiving blocks (a kept block may save its input;
a checkpointed one holds it among its inputs until its backward). Under an assignment
``A`` it is freed, on the safe side and exactly where holders are known, at the latest of

* the run of the producer's policy (glue-made storages: the earliest of all runs,
  which holds only what every run holds): the producer's and glue's holds;
* the backward segment of every receiving call checkpointed under ``A``, unless the run of its policy freed
  the storage within the forward, then that run's free: a selective block saves the attention that reads a
  causal mask, its recomputation never reads the mask, and the block lets it go at the end of its forward
  (transformers 4.x GPT-2's mask was predicted 8192 B high under every selective mix before);
* the keep run, when some receiving call is kept under ``A`` (it may save it).

The walk then undoes each run's own free of it where ``A`` frees it elsewhere (the
storage stays live: the bytes after the run's free are raised by its size) and
frees it at the end of the segment where ``A`` does (on the safe side: live for the
whole of that segment). On chains every crossing storage is a block's input that
the block holds under every policy, nothing moves, and the model is exact as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from remat.core._policy_registry import KEEP

Key = tuple[str, "str | None", int]


@dataclass(frozen=True)
class Crossing:
    """One crossing storage (see the NOTE above)."""

    nbytes: int
    """Size of the storage."""
    producer: Key | None
    """Forward segment key of the block call that returned it (None: made by glue)."""
    receivers: tuple[Key, ...]
    """Forward segment keys of the block calls that receive it."""
    freed: dict[str, Key | None]
    """Per policy: the segment in which that policy's run freed it (None: outlived the step)."""
    after: dict[str, int]
    """Per policy: most live bytes above that segment's start, after the free, in that run."""

    def to_json(self) -> dict:
        return {
            "nbytes": self.nbytes,
            "producer": None if self.producer is None else list(self.producer),
            "receivers": [list(k) for k in self.receivers],
            "freed": {p: None if k is None else list(k) for p, k in self.freed.items()},
            "after": self.after,
        }

    @classmethod
    def from_json(cls, data: dict) -> Crossing:
        producer = data.get("producer")
        return cls(
            int(data["nbytes"]),
            None if producer is None else tuple(producer),
            tuple(tuple(k) for k in data["receivers"]),
            {p: None if k is None else tuple(k) for p, k in data["freed"].items()},
            {p: int(v) for p, v in data["after"].items()},
        )


_NEVER = 1 << 62  # freed after the step (outlived it): later than any segment


def _released_in_forward(c: Crossing, policy: str) -> bool:
    """Whether the run of ``policy`` freed ``c`` within the forward: its checkpointed receivers let it go there
    (their recomputation does not read it), so none holds it to its backward under any assignment."""
    freed = c.freed.get(policy)
    return freed is not None and freed[0] == "fwd"


def _free_position(c: Crossing, assignment: Mapping[str, str], position: Mapping[Key, int]) -> int | None:
    """Index in the walk of the segment where ``assignment`` frees ``c`` (None: not within the step)."""

    def freed_in(policy: str) -> int:
        key = c.freed.get(policy)
        return _NEVER if key is None else position.get(key, -1)

    def policy_of(block: str | None) -> str:
        return KEEP if block is None else assignment.get(block, KEEP)

    if c.producer is not None:
        latest = freed_in(policy_of(c.producer[1]))
    else:
        latest = min(freed_in(p) for p in c.freed)
    for _, block, occurrence in c.receivers:
        policy = policy_of(block)
        if policy == KEEP:
            latest = max(latest, freed_in(KEEP))
        elif _released_in_forward(c, policy):
            latest = max(latest, freed_in(policy))
        else:
            latest = max(latest, position.get(("bwd", block, occurrence), -1))
    return None if latest >= _NEVER or latest < 0 else latest


@dataclass(frozen=True)
class Recompute:
    """Where the k-th recomputation of a block ran in each policy's run, and its cost in live bytes."""

    block: str
    index: int
    at: dict[str, Key]
    """Per policy whose run recomputed it: the segment it ran in."""
    delta: dict[str, int]
    """Per policy: live bytes after it minus before (what it rebuilt and keeps for the block's backward)."""
    excess: dict[str, int]
    """Per policy: most live bytes during it above its start."""
    freed_after: dict[str, int] = field(default_factory=dict)
    """Per policy: bytes it rebuilt that the hosting segment frees again after it (an aux backward's use)."""
    swap: dict[str, dict[str, int]] = field(default_factory=dict)
    """Where it runs outside its block's backward: the excess of the segment hosting it, taken from the run of
    policy q, when the block's policy is m instead (swap[q][m]); empty where not known (NOTE below)."""
    before: dict[str, int] = field(default_factory=dict)
    """Per policy: live bytes above the start of the segment hosting it when it began (what that segment made
    first: the gradients a backward computes before it reads a saved tensor); empty in older profiles (NOTE
    [What a segment's last block makes before its recomputation] in remat.planning._nested_walk)."""

    def to_json(self) -> dict:
        return {
            "block": self.block,
            "index": self.index,
            "at": {p: list(k) for p, k in self.at.items()},
            "delta": self.delta,
            "excess": self.excess,
            "freed_after": self.freed_after,
            "swap": self.swap,
            "before": self.before,
        }

    def kept(self, policy: str) -> int:
        """What it adds to the live bytes at the end of its hosting segment under ``policy`` (0: not run)."""
        return self.delta.get(policy, 0) - self.freed_after.get(policy, 0)

    @classmethod
    def from_json(cls, data: dict) -> Recompute:
        return cls(
            data["block"],
            int(data["index"]),
            {p: tuple(k) for p, k in data["at"].items()},
            {p: int(v) for p, v in data["delta"].items()},
            {p: int(v) for p, v in data["excess"].items()},
            {p: int(v) for p, v in data.get("freed_after", {}).items()},
            {q: {m: int(v) for m, v in row.items()} for q, row in data.get("swap", {}).items()},
            {p: int(v) for p, v in data.get("before", {}).items()},
        )


# NOTE [Where a recomputation runs]
# A recomputation moved into a segment taken from another policy's run (an aux output's
# backward reaching into a block early), charged at that segment's peak, is safe but up
# to 30% over on generated models with aux losses. Ops run in the same order in every
# policy's run outside recomputations, so the number of allocating ops before a
# recomputation began is a position that holds in every run. The recorder keeps each
# segment's live bytes after every op (a trajectory) with that count; for a block
# recomputed outside its own backward, the profile replays the hosting segment of each
# run q with the block's recomputation taken out and the one of policy m put in at its
# position, and keeps the segment's excess for every (q, m). What a recomputation rebuilt
# can be freed again later in the same segment (the aux backward used it and let go):
# those frees go with it, out of q's replay and into m's, and the walk moves only what
# it leaves live at the segment's end (``Recompute.kept``; moving all of it predicts a
# shared-tensor model with an aux output under its measured peak). Done where one such recomputation
# runs in the segment (two would interact, also two of one block called twice);
# elsewhere the safe charge stays.
Trajectory = list[tuple[int, int, int]]


def _replayed(points: Trajectory, removed: tuple | None, inserted: tuple | None) -> int:
    """Most live bytes above the segment start once ``removed`` ((span), delta, frees by index) is taken out
    of ``points`` and ``inserted`` (position, delta, excess, frees by position) put in."""
    if removed is not None:
        (start, end), delta, frees = removed

        def back(i: int) -> int:  # what the segment freed again of what it rebuilt, up to point i
            return sum(nb for at, _, nb in frees if at <= i) - delta

        points = points[:start] + [
            (n, live + back(i), top + back(i)) for i, (n, live, top) in enumerate(points) if i >= end
        ]
    top = max((t for _, _, t in points), default=0)
    if inserted is None:
        return max(top, 0)
    at, delta, excess, frees = inserted
    # It began after the at-th allocating op, somewhere among the ops that allocate nothing after it (views,
    # in-place ops, frees in between): on the safe side, at the most live of them, all of them after it;
    # its rebuilt storages freed again count only from the next allocating op on.
    cut = next((i for i, (n, _, _) in enumerate(points) if n >= at), len(points))
    window = [live for n, live, _ in points[cut:] if n == at] or [points[cut - 1][1] if cut else 0]
    before = max((t for _, _, t in points[:cut]), default=0)
    after = max((t + delta - sum(nb for _, n_f, nb in frees if n > n_f) for n, _, t in points[cut:]), default=0)
    return max(before, max(window) + excess, after, 0)


def swap_excesses(
    block: str,
    runs: Mapping[str, Mapping],
    trajectories: Mapping[str, Mapping[Key, Trajectory]],
    crowded: set,
) -> dict[str, dict[str, int]]:
    """swap[q][m] for one recomputation (NOTE [Where a recomputation runs]); ``runs``: per policy that ran it,
    its record (segment, delta, excess, allocs, span); ``crowded``: segments hosting several such blocks."""
    # Runs that recomputed it in its own backward (selective by module: a region reruns when its block's
    # backward needs it, not when the aux backward passes) take no part: that segment is theirs anyway.
    runs = {p: r for p, r in runs.items() if r["segment"][1] != block}
    hosts = {tuple(r["segment"]) for r in runs.values()}
    if len(hosts) != 1:
        return {}
    (host,) = hosts
    if host in crowded or any(r.get("span") is None for r in runs.values()):
        return {}
    if any(host not in t for t in trajectories.values()):
        return {}
    out: dict[str, dict[str, int]] = {}
    for q, by_key in trajectories.items():
        mine = runs.get(q)
        removed = (tuple(mine["span"]), mine["delta"], mine["frees"]) if mine else None
        row = out[q] = {}
        for m in trajectories:
            if m == q:
                continue
            theirs = runs.get(m)
            inserted = (theirs["allocs"], theirs["delta"], theirs["excess"], theirs["frees"]) if theirs else None
            row[m] = _replayed(by_key[host], removed, inserted)
    return out


def corrections(
    crossings: Sequence[Crossing],
    recomputes: Sequence[Recompute],
    steps: Sequence[tuple[Key, str]],
    assignment: Mapping[str, str],
) -> dict[int, tuple[int, int, int, int | None]]:
    """Per walk index: (bytes to add to the delta, excess it must at least reach, bytes to add to the excess,
    the segment's excess in place of the run's: None to keep it).

    ``steps`` is the walk: (segment key, the policy of the run it is taken from).
    """
    if not crossings and not recomputes:
        return {}
    position = {key: i for i, (key, _) in enumerate(steps)}
    kept_live: dict[int, list[Crossing]] = {}
    out: dict[int, list[int]] = {}
    for c in crossings:
        at = _free_position(c, assignment, position)
        run_frees = {position[k] for p, k in c.freed.items() if k in position and steps[position[k]][1] == p}
        for i in run_frees - {at}:  # the run freed it here, the assignment does not
            kept_live.setdefault(i, []).append(c)
        if at is not None and at not in run_frees:  # the assignment frees it here, the run did not
            out.setdefault(at, [0, 0, 0])[0] -= c.nbytes
    held: dict[int, int] = {}
    for i, kept in kept_live.items():
        policy = steps[i][1]
        added = held[i] = sum(c.nbytes for c in kept)
        entry = out.setdefault(i, [0, 0, 0])
        entry[0] += added
        entry[1] = max(c.after[policy] for c in kept) + added
    for r in recomputes:
        mine = assignment.get(r.block, KEEP)
        if r.swap and _swapped(r, mine, position, steps, out):
            i = position[_host(r)]
            if len(out.get(i, ())) > 3:  # NOTE [A swapped segment that keeps a crossing storage]
                out[i][3] += held.get(i, 0)
            continue
        for policy, key in r.at.items():
            at_index = position.get(key)
            if at_index is None:
                continue
            taken_from = steps[at_index][1]
            if taken_from == policy and policy != mine:  # the run recomputed it here, the assignment does not
                out.setdefault(at_index, [0, 0, 0])[0] -= r.kept(policy)
            elif policy == mine and taken_from != mine:  # the assignment recomputes it here, that run did not
                entry = out.setdefault(at_index, [0, 0, 0])
                entry[0] += r.kept(policy)
                entry[2] += max(r.excess[policy], 0)
    return {i: (d, e, x, base) for i, (d, e, x, *rest) in out.items() for base in [rest[0] if rest else None]}


def _host(r: Recompute) -> Key:
    """The segment outside its block's backward where ``r`` runs (one, where it has a swap table)."""
    (host,) = {key for key in r.at.values() if key[1] != r.block}
    return host


# NOTE [A swapped segment that keeps a crossing storage]
# A crossing storage the run of the hosting segment freed there, which the assignment keeps live
# (NOTE [Storages across blocks]), raises every point of that run after its free; the segment's
# excess is then at least the most after the free plus its size. Where a recomputation is swapped
# in (NOTE [Where a recomputation runs]) the replayed excess replaces the run's, and taking the
# larger of the two lost the storage under the recomputation (measured: an aux block's
# recomputation beside a tensor shared by both blocks, one shared tensor under). Where in the
# replay the run freed it is not kept, so the storage is added to the whole replayed excess: on
# the safe side, by at most its size where the run freed it after the replay's most.


def _swapped(
    r: Recompute, mine: str, position: Mapping[Key, int], steps: Sequence[tuple[Key, str]], out: dict[int, list]
) -> bool:
    """Apply ``r``'s swap table to its hosting segment; False where the walk has no such segment."""
    host = _host(r)
    i = position.get(host)
    if i is None:
        return False
    taken_from = steps[i][1]
    if taken_from == mine:
        return True

    def kept_here(policy: str) -> int:  # a run that recomputed it in its own backward left nothing here
        return r.kept(policy) if r.at.get(policy) == host else 0

    entry = out.setdefault(i, [0, 0, 0])
    entry[0] += kept_here(mine) - kept_here(taken_from)
    entry.append(r.swap[taken_from][mine])  # one swap per segment: crowded segments get no table
    return True
