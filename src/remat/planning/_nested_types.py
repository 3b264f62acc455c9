"""The data of the nested walk (``remat.planning._nested_walk``): the plan's nodes, the chain's costs, the walk's
steps; NOTEs named without a module are in ``remat.planning._nested``."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from remat.planning._solve import Chain

Place = tuple[str, int]
"""Where in the step: ("pre", -1), ("fwd", k) (block k's forward and the glue after it), ("post", -1) (the
backward glue before the last block's backward), ("bwd", k)."""


@dataclass(frozen=True)
class Node:
    """A block under a policy (``end`` is None) or a segment of blocks start..end-1 with ``children``."""

    start: int
    policy: int = -1
    end: int | None = None
    children: tuple[Node, ...] = ()


class Tree:
    """A nested plan's nodes, walked once: every segment with those around it, and where each block sits."""

    def __init__(self, nodes: tuple[Node, ...]) -> None:
        self.nodes = nodes
        self.segments: list[tuple[Node, int, tuple[Node, ...]]] = []
        """Every segment at any depth, outer before inner: (its node, its ``end``, the segments that hold it,
        outermost first)."""
        self.path: dict[int, tuple[Node, ...]] = {}
        """Block -> the segments that hold it, outermost first."""
        self.own: dict[int, Node | None] = {}
        """Block -> its own node (a block under a policy); None for a segment's last block, which runs ``full``."""
        self._visit(nodes, ())

    def _visit(self, nodes: tuple[Node, ...], above: tuple[Node, ...]) -> None:
        for node in nodes:
            if node.end is None:
                self.path[node.start], self.own[node.start] = above, node
                continue
            self.segments.append((node, node.end, above))
            inside = (*above, node)
            self.path[node.end - 1], self.own[node.end - 1] = inside, None  # its children end before it
            self._visit(node.children, inside)


@dataclass(frozen=True)
class Shared:
    """A storage made outside the blocks and handed to some of them (NOTE [Storages handed to a segment from
    outside] in remat.planning._nested_walk)."""

    nbytes: int
    receivers: tuple[int, ...]
    """Chain indices of the blocks that receive it."""
    freed: dict[int, Place | None]
    """Per policy index: where that policy's run freed it (None: it outlived the step)."""
    after: dict[int, int]
    """Per policy index: most live bytes above that place's start after the free, in that run."""


@dataclass(frozen=True)
class Early:
    """A block the profile saw recomputed outside its own backward (NOTE [A block whose backward begins early] in
    remat.planning._nested_early)."""

    block: int
    at: dict[int, Place]
    """Per policy index whose run recomputed the block: the place of the step it ran in."""
    kept: dict[int, int]
    """Per policy index: the bytes it left live at the end of that step (``Recompute.kept``)."""
    excess: dict[int, int]
    """Per policy index: the most live bytes during it above its start."""
    swap: dict[tuple[int, int], int]
    """(q, m): how much higher the hosting step's one segment peaks in q's run with m's recomputation in place of
    q's (``Recompute.swap``; negative: lower); empty where the profile has no such table."""


@dataclass(frozen=True)
class Costs:
    """The chain plus what nested plans need: output bytes and forward time per block."""

    chain: Chain
    out: np.ndarray
    fwd_s: np.ndarray
    full: int
    holds: np.ndarray | None = None
    """[n, P]: in the run of that policy, the block keeps its own output until its backward (a ReLU's)."""
    inside: np.ndarray | None = None
    """[P]: a block may take that policy inside a segment (NOTE [Selective caches inside a segment]); None: any."""
    chained: np.ndarray | None = None
    """[n]: only the next block reads the block's output (NOTE [What the parent does with a block's output]), so it
    may be inside a segment; None: every one."""
    shared: tuple[Shared, ...] = field(default=())
    """Storages the parent hands to blocks whose holders depend on the plan."""
    writes: np.ndarray | None = None
    """[n]: the block writes its input in place (NOTE [Inputs written in place inside a segment]); None: none."""
    same_args: np.ndarray | None = None
    """[n]: the block receives the same tensors from the parent as the block before it, so both may be in one
    segment (NOTE [Arguments a segment hands on] in remat.planning._nested_costs); None: every one."""
    outputs: tuple[Shared, ...] = field(default=())
    """The blocks' outputs, each run's free placed in the walk; ``receivers``: the block that made it."""
    first_input: int = 0
    """Bytes of the first block's input, made outside the chain."""
    made_first: np.ndarray | None = None
    """[n]: live bytes block k's backward under ``full`` has made when its recomputation begins (NOTE [What a
    segment's last block makes before its recomputation] in remat.planning._nested_walk); None: none."""
    copies: np.ndarray | None = None
    """[n, P]: bytes of the copies of buffers block k's region keeps from its forward to its backward in the run of
    that policy (NOTE [Buffers a region keeps for its recomputation] in remat.planning._nested_copies); None: not
    recorded."""
    snapshots: np.ndarray | None = None
    """[n]: bytes of the small buffers block k's forward reads and does not write, which a segment's region copies
    until its forward ends (NOTE [Buffers a segment copies and drops] in remat.planning._nested_copies); None: none
    recorded."""
    views: np.ndarray | None = None
    """[n]: block k's output shares storage with its input (NOTE [A block whose output is a view of its input] in
    remat.planning._nested_views); None: no block's."""
    without_grad: np.ndarray | None = None
    """[n]: every forward of block k ran with gradients off: it is in no segment (NOTE [A block run without
    gradients is kept] in remat.planning._solve); None: no block's."""
    early: tuple[Early, ...] = field(default=())
    """Blocks recomputed outside their own backward, with where each run did it."""


@dataclass(frozen=True)
class Step:
    """One step of the walk: a block's forward or backward (or the glue) taken from one uniform run."""

    place: Place
    run: int
    """The policy index of the uniform run the step is taken from."""
    delta: int
    peak: int
    again: bool = False
    """A recomputation (a segment's forward rerun in its backward)."""
    tail: int = -1
    """In a recomputation: the last block of the segment recomputed, whose backward began it (NOTE [What a
    segment's last block makes before its recomputation] in remat.planning._nested_walk); else -1."""


class Walk:
    """A nested plan's steps with the positions of each place's steps, found once: every correction of the walk
    looks up a block's forwards and backward, and scanning the steps per block made the walk quadratic."""

    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps
        self.at: dict[Place, list[int]] = {}
        """Place -> the positions of its steps, in order (a block's forward: the first, then recomputations)."""
        for i, step in enumerate(steps):
            self.at.setdefault(step.place, []).append(i)

    def first(self, place: Place) -> int:
        """The position of ``place``'s first step that is no recomputation; -1 if none."""
        return next((i for i in self.at.get(place, ()) if not self.steps[i].again), -1)

    def freeing(self, freed: dict[int, Place | None]) -> list[int]:
        """Positions, in order, of the steps whose run frees a storage there (``freed``: run -> where it frees it)."""
        places = {place for place in freed.values() if place is not None}
        found = (i for place in places for i in self.at.get(place, ()))
        return sorted(i for i in found if freed.get(self.steps[i].run) == self.steps[i].place)
