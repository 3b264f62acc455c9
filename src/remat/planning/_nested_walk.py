"""The walk that predicts a nested plan's peak (NOTE [The nested peak model] in ``remat.planning._nested``).

NOTE [Storages handed to a segment from outside]
A tensor the parent makes once and hands to several blocks (a mask, a bias added in)
is freed where its last holder lets go (NOTE [Storages across blocks] in
``remat.profiling._crossing``): the glue, a kept block that saves it, a checkpointed
block that holds it among its inputs until its backward. A segment holds every
argument of its first block (the region runs the whole segment with them) until the
end of its backward, which is block ``s``'s backward in the walk, so a receiver inside
a segment holds it until then whatever its own policy. The walk composes uniform runs
block by block, and the run a step is taken from frees such a tensor where that run's
holders let go: the keep run after the last block's forward, the full run in the first
block's backward. Composed so, it was freed in a kept block's forward while the
segment still held it (a segment over blocks adding in one shared tensor: predicted
one tensor low). So the walk undoes each step's own free of it where the plan frees it
elsewhere (the tensor stays live from there, the step's peak after the free raised by
its size, exactly as the profile recorded it) and frees it at the end of the step where
the plan does (live through the whole of that step: safe, by at most its size there).
A recomputation never frees it: its run's free is undone there too.

NOTE [Outputs the parent keeps that nothing saves]
A parent that keeps every block's output in a list (for skips it may take) holds each
until its forward returns; where no block saves the output itself (the next block's
Linear saves a contiguous copy of a transposed view), the keep run frees it in the glue
after the last block, a step the walk takes from that block's run. A segment lets go
of its blocks' outputs but the last in its own forward (the parent gets the segment's
output in their place), so taken unchanged that step freed them a second time
(a segment over a block whose output is a view: predicted one output low); and it
holds its input, the previous block's output, until its backward, so that step freed
one the plan still holds. The walk undoes such a step's free, the step's peak after
the free raised by the output's size. The segment holds its input through its blocks'
recomputations too, where the keep run of a block that does not save its input (a
traced unit that begins with a tanh) frees it in the glue after the block (nested plans
on traced models: one output low). So every run's free of it from the segment's forward
to the first block's backward is undone, and that backward frees it where its own run freed it elsewhere
(``_block_bwd`` takes it to be there): live through that step, safe by its size there.
Recomputations run the segment's first block under its own policy, whose run may free the
input in the block's forward too (a Dropout kept inside the segment saves only its mask:
flat Sequentials of Dropout, BufferBlock and Linear at the nested floor measured one input,
3072 B, over the walk); that free is undone the same way.

NOTE [An input its block holds until its backward]
A block whose run keeps its input until the block's backward (a checkpointed region holds
its inputs; a Linear saves an input it can use as it is) holds it under the plan whatever
the runs the walk takes the steps between from. A keep run whose Linears save contiguous
copies of their inputs (every output after a BatchNorm between transposes is laid out
transposed: a residual add keeps its operand's strides) lets go of each output in the
glue where the parent's list of outputs dies; composed so, a full block's input was freed
there and again in the block's backward (chains of [BatchNorm block, block, block],
(full, full, keep) one level deep: predicted 114,808 B, measured 120,960 B; the floor's
nested plan over four such blocks one activation, 8,192 B, under its budget). So, as for a
segment's input below, every run's free of it between the block's last forward and its
backward is undone, and the backward frees it where its own run freed it elsewhere.

NOTE [A block that holds its output before one that lets go of it]
A block whose run keeps its own output until its backward (``Costs.holds``: a Linear's
output that "selective" caches) followed by one whose run lets go of its input in its
forward (a Dropout under keep saves only its mask): the keep run frees that output in the
Dropout's forward, where nothing holds it, and the walk took that free while the plan's
block still held it (the blocks' outputs between, at top level or in a recomputation:
predicted one output, 8192 B, under the measured peak). The walk undoes that free (the
step's peak after it raised by the output), and the next block's backward, whose run
never held it, no longer adds it back; the block's own backward frees it.

NOTE [What a segment's last block makes before its recomputation]
A segment is recomputed when the backward of its last block first reads a tensor the
region saved; whatever that backward made before (the gradient of a view written in place:
``CopySlices`` allocates the base's gradient and a copy of it, two outputs, before its
first read) stays live through the recomputation of every block before it. The full
run of that block made the same bytes before recomputing the block alone, so the profile
records them (``Recompute.before``, ``Costs.made_first``), and the walk's backward step of
the block, taken from that run, includes them; the recomputation of blocks s..e-2 before
it did not (a segment ending at a block whose output is ``y.mul_(0.5).relu_()``:
predicted 3840 B under the measured peak). So every step of a segment's recomputation
peaks that many bytes higher (``Step.tail``): exact where it is recorded. A profile saved
before remat recorded it bounds it by the block's backward peak less its recomputation's,
and a block the full run did not recompute in its own backward by its backward peak.
NOTE [An output its block holds, freed by another run]
A block outside segments whose run keeps its own output until its backward (a ReLU saves
it) holds it there under the plan, whatever run the steps between are taken from. A step
of another run may free it: torchvision's Inception reductions hand one input to a
``wide`` branch and to a chain, and concatenate their outputs; a segment ending the
chain runs its last block full, the walk takes that block's forward from the full run,
and there ``wide`` is a region that saves nothing, so its output dies in the concat
(a segment over the chain's last two convs: predicted 75,264 B, that output, under the
measured peak; Inception v3 at its floor + 1%, 0.17%). The walk undoes such a free from
the block's forward to its backward (the next block's forward is NOTE [A block that
holds its output before one that lets go of it]); the block's own backward frees it.
"""

from __future__ import annotations

import numpy as np

from remat.core._policy_registry import KEEP
from remat.planning._nested_copies import buffer_copies_at_peak, snapshots_at_peak
from remat.planning._nested_early import early_fixes
from remat.planning._nested_inside import selective_caches, written_inputs
from remat.planning._nested_types import Costs, Node, Place, Shared, Step, Tree, Walk
from remat.planning._nested_views import freed_at, hands_on

_NEVER = 1 << 62


def _fwd_record(c: Costs, nodes: tuple[Node, ...], steps: list[Step], tail: int) -> None:
    """The forward of ``nodes``: the first (``tail`` -1) or the recomputation of the segment ending at ``tail``."""
    ch = c.chain
    for node in nodes:
        if node.end is None:
            k, p = node.start, node.policy
            steps.append(Step(("fwd", k), p, int(ch.fwd_delta[k, p]), int(ch.fwd_peak[k, p]), tail >= 0, tail))
        else:
            _fwd_nosave(c, node.start, node.end, steps, tail)


def _fwd_nosave(c: Costs, s: int, e: int, steps: list[Step], tail: int) -> None:
    ch, f = c.chain, c.full
    for k in range(s, e):
        delta = int(ch.fwd_delta[k, f]) - freed_at(c, s, k)  # NOTE [A block whose output is a view of its input]
        steps.append(Step(("fwd", k), f, delta, int(ch.fwd_peak[k, f]), tail >= 0, tail))


def _block_bwd(c: Costs, k: int, policy: int, holds: dict[int, bool], steps: list[Step]) -> None:
    """Block k's backward as in ``policy``'s run, with its input freed where the plan frees it: that run's
    previous block may have kept it (then this block's delta does not free it) where the plan's does not."""
    ch = c.chain
    if ch.bwd_delta is None:
        raise RuntimeError("a nested view's chain has its backward deltas (remat.planning._solve.chain_profile)")
    delta = int(ch.bwd_delta[k, policy])
    made = _output_of(c, k - 1)
    # a run that let go of the input in this block's forward never frees it here (NOTE [A block that holds its
    # output before one that lets go of it])
    if k > 0 and c.holds is not None and (made is None or made.freed.get(policy) != ("fwd", k)):
        in_run, in_plan = bool(c.holds[k - 1, policy]), holds.get(k - 1, False)
        delta += (int(c.out[k - 1]) if in_plan else 0) - (int(c.out[k - 1]) if in_run else 0)
    steps.append(Step(("bwd", k), policy, delta, int(ch.bwd_peak[k, policy])))


def _output_of(c: Costs, j: int) -> Shared | None:
    """Block j's output among ``c.outputs`` (None: not there)."""
    return next((o for o in c.outputs if o.receivers[0] == j), None)


def _outputs_held(c: Costs, nodes: tuple[Node, ...], walk: Walk, tail: int = -1) -> dict[int, tuple[int, int]]:
    """Outputs of a block that holds them until its backward, freed by the next block's run in its forward (NOTE
    [A block that holds its output before one that lets go of it]): per step index, (bytes added to its delta,
    least its peak reaches)."""
    out: dict[int, tuple[int, int]] = {}
    for a, b in zip(nodes, nodes[1:]):
        o = _output_of(c, a.start)
        if a.end is None and b.end is None and c.holds is not None and o is not None:
            if bool(c.holds[a.start, a.policy]) and o.freed.get(b.policy) == ("fwd", b.start):
                at = next(i for i in walk.at[("fwd", b.start)] if walk.steps[i].tail == tail)
                out[at] = (o.nbytes, o.after[b.policy] + o.nbytes)
    for node in nodes:
        if node.end is not None:
            out.update(_outputs_held(c, node.children, walk, node.end - 1))
    return out


def _bwd(c: Costs, nodes: tuple[Node, ...], holds: dict[int, bool], steps: list[Step]) -> None:
    for node in reversed(nodes):
        if node.end is None:
            _block_bwd(c, node.start, node.policy, holds, steps)
            continue
        _fwd_record(c, node.children, steps, node.end - 1)
        _block_bwd(c, node.end - 1, c.full, holds, steps)
        _bwd(c, node.children, holds, steps)


def _walk(c: Costs, tree: Tree) -> list[Step]:
    ch, nodes = c.chain, tree.nodes
    steps: list[Step] = []
    _fwd_record(c, nodes, steps, -1)
    # the backward glue before the last block's: as in the run of that block's policy (a segment's last block's
    # is full), which decides whether the glue frees its output (the DP bounds it by the most of any run)
    last = nodes[-1]
    post = c.full if last.end is not None else last.policy
    steps.append(Step(("post", -1), post, int(ch.post_delta[post]), int(ch.post_peak[post])))
    # block -> whether it keeps its own output until its backward under the plan (a segment's last block does not)
    holds = {k: own is not None and c.holds is not None and bool(c.holds[k, own.policy]) for k, own in tree.own.items()}
    _bwd(c, nodes, holds, steps)
    return steps


def _shared_fixes(c: Costs, tree: Tree, walk: Walk) -> dict[int, tuple[int, int]]:
    """Per step index: (bytes added to its delta, least its peak reaches) for ``c.shared`` (NOTE [Storages
    handed to a segment from outside])."""
    if not c.shared:
        return {}
    ends = {}  # block in a top-level segment -> where the segment lets go of its inputs
    for node, end, above in tree.segments:
        if not above:
            ends.update(dict.fromkeys(range(node.start, end), walk.first(("bwd", node.start))))
    keep = c.chain.policies.index(KEEP) if KEEP in c.chain.policies else None

    def position(place: Place | None) -> int:
        return _NEVER if place is None else walk.first(place)

    out: dict[int, list[int]] = {}
    for sh in c.shared:
        latest = min(position(place) for place in sh.freed.values())
        for r in sh.receivers:
            if r in ends:
                latest = max(latest, ends[r])
            elif (own := tree.own.get(r)) is not None and own.policy == keep and keep is not None:
                latest = max(latest, position(sh.freed.get(keep)))
            else:
                latest = max(latest, walk.first(("bwd", r)))
        at = None if latest >= _NEVER or latest < 0 else latest
        run_frees = walk.freeing(sh.freed)
        for i in run_frees:
            if i != at:  # the run freed it here (a recomputation never frees it), the plan does not
                entry = out.setdefault(i, [0, 0])
                entry[0] += sh.nbytes
                entry[1] = max(entry[1], sh.after[walk.steps[i].run] + entry[0])
        if at is not None and at not in run_frees:  # the plan frees it here, the run did not
            out.setdefault(at, [0, 0])[0] -= sh.nbytes
    return {i: (d, least) for i, (d, least) in out.items()}


def _outputs_gone(c: Costs, tree: Tree, walk: Walk) -> dict[int, tuple[int, int]]:
    """Outputs a segment let go of in its forward, or a holder keeps, that a step's run frees (NOTE [Outputs
    the parent keeps that nothing saves]): per step index, (bytes added to its delta, least its peak reaches)."""
    # block -> (from which forward, from which backward no step frees its output): a top-level segment's
    # outputs but the last are gone from its end on
    gone: dict[int, tuple[int, int]] = {}
    for node, end, above in tree.segments:
        if not above:
            # but one whose storage the last block returns a view of (NOTE [A block whose output is a view of
            # its input] in remat.planning._nested_views)
            kept = range(node.start, end - 1)
            gone.update(dict.fromkeys((k for k in kept if not hands_on(c, k, end)), (end, end)))
    out: dict[int, tuple[int, int]] = {}
    undone: set[tuple[int, int]] = set()
    for o in c.outputs:
        k = o.receivers[0]
        if k not in gone:
            continue
        fwd_from, bwd_from = gone[k]
        for i in walk.freeing(o.freed):
            step = walk.steps[i]
            kind, at = step.place
            after = kind == "post" or (kind == "bwd" and at >= bwd_from) or (kind != "bwd" and at >= fwd_from)
            if not step.again and after:
                _undo_free(out, i, o, step.run, undone)
    _inputs_held(c, tree, walk, out, undone)
    _outputs_owned(c, tree, walk, out, undone)
    return out


def _undo_free(out: dict[int, tuple[int, int]], i: int, o: Shared, run: int, undone: set[tuple[int, int]]) -> None:
    """Undo step ``i``'s free of ``o`` (once: ``undone`` holds the (step, block) pairs undone so far)."""
    if (i, o.receivers[0]) in undone:
        return
    undone.add((i, o.receivers[0]))
    d, least = out.get(i, (0, 0))
    out[i] = (d + o.nbytes, max(least, o.after[run] + d + o.nbytes))


def _outputs_owned(
    c: Costs, tree: Tree, walk: Walk, out: dict[int, tuple[int, int]], undone: set[tuple[int, int]]
) -> None:
    """A block outside segments that holds its own output until its backward, freed earlier by a step of another
    run (NOTE [An output its block holds, freed by another run])."""
    if c.holds is None:
        return
    for o in c.outputs:
        j = o.receivers[0]
        own = tree.own.get(j)
        if own is None or tree.path[j] or not c.holds[j, own.policy] or o.freed.get(own.policy) != ("bwd", j):
            continue
        begin, end = walk.first(("fwd", j)), walk.first(("bwd", j))
        nxt = tree.own.get(j + 1)
        for i in walk.freeing(o.freed):
            step = walk.steps[i]
            if not begin < i < end or step.run == own.policy:
                continue
            if step.place == ("fwd", j + 1) and nxt is not None and not tree.path[j + 1]:
                continue  # the next block's forward: _outputs_held's case
            _undo_free(out, i, o, step.run, undone)


def _inputs_held(
    c: Costs, tree: Tree, walk: Walk, out: dict[int, tuple[int, int]], undone: set[tuple[int, int]]
) -> None:
    """Block k-1's output held past a run's free of it by a segment that begins at block k, from the segment's
    forward (the depth-th forward of block k in the walk), or by block k itself from its last forward (NOTE [An
    input its block holds until its backward]); block k's backward frees it where its run did not (a block
    outside segments that holds its output: NOTE [A block that holds its output before one that lets go of it],
    ``_outputs_held``)."""
    starts: dict[int, int] = {}  # block -> the depth of the outermost segment that begins at it
    for node, _, above in tree.segments:
        starts.setdefault(node.start, len(above) + 1)
    for o in c.outputs:
        k = o.receivers[0] + 1
        own, end = tree.own.get(k), walk.at.get(("bwd", k), [-1])[0]
        forwards = [i for i in walk.at.get(("fwd", k), ()) if i < end]
        if k in starts:
            begin = forwards[starts[k] - 1]
        elif own is not None and end >= 0 and o.freed.get(own.policy) == ("bwd", k):
            begin = forwards[-1]  # NOTE [An input its block holds until its backward]
        else:
            continue
        for i in walk.freeing(o.freed):
            if begin <= i < end:
                _undo_free(out, i, o, walk.steps[i].run, undone)
        if o.freed.get(walk.steps[end].run) not in (("bwd", k), ("bwd", k - 1), None):  # None: it outlived the step
            d, least = out.get(end, (0, 0))
            out[end] = (d - o.nbytes, least)  # with block k's backward (live through all of it: safe)


def simulate(c: Costs, nodes: tuple[Node, ...]) -> int:
    """Predicted peak of the nested plan ``nodes`` (NOTE [The nested peak model])."""
    tree = Tree(nodes)
    walk = Walk(_walk(c, tree))
    fixes = _shared_fixes(c, tree, walk)
    early, peaks = early_fixes(c, tree, walk)
    for extra in (
        selective_caches(c, tree, walk),
        written_inputs(c, tree, walk),
        _outputs_gone(c, tree, walk),
        _outputs_held(c, nodes, walk),
        early,
    ):
        for i, (d, least) in extra.items():
            d0, least0 = fixes.get(i, (0, 0))
            fixes[i] = (d0 + d, max(least0 + d, least + d0))
    made = c.made_first if c.made_first is not None else np.zeros(len(c.chain.blocks), dtype=np.int64)
    # NOTE [Buffers a region keeps for its recomputation], NOTE [Buffers a segment copies and drops]
    copies = buffer_copies_at_peak(c, tree, walk) + snapshots_at_peak(c, tree, walk.steps)
    live, top = c.chain.start, c.chain.pre_peak
    for i, step in enumerate(walk.steps):
        added, least = fixes.get(i, (0, 0))
        # a recomputation runs on top of what the backward that began it has made (NOTE [What a segment's last
        # block makes before its recomputation])
        below = int(made[step.tail]) if step.tail >= 0 else 0
        top = max(top, live + below + int(copies[i]) + max(peaks.get(i, step.peak), least))
        live += step.delta + added
    return top


def extra_time(c: Costs, nodes: tuple[Node, ...]) -> float:
    """Predicted extra step time of ``nodes``: each block's policy, plus every segment's recomputation."""
    total = 0.0
    for node in nodes:
        if node.end is None:
            total += float(c.chain.extra_s[node.start, node.policy])
        else:
            total += float(c.fwd_s[node.start : node.end - 1].sum() + c.chain.extra_s[node.end - 1, c.full])
            total += extra_time(c, node.children)
    return total
