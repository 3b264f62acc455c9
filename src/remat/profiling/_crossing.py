"""Storages that blocks receive from outside: who frees them under a mix of policies.

NOTE [Storages across blocks]
The peak model composes an assignment's step from segments of uniform-policy runs
(NOTE [The peak model]). That is exact when each segment's change in live bytes
depends on its own block's policy only, which fails for a tensor whose lifetime
depends on *other* blocks' policies: a mask or bias built in forward and given to
every block, which kept blocks do not save (an ``add``) while checkpointed blocks
hold it among their inputs until their backward. Composed from segments, such a
tensor is freed twice or never (measured: +8% on a shared-bias MLP, issue #21).

So the profile records every storage a block call receives that was created outside
it and is not resting (a *crossing* storage): its size, the calls that receive it,
and, per policy run, the segment in which it was freed and the most live bytes after
the free in that segment. Under an assignment ``A`` it is freed at the later of

* where the keep run freed it: the Python lifetime and every holder that holds it
  under any policy (glue that saves it; the first kept block that saves it holds it
  as a checkpointed block too, among its inputs), and
* the backward segment of every receiving call whose block is checkpointed under
  ``A`` (remat's region holds a checkpointed call's inputs until its backward).

The walk then undoes each run's own free of it where ``A`` frees it elsewhere (the
storage stays live: the bytes after the run's free are raised by its size) and
frees it at the end of the segment where ``A`` does (on the safe side: live for the
whole of that segment). On chains every crossing storage is a block's input that
the block holds under every policy, nothing moves, and the model is exact as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Key = tuple[str, "str | None", int]


@dataclass(frozen=True)
class Crossing:
    """One crossing storage (see the NOTE above)."""

    nbytes: int
    """Size of the storage."""
    receivers: tuple[Key, ...]
    """Forward segment keys of the block calls that receive it."""
    freed: dict[str, Key | None]
    """Per policy: the segment in which that policy's run freed it (None: outlived the step)."""
    after: dict[str, int]
    """Per policy: most live bytes above that segment's start, after the free, in that run."""

    def to_json(self) -> dict:
        return {"nbytes": self.nbytes, "receivers": [list(k) for k in self.receivers],
                "freed": {p: None if k is None else list(k) for p, k in self.freed.items()}, "after": self.after}

    @classmethod
    def from_json(cls, data: dict) -> Crossing:
        return cls(int(data["nbytes"]), tuple(tuple(k) for k in data["receivers"]),
                   {p: None if k is None else tuple(k) for p, k in data["freed"].items()},
                   {p: int(v) for p, v in data["after"].items()})


def _free_position(c: Crossing, assignment: Mapping[str, str], position: Mapping[Key, int]) -> int | None:
    """Index in the walk of the segment where ``assignment`` frees ``c`` (None: never in the step)."""
    kept = c.freed.get("keep")
    if kept is None and "keep" in c.freed:
        return None  # something outside the step holds it
    latest = position.get(kept, -1) if kept is not None else -1
    for _, block, occurrence in c.receivers:
        if block is not None and assignment.get(block, "keep") != "keep":
            latest = max(latest, position.get(("bwd", block, occurrence), -1))
    return latest if latest >= 0 else None


def corrections(
    crossings: Sequence[Crossing], steps: Sequence[tuple[Key, str]], assignment: Mapping[str, str]
) -> dict[int, tuple[int, int]]:
    """Per walk index: (bytes to add to the delta, excess it must at least reach).

    ``steps`` is the walk: (segment key, the policy of the run it is taken from).
    """
    position = {key: i for i, (key, _) in enumerate(steps)}
    kept_live: dict[int, list[Crossing]] = {}
    out: dict[int, list[int]] = {}
    for c in crossings:
        at = _free_position(c, assignment, position)
        run_frees = {position[k] for p, k in c.freed.items() if k in position and steps[position[k]][1] == p}
        for i in run_frees - {at}:  # the run freed it here, the assignment does not
            kept_live.setdefault(i, []).append(c)
        if at is not None and at not in run_frees:  # the assignment frees it here, the run did not
            out.setdefault(at, [0, 0])[0] -= c.nbytes
    for i, kept in kept_live.items():
        policy = steps[i][1]
        added = sum(c.nbytes for c in kept)
        entry = out.setdefault(i, [0, 0])
        entry[0] += added
        entry[1] = max(c.after[policy] for c in kept) + added
    return {i: (d, e) for i, (d, e) in out.items()}
