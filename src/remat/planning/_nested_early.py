"""Blocks recomputed outside their own backward, in the nested walk (``Costs.early``).

NOTE [A block whose backward begins early]
A block that returns a second tensor the parent uses apart from the chain (a router's
auxiliary loss) has backward nodes that need only that tensor's gradient, which arrives
at the start of the backward. Checkpointed, the block is recomputed there, and its
recomputation lives through every later block's backward. In a uniform run the blocks
after it are checkpointed alike, so the step that hosts the recomputation (the last
block's backward, or the glue before it) recomputes it under the run's policy, not the
plan's: a plan with the block under ``full`` and the next under ``selective`` took that
step from the selective run and predicted the selective recomputation's bytes (four
generated blocks: 24,576 B under the measured peak). So the walk corrects the hosting
step as the one-level model does (NOTE [Where a recomputation runs] in
``remat.profiling._crossing``): it adds what the plan's recomputation leaves live and
takes out what the run's left, and raises the step's peak to the profile's replay of that
segment with the plan's recomputation in place of the run's (``Early.swap``), or, where
there is no replay, by the plan's whole recomputation on top (safe). The block's own
backward, taken from its policy's run, frees what that run's recomputation left.
The planner still keeps such a block ``keep`` in nested plans and in no segment
(``remat.planning._nested``): a segment runs only blocks that return one tensor
(``remat.core._segment``); a segment ending at one returning an aux loss failed. The
correction serves plans made by hand, which ``remat.apply`` runs as given, and the floor's
descent (NOTE [Aux blocks in the descent] in ``remat.planning._nested_plan``).
"""

from __future__ import annotations

from remat.planning._nested_types import Costs, Early, Tree, Walk

__all__ = ["early_fixes"]


def early_fixes(c: Costs, tree: Tree, walk: Walk) -> tuple[dict[int, tuple[int, int]], dict[int, int]]:
    """For the blocks of ``c.early`` outside segments (NOTE [A block whose backward begins early]): per step index,
    (bytes added to its delta, least its peak reaches), and per step index, its peak in place of its run's (a
    block's backward, one segment, replayed with the plan's recomputation)."""
    out: dict[int, tuple[int, int]] = {}
    peaks: dict[int, int] = {}
    for e in c.early:
        own = tree.own.get(e.block)
        if own is None or tree.path.get(e.block):
            continue  # in a segment, which remat.apply refuses for such a block
        hosts = {place for place in e.at.values() if place != ("bwd", e.block)}
        if e.swap and len(hosts) == 1:
            _swapped(e, own.policy, hosts.pop(), walk, out, peaks)
        else:
            _charged(e, own.policy, walk, out)
    return out, peaks


def _swapped(
    e: Early, mine: int, host: tuple[str, int], walk: Walk, out: dict[int, tuple[int, int]], peaks: dict[int, int]
) -> None:
    """The hosting step with the plan's recomputation in place of its run's, from the profile's replay."""
    i = walk.first(host)
    if i < 0 or (q := walk.steps[i].run) == mine:
        return

    def here(policy: int) -> int:  # a run that recomputed it in its own backward left nothing here
        return e.kept.get(policy, 0) if e.at.get(policy) == host else 0

    delta = here(mine) - here(q)
    raised = e.swap.get((q, mine))
    if raised is not None and host[0] == "bwd":  # one segment, replayed: its peak, lower too
        peaks[i] = walk.steps[i].peak + raised  # the profile replays a segment hosting one such block only
        _add(out, i, delta, 0)
        return
    if raised is None:  # no replay of this pair: the plan's whole recomputation on top
        raised = max(e.excess.get(mine, 0), 0) + max(delta, 0)
    else:  # glue of several segments: those after the replayed one hold the difference too
        raised = max(raised, delta)
    _add(out, i, delta, walk.steps[i].peak + raised)


def _charged(e: Early, mine: int, walk: Walk, out: dict[int, tuple[int, int]]) -> None:
    """Without a replay: each step where a run recomputed the block and the plan does not (or the reverse)."""
    for policy, place in e.at.items():
        i = walk.first(place)
        if i < 0:
            continue
        q = walk.steps[i].run
        if q == policy != mine:  # the run recomputed it here, the plan does not
            _add(out, i, -e.kept[policy], 0)
        elif policy == mine != q:  # the plan recomputes it here, that run did not
            _add(out, i, e.kept[mine], walk.steps[i].peak + max(e.excess.get(mine, 0), 0))


def _add(out: dict[int, tuple[int, int]], i: int, delta: int, least: int) -> None:
    d, top = out.get(i, (0, 0))
    out[i] = (d + delta, max(top + delta, least + d))
