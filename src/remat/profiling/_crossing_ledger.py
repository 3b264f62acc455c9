"""What a traced step hands across blocks: the storages block calls receive, return or leave behind
(NOTE [Storages across blocks] in remat.profiling._crossing), and which segments read a block's output."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Container
from typing import Any

import torch
from torch import nn

from remat.core._caches import CacheCopies, holds_cache
from remat.core._memtrack import StorageTracker, op_tensors, storages
from remat.core._segment import hands_off
from remat.core._slots import Slots
from remat.profiling._segment import Segment, tensors_in


def call_form(args: tuple, kwargs: dict) -> tuple[tuple, list]:
    """How a block is called, beside its first argument (the previous block's output in a chain) and the tensors
    the crossings follow: the number of positional arguments, the keywords, and every other value by identity, as
    ``remat.core._segment`` compares a segment's calls (NOTE [Arguments a segment hands on]); and the values to
    keep alive until the step ends, so that no other object takes an identity meanwhile. A value holding tensors
    is not kept: that would keep its tensors, and change the step's memory (a key/value cache holds every layer's
    keys and values, which the step without it lets go of with the cache)."""
    values = (*args[1:], *(kwargs[k] for k in sorted(kwargs)))
    kept = [v for v in values if not isinstance(v, torch.Tensor) and not tensors_in(v) and not holds_cache(v)]
    identities = tuple(None if isinstance(v, torch.Tensor) else id(v) for v in values)
    return (len(args), tuple(sorted(kwargs)), identities), kept


class CrossingLedger:
    """The :class:`~remat.profiling._trace.SegmentRecorder`'s account of storages across blocks; records
    nothing without a storage tracker."""

    def __init__(
        self, tracker: StorageTracker | None, live: Callable[[], int], own: dict[str, Slots] | None = None
    ) -> None:
        """``live``: the recorder's live bytes now; ``own``: each block's parameter and buffer slots before the
        step (NOTE [Blocks called with other weights] in remat.core._segment)."""
        self._own = own or {}
        self.tracker = tracker
        self._live = live
        self.crossings: dict[tuple, dict[str, Any]] = {}
        """Storages block calls receive from outside them, by first sighting (NOTE [Storages across blocks])."""
        self._crossing_of: dict[int, tuple] = {}
        self._made: dict[int, tuple] = {}
        """Storages a block's forward made, not (yet) seen crossing: kept if they escape it."""
        self._made_count: dict[tuple[str, int], int] = {}
        self._freed_here: list[dict[str, Any]] = []
        self._after_most: list[int] = []
        """Per record in ``_freed_here``: the most live any op reached from its free to the next one's."""
        self._outputs: dict[int, str] = {}
        """Storages of block outputs still alive in the forward -> the block that returned them."""
        self.output_reads: dict[str, set[str | None]] = {}
        """Per block: the other forward segments (block, or None for the parent's code) whose ops read its
        output (NOTE [What the parent does with a block's output] in remat.planning._nested)."""
        self.call_forms: dict[str, tuple] = {}
        """Per block, how it was called: its arguments other than tensors (NOTE [Arguments a segment hands on]),
        which tensors beside its first argument, and whether with other weights than its own."""
        self._arguments: list[Any] = []
        """Those arguments, kept to the step's end: their identities stay theirs."""
        self._tensor_calls: list[list[weakref.ref]] = []
        """The tensors beside the first argument of each call with other ones than before, weakly."""

    def note_inputs(self, block: str, occurrence: int, args: tuple, kwargs: dict, module: nn.Module) -> None:
        if block not in self.call_forms:
            form, kept = call_form(args, kwargs)
            own = self._own.get(block)
            other_weights = own is not None and not own.held_still()  # a call of its own: no segment runs it
            self.call_forms[block] = (*form, self._same_tensors(args, kwargs), id(kept) if other_weights else None)
            self._arguments.append(kept)
        if self.tracker is None:
            return
        # what a checkpointed call keeps of a cache it is handed (NOTE [A cache copy keeps only its call's layers])
        copies = CacheCopies.of(args, kwargs, module.modules)
        held = copies.tensors() if copies is not None else []
        for ident in self._crossing_ids(block, occurrence, "in", (args, kwargs, held)):
            self.crossings[ident]["receivers"].append(("fwd", block, occurrence))

    def _same_tensors(self, args: tuple, kwargs: dict) -> int:
        """Which earlier call this one hands the very tensors beside its first argument (the segment's run-time
        check compares them by identity: a view the parent makes for each call, ``self.pos[:n]``, is another
        tensor each time, and its storage alone would call them alike); its number, or a new one."""
        values = (*args[1:], *(kwargs[k] for k in sorted(kwargs)))
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        for n, refs in enumerate(self._tensor_calls):
            if len(refs) == len(tensors) and all(ref() is t for ref, t in zip(refs, tensors)):
                return n
        self._tensor_calls.append([weakref.ref(t) for t in tensors])
        return len(self._tensor_calls) - 1

    def note_outputs(self, block: str, occurrence: int, output: Any, outs: list) -> None:
        """``outs``: the tensors in ``output``."""
        if len(outs) > 1 or not hands_off(output):  # NOTE [Tuple hand-offs] in remat.core._segment: the parent
            self.output_reads.setdefault(block, set()).add(None)  # may use the rest, which a segment cannot hand
        if self.tracker is None:
            return
        for ident in self._crossing_ids(block, occurrence, "out", output):
            record = self.crossings[ident]
            if record["producer"] is None and ident[2] == "out":
                record["producer"] = ("fwd", block, occurrence)
        self._outputs.update((st._cdata, block) for t in outs for st in storages(t))

    def _crossing_ids(self, block: str, occurrence: int, side: str, value: Any) -> list[tuple]:
        """Identities of the tracked storages in ``value``, by first sighting (stable across runs)."""
        tracker = self.tracker
        if tracker is None:
            raise RuntimeError("crossing storages are identified only with a storage tracker")
        keys = dict.fromkeys(st._cdata for t in tensors_in(value) for st in storages(t))
        out = []
        for j, key in enumerate(k for k in keys if k in tracker.live):
            made = self._made.pop(key, None)
            if made is not None:
                del self.crossings[made]
            ident = self._crossing_of.get(key)
            if ident is None:
                ident = self._crossing_of[key] = (block, occurrence, side, j)
                self.crossings[ident] = {
                    "nbytes": tracker.live[key],
                    "producer": None,
                    "receivers": [],
                    "freed": None,
                    "after": 0,
                }
            out.append(ident)
        return out

    def note_made(self, seg: Segment, out: Any, casts: Container[int]) -> None:
        """Every storage a block's forward makes, by order of making (stable across runs); ``casts``:
        autocast's weight casts, which have their own account."""
        tracker, block = self.tracker, seg.block
        if tracker is None or block is None:
            raise RuntimeError("made storages are noted only for a block's forward, with a storage tracker")
        for t in op_tensors(out):
            for st in storages(t):
                key = st._cdata
                seen = key in self._made or key in self._crossing_of or key in casts
                if seen or not tracker.live.get(key):
                    continue
                j = self._made_count.get((block, seg.occurrence), 0)
                self._made_count[(block, seg.occurrence)] = j + 1
                ident = self._made[key] = (block, seg.occurrence, "made", j)
                self.crossings[ident] = {
                    "nbytes": tracker.live[key],
                    "producer": seg.key,
                    "receivers": [],
                    "freed": None,
                    "after": 0,
                }

    def freed(self, key: int, current: Segment | None, recomputing: str | None) -> None:
        """Storage ``key`` was freed in segment ``current``, while block ``recomputing`` (if any) recomputed."""
        self._outputs.pop(key, None)
        ident = self._crossing_of.pop(key, None) or self._made.pop(key, None)
        if ident is None or current is None:
            return
        record = self.crossings[ident]
        if ident[2] == "made" and recomputing == ident[0]:
            # Used up by its own block's recomputation (a selective cache entry): the recomputation's
            # change in live bytes already counts it, wherever the recomputation runs.
            record["freed"] = ("bwd", ident[0], ident[1])
            return
        record["freed"] = current.key
        record["after"] = self._live() - current.start_live
        self._freed_here.append(record)
        self._after_most.append(record["after"])

    def raise_after(self, relative: int) -> None:
        # the latest free's running most only: raising every record freed so far at every op cost ops x frees
        # in a segment (minutes on a traced forward of 100,000 ops); close_segment hands each its suffix's most
        if self._after_most:
            self._after_most[-1] = max(self._after_most[-1], relative)

    def close_segment(self, end: int) -> None:
        """Each record freed in the segment gets its ``after``: the most live any op reached from its free to
        the segment's ``end`` (live bytes above its start)."""
        self.raise_after(end)
        most = None
        for record, here in zip(reversed(self._freed_here), reversed(self._after_most)):
            most = here if most is None else max(most, here)
            record["after"] = max(record["after"], most)
        self._freed_here = []
        self._after_most = []

    def note_reads(self, reader: str | None, args: Any) -> None:
        if not self._outputs:
            return
        for t in op_tensors(args):  # NOTE [Op arguments without pytree]
            for st in storages(t):
                producer = self._outputs.get(st._cdata)
                if producer is not None and producer != reader:
                    self.output_reads.setdefault(producer, set()).add(reader)
