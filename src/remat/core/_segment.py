"""Nested checkpoint regions over runs of consecutive blocks (nested plans, issue #19).

NOTE [How a run of blocks becomes one region]
A nested plan checkpoints a run of consecutive blocks as one segment: only the
segment's input is kept in forward, and in backward the segment is recomputed with
its own plan inside (blocks kept, checkpointed, or sub-segments), which is the shape
of rotor's / Griewank's optimal chain schedules. A segment needs one callable that
runs several sibling modules, and only the parent knows how it calls them. remat
does this where the parent's call is known exactly: an ``nn.Sequential`` whose
``forward`` is torch's own (each child's output is the next child's only input).
Its instance-level ``forward`` is replaced (names and ``state_dict`` keys
unchanged, as for ``remat.wrap``) by a schedule that runs the children in order and
the segments as nested ``remat.checkpoint`` regions (NOTE [Regions inside regions]
in ``remat.core.checkpoint``); the blocks' own policies stay on the blocks
(``remat.wrap``). Any other parent is refused with a RematError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from remat.core.checkpoint import checkpoint
from remat.errors import RematError

__all__ = ["schedule_segments", "unschedule", "sequential_parent"]


class _Run:
    """Runs items (child modules or nested segments) in order; one persistent object per segment,
    so that remat's checkpoint remembers what its first forward wrote (NOTE [Watching only when needed])."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __call__(self, x: Any) -> Any:
        for item in self.items:
            x = checkpoint(item, x) if isinstance(item, _Run) else item(x)
        return x


class _ScheduledForward(_Run):
    """Instance-level ``forward`` of a Sequential parent running a nested schedule."""


def sequential_parent(model: nn.Module, names: Sequence[str]) -> tuple[nn.Sequential, list[str]]:
    """The plain ``nn.Sequential`` whose direct children are ``names`` (in order), and its children's names."""
    parents = {n.rpartition(".")[0] for n in names}
    parent_name = parents.pop() if len(parents) == 1 else None
    modules = dict(model.named_modules())
    parent = modules.get(parent_name) if parent_name is not None else None
    if not isinstance(parent, nn.Sequential) or type(parent).forward is not nn.Sequential.forward:
        raise RematError(
            f"remat.apply: a nested segment over {list(names)} needs its blocks to be children of one "
            f"nn.Sequential with torch's own forward (the only parent whose calls remat knows exactly); their "
            f"parent is {type(parent).__name__ if parent is not None else 'not one module'}. Plan with "
            "remat.plan(profile, budget, nested=False) for this model."
        )
    prefix = f"{parent_name}." if parent_name else ""
    return parent, [prefix + c for c, _ in parent.named_children()]


def _items(children: list[str], modules: dict[str, nn.Module], segments: list[tuple[int, int]],
           lo: int, hi: int) -> list[Any]:
    """Children lo..hi (inclusive) as items, segments (index pairs, laminar, sorted) as nested runs."""
    items, i = [], lo
    while i <= hi:
        inner = [(a, b) for a, b in segments if a == i and b <= hi and (a, b) != (lo, hi)]
        if inner:
            a, b = max(inner, key=lambda s: s[1])
            items.append(_Run(_items(children, modules, segments, a, b)))
            i = b + 1
        else:
            items.append(modules[children[i]])
            i += 1
    return items


def schedule_segments(model: nn.Module, segments: Sequence[tuple[str, str]]) -> None:
    """Run each (first block, last block) range of ``segments`` as one checkpointed region, nested as given."""
    if not segments:
        return
    names = [n for seg in segments for n in seg]
    parent, children = sequential_parent(model, names)
    index = {n: i for i, n in enumerate(children)}
    spans = sorted(((index[a], index[b]) for a, b in segments), key=lambda s: (s[0], -s[1]))
    for (a1, b1), (a2, b2) in zip(spans, spans[1:]):
        if a2 <= b1 < b2 or a1 >= b1:
            raise RematError(f"remat.apply: nested segments must be ranges of two or more blocks that nest or do "
                             f"not overlap; got {list(segments)}.")
    modules = dict(model.named_modules())
    parent.forward = _ScheduledForward(_items(children, modules, spans, 0, len(children) - 1))


def unschedule(module: nn.Module) -> None:
    """Undo :func:`schedule_segments` on ``module`` (no-op when it has no schedule)."""
    if isinstance(module.__dict__.get("forward"), _ScheduledForward):
        del module.forward
