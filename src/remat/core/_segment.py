"""Nested checkpoint regions over runs of consecutive blocks (nested plans).

NOTE [How a run of blocks becomes one region]
A nested plan checkpoints a run of consecutive blocks as one segment: only the
segment's input is kept in forward, and in backward the segment is recomputed with
its own plan inside (blocks kept, checkpointed, or sub-segments), which is the shape
of rotor's / Griewank's optimal chain schedules. A segment needs one callable that
runs several sibling blocks, but the parent calls them one by one (``nn.Sequential``,
or a ``ModuleList`` looped over in the parent's forward, as Hugging Face models do).
So the segment's first block gets an instance-level ``forward`` (names and
``state_dict`` keys unchanged, as for ``remat.wrap``) that runs the whole segment as
one ``remat.checkpoint`` region, nested ones inside (NOTE [Regions inside regions] in
``remat.core.checkpoint``), calling every block with the first block's other
arguments and feeding each output to the next; the segment's other blocks return,
when the parent calls them, the segment's output they are given. That holds only
for a chain: each such call must receive exactly that output and the same other
arguments, or it raises a RematError (before anything else uses the result). A later
block that raises on the first block's arguments (it takes others: a mask only some
blocks get) raises a RematError too, naming it, with its own exception as the cause;
the planner keeps blocks that receive different tensors out of one segment
(``Costs.same_args`` in remat.planning._nested).
Forward hooks of those blocks see the segment's output; their submodules' hooks run
as usual.

NOTE [Reads the segment cannot see]
The checks above see only the calls of the segment's blocks. A parent that also reads a
block's output elsewhere (a skip added two blocks later, ``hidden.append(x)`` summed
into a loss) reads, from the segment, the segment's output in its place: a wrong loss
and wrong gradients, and nothing at run time sees a read. The profile's run without
checkpointing does (``Profile.unchained``); plans carry it (``Plan.unchained``), and
``schedule_segments`` refuses a segment holding such a block before it installs
anything, a hand-made segment as much as one the planner (which avoids them) made.

NOTE [Tuple hand-offs]
Hugging Face blocks of transformers 4.x return a tuple whose first element is the
hidden state, the rest ``None`` unless attentions or caches were asked for; the
parent hands ``out[0]`` to the next block. Such a tuple is a chain link too: the
next block gets its first element, and the later blocks, called with that element,
return the segment's output in the same shape (``(hidden, None, ...)``). A tuple
with another tensor in it (attention weights, T5's position bias) is not: remat
cannot tell whether the parent uses that tensor, so the segment refuses to run.

NOTE [Blocks called with other weights]
A parent may call its blocks through ``torch.func.functional_call`` with weights of its own
for the call (scaled, averaged, meta-learned). A segment runs its later blocks inside the
first block's call, before the parent puts those weights in for them, so it computed with
the blocks' own: other gradients. The segment records its later blocks' parameter and buffer
slots as it runs them (``remat.core._slots``), and a later block whose slots hold other
tensors when the parent calls it refuses to run as part of it; the profile keeps such blocks
out of segments (``remat.profiling._crossing_ledger``).

NOTE [Buffers of a block a segment runs]
A region watches the buffers of every module entered in its forward, seen by a global
forward pre-hook (NOTE [What recomputation must not repeat] in remat.core._region).
A segment calls its blocks' forwards directly (their module calls are the head and
skips above), so a block that owns buffers itself (a lone BatchNorm of a flat
``Sequential``) would not be entered: its running statistics were updated again by
every recomputation. The segment enters such a block for the global pre-hooks before
running it; blocks whose buffers sit in submodules are entered by those calls.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from remat.core._bound import PicklesBoundMethods
from remat.core._hf import layerdrop_settings
from remat.core._region import REGION_BUFFER_MODULES
from remat.core._slots import Slots
from remat.core.checkpoint import checkpoint
from remat.errors import RematError

__all__ = ["NotAChain", "schedule_segments", "unschedule"]


class NotAChain(RematError):
    """The parent does not call a nested segment's blocks as a chain; the segment cannot run as one region."""


def _version(value: Any) -> int | None:
    return value._version if isinstance(value, torch.Tensor) else None


def _same(value: Any, seen: Any, version: int | None) -> bool:
    return value is seen and _version(value) == version


class _Held:
    """A value that is not a tensor, held as it is beside the weak references to tensors."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self) -> Any:
        return self.value


def _weakly(value: Any) -> Callable[[], Any]:
    """A value by weak reference where it takes one: the check of the next call needs its identity, not to keep
    it alive past the step (an encoder's states handed to every block stayed alive until the next step's segment
    ran; a key/value cache, every layer's keys and values). A value gone by then is not the one the call gets."""
    try:
        return weakref.ref(value)
    except TypeError:  # None, numbers, strings, tuples: nothing a step frees
        return _Held(value)


def _global_pre_hooks() -> dict:
    return getattr(nn.modules.module, "_global_forward_pre_hooks", {})


class _Entered(PicklesBoundMethods):
    """A block that owns buffers, run inside a segment as a call of it is seen (NOTE [Buffers of a block a
    segment runs])."""

    def __init__(self, module: nn.Module, compute: Any) -> None:
        self.module = module
        self.compute = compute

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for hook in tuple(_global_pre_hooks().values()):
            hook(self.module, args)
        return self.compute(*args, **kwargs)


class _Guest(PicklesBoundMethods):
    """A segment's block after its first, run with the first block's other arguments (NOTE [How a run of
    blocks becomes one region]); where it raises on them, the parent most likely calls it with others."""

    def __init__(self, compute: Any, name: str, names: list[str]) -> None:
        self.compute = compute
        self.name = name
        self.names = names

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.compute(*args, **kwargs)
        except (RematError, torch.OutOfMemoryError):
            raise
        except (TypeError, ValueError, AttributeError, RuntimeError) as exc:  # not torch's own control flow
            given = len(args) - 1 + len(kwargs)
            raise NotAChain(
                f"remat.apply: block {self.name} sits in a nested segment {self.names[0]}..{self.names[-1]}, which "
                f"runs every block with the previous block's output and {self.names[0]}'s other arguments "
                f"({given} of them), and it raised {type(exc).__name__} on them: {exc}. If the parent calls "
                f"{self.name} with other arguments than {self.names[0]}, the blocks are not a chain remat can run "
                "as one region. Plan with remat.plan(profile, budget, nested=False) for this model (this error's "
                "__cause__ has the block's own traceback)."
            ) from exc


def _block_item(module: nn.Module, name: str, names: list[str]) -> Any:
    compute = _compute(module)
    # a traced segment owns no buffers but updates the model's (NOTE [Buffers a segment reads] in _traced)
    writes = any(b is not None for b in module._buffers.values()) or module.__dict__.get(REGION_BUFFER_MODULES)
    item = _Entered(module, compute) if writes else compute
    return item if name == names[0] else _Guest(item, name, names)


def _compute(module: nn.Module) -> Any:
    """What the block computes: its forward under its own policy (``remat.wrap``) or its class's forward."""
    current = module.__dict__.get("forward")
    if isinstance(current, (_Head, _Skip)):
        return current.own
    return current if current is not None else type(module).forward.__get__(module)


class _Run(PicklesBoundMethods):
    """Runs items (blocks, nested segments) as a chain; one persistent object per segment, so that remat's
    checkpoint remembers what its first forward wrote (NOTE [Watching only when needed])."""

    def __init__(self, items: list[Any], blocks: list[nn.Module]) -> None:
        self.items = items
        self.blocks = blocks

    def __call__(self, x: Any, *rest: Any, **kwargs: Any) -> Any:
        for item in self.items[:-1]:
            out = checkpoint(item, x, *rest, **kwargs) if isinstance(item, _Run) else item(x, *rest, **kwargs)
            x, _ = _hand_off(out)
        last = self.items[-1]
        return checkpoint(last, x, *rest, **kwargs) if isinstance(last, _Run) else last(x, *rest, **kwargs)

    def modules_run(self) -> list[nn.Module]:
        """Every module the segment's blocks hold (NOTE [A cache copy keeps only its call's layers])."""
        return [m for block in self.blocks for m in block.modules()]


def hands_off(out: Any) -> bool:
    """A tensor, or a tuple of one tensor and Nones: an output a segment hands on (NOTE [Tuple hand-offs]); the
    profile keeps a block returning anything else out of segments (``remat.profiling._crossing_ledger``)."""
    if isinstance(out, torch.Tensor):
        return True
    return type(out) is tuple and bool(out) and isinstance(out[0], torch.Tensor) and all(v is None for v in out[1:])


def _hand_off(out: Any) -> tuple[torch.Tensor, tuple | None]:
    """(what the next block of the chain gets, the rest of a tuple output or None); NOTE [Tuple hand-offs]."""
    if isinstance(out, torch.Tensor):
        return out, None
    if hands_off(out):
        return out[0], out[1:]
    raise RematError(
        f"remat.apply: a block inside a nested segment returned a {type(out).__name__}"
        f"{f' of {len(out)}' if isinstance(out, tuple) else ''}, not a tensor (or a tuple of one tensor and "
        "Nones); remat runs a segment only where each block's output is the next block's input (a chain), "
        "and cannot tell what the parent takes from it (T5's blocks return the hidden states with "
        "the position bias). Plan with remat.plan(profile, budget, nested=False) for this model."
    )


class _Head(PicklesBoundMethods):
    """Instance-level ``forward`` of a segment's first block: runs the segment as one region."""

    _unpickled = ("last", "slots")  # the last call's (weak references, slots), made again by the next call

    def __init__(self, module: nn.Module, run: _Run, names: list[str]) -> None:
        self.own = _compute(module)
        self.previous = module.__dict__.get("forward")
        self.run = run
        self.names = names
        self.last: tuple[Any, int | None, tuple, dict, list[int | None]] | None = None
        self.tail: tuple | None = None
        """The Nones after the hidden state when the blocks return tuples (NOTE [Tuple hand-offs])."""
        self.slots: dict[str, Slots] = {}
        """The later blocks' parameters and buffers as the segment ran them (NOTE [Blocks called with other
        weights])."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.slots = {name: Slots(block) for name, block in zip(self.names[1:], self.run.blocks[1:])}
        if not args:
            raise NotAChain(
                f"remat.apply: the parent calls block {self.names[0]} with keyword arguments only, so remat cannot "
                f"tell which one is the previous block's output, and cannot run {self.names[0]}..{self.names[-1]} "
                "as one nested segment. Plan with remat.plan(profile, budget, nested=False) for this model."
            )
        x, rest = args[0], args[1:]
        out = checkpoint(self.run, x, *rest, **kwargs)
        handed, self.tail = _hand_off(out)
        self.last = (
            weakref.ref(handed),
            _version(handed),
            tuple(map(_weakly, rest)),
            {k: _weakly(v) for k, v in kwargs.items()},
            [_version(v) for v in (*rest, *kwargs.values())],
        )
        return out


class _Skip(PicklesBoundMethods):
    """Instance-level ``forward`` of a segment's later blocks: their work was done by the segment's head."""

    def __init__(self, module: nn.Module, head: _Head, name: str) -> None:
        self.own = _compute(module)
        self.previous = module.__dict__.get("forward")
        self.head = head
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ran = self.head.slots.get(self.name)
        if ran is not None and not ran.held_still():  # NOTE [Blocks called with other weights]
            raise NotAChain(
                f"remat.apply: block {self.name} sits in a nested segment {self.head.names[0]}..{self.head.names[-1]} "
                "but its parent calls it with other parameters or buffers than its own (torch.func.functional_call "
                "puts them in for the call), which the segment, running it inside the first block's call, did not "
                "see. Plan with remat.plan(profile, budget, nested=False) for this model."
            )
        if not self._is_chained(args, kwargs):
            raise NotAChain(
                f"remat.apply: block {self.name} sits in a nested segment {self.head.names[0]}..{self.head.names[-1]} "
                "but its parent did not call it with the previous block's output and the same other arguments, "
                "unchanged (NOTE [Unchanged means the same version]: no in-place write between the blocks), "
                "so the blocks are not a chain remat can run as one region. Plan with "
                "remat.plan(profile, budget, nested=False) for this model."
            )
        return args[0] if self.head.tail is None else (args[0], *self.head.tail)

    def _is_chained(self, args: tuple, kwargs: dict) -> bool:
        last = self.head.last
        if last is None or not args:
            return False
        ref, version, rest, their_kwargs, versions = last
        if not _same(args[0], ref(), version) or len(args) - 1 != len(rest) or kwargs.keys() != their_kwargs.keys():
            return False
        given = (*args[1:], *(kwargs[k] for k in their_kwargs))
        seen = (*(r() for r in rest), *(r() for r in their_kwargs.values()))
        return all(_same(a, b, v) for a, b, v in zip(given, seen, versions))


def _items(
    modules: list[nn.Module], spans: list[tuple[int, int]], lo: int, hi: int, order: Sequence[str], names: list[str]
) -> list[Any]:
    """Blocks lo..hi (inclusive) as items; spans (laminar, sorted by start then longest first) as nested runs;
    ``names``: the blocks of the outermost segment."""
    items, i = [], lo
    while i <= hi:
        inner = [(a, b) for a, b in spans if a == i and b <= hi and (a, b) != (lo, hi)]
        if inner:
            a, b = inner[0]
            items.append(_Run(_items(modules, spans, a, b, order, names), modules[a : b + 1]))
            i = b + 1
        else:
            items.append(_block_item(modules[i], order[i], names))
            i += 1
    return items


def schedule_segments(
    model: nn.Module, order: Sequence[str], segments: Sequence[tuple[str, str]], unchained: Sequence[str] = ()
) -> None:
    """Run each (first block, last block) range of ``segments`` (blocks in chain ``order``) as one region;
    ``unchained``: blocks whose output the profiled forward read outside the next block (NOTE [Reads the
    segment cannot see])."""
    if not segments:
        return
    index = {n: i for i, n in enumerate(order)}
    unknown = sorted({n for seg in segments for n in seg} - set(index))
    if unknown:
        raise RematError(f"remat.apply: segments name {unknown}, which are not blocks of the plan.")
    spans = sorted(((index[a], index[b]) for a, b in segments), key=lambda s: (s[0], -s[1]))
    for (a1, b1), (a2, b2) in zip(spans, spans[1:]):
        if a1 >= b1 or a2 >= b2 or a2 <= b1 < b2:
            raise RematError(
                f"remat.apply: nested segments must be ranges of two or more blocks that nest or do "
                f"not overlap; got {list(segments)}."
            )
    _refuse_unchained(order, spans, set(unchained))
    _refuse_layerdrop(model)
    named = dict(model.named_modules())
    modules = [named[n] for n in order]
    outer = [s for s in spans if not any(o != s and o[0] <= s[0] and s[1] <= o[1] for o in spans)]
    heads = []
    for a, b in outer:
        names = list(order[a : b + 1])
        head = _Head(modules[a], _Run(_items(modules, spans, a, b, order, names), modules[a : b + 1]), names)
        heads.append((modules[a], head, [(modules[k], _Skip(modules[k], head, order[k])) for k in range(a + 1, b + 1)]))
    for module, head, skips in heads:  # everything built: now install, all at once
        module.forward = head
        for skipped, skip in skips:
            skipped.forward = skip


def _refuse_unchained(order: Sequence[str], spans: list[tuple[int, int]], unchained: set[str]) -> None:
    for a, b in spans:
        read = [n for n in order[a : b + 1] if n in unchained]
        if read:
            raise NotAChain(
                f"remat.apply: the nested segment {order[a]}..{order[b]} holds {read}, whose output the profiled "
                "forward read outside the next block (a skip connection, a list of hidden states, a write in "
                "place); a segment hands the parent its own output for each of its blocks, so those reads "
                "would get wrong values (NOTE [Reads the segment cannot see]). Plan with remat.plan(profile, "
                "budget, nested=False) for this model, or leave those blocks out of the plan's segments."
            )


def _refuse_layerdrop(model: nn.Module) -> None:
    skips = layerdrop_settings(model)
    if skips:
        raise NotAChain(
            f"remat.apply: {type(model).__name__} skips layers at random in training (LayerDrop: {', '.join(skips)}), "
            "and a nested segment runs its blocks as one region: it cannot skip one, so the step would compute "
            "another function (NOTE [LayerDrop and nested segments] in remat.core._hf). Plan one level deep "
            "(remat.plan(profile, budget, nested=False)), or set LayerDrop to 0 for nested plans."
        )


def unschedule(module: nn.Module) -> None:
    """Undo :func:`schedule_segments` on ``module`` (no-op when it is not in a segment)."""
    current = module.__dict__.get("forward")
    if isinstance(current, (_Head, _Skip)):
        if current.previous is None:
            del module.forward
        else:
            module.forward = current.previous
