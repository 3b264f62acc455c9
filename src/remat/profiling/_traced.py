"""Units for a model with no blocks: its forward traced by ``torch.fx`` and cut into a chain of segments.

NOTE [Cutting a traced forward]
A model with no submodules to checkpoint (a forward that loops a function over a tensor,
seed 002's ``HeavyModel``) still keeps every intermediate for backward. remat traces its
forward with ``torch.fx.symbolic_trace`` (Python loops unroll; data-dependent control flow
and untraceable ops refuse, and the error says which) and cuts the op list after ops where
exactly one value computed so far is still needed later (the model's inputs, parameters
and buffers aside: the caller holds them anyway). That value is all that crosses the cut,
so consecutive segments are a chain: each one's output is the next one's input. Among such
points remat takes up to ``MAX_SEGMENTS`` cuts (segments of ``MIN_SEGMENT_OPS`` ops or more)
spread evenly over the bytes the ops make (fake tensors: nothing allocated), each the
smallest carry near its place. The segments become the model's units: submodules of an
``nn.Sequential`` at ``HOLDER``, called in order by an instance-level ``forward`` of the
model, so the profile, the planner (nested segments included) and ``remat.apply`` run on
them unchanged. The trace holds Python branches as they went, ``self.training`` ones too,
so it is made in the mode the profile (or the plan) is for, and another mode runs the
class's forward.

NOTE [Segments own nothing]
The segments hold no parameters, buffers or submodules of their own: every attribute the
traced code reads (``self.a``, ``self.fc1``) is looked up on the model when the segment
runs, so ``state_dict()`` keys and ``named_parameters()`` are unchanged, parameters are
shared (a ``load_state_dict`` or optimizer step is seen), and nothing is copied. A unit's
name carries its cut (``remat_traced.to_mul_199``: the segment ending at the traced op
``mul_199``), so ``remat.apply`` rebuilds the same segments from a plan with no inputs at
hand; ``remat.remove`` takes them off and the model's class ``forward`` runs again.
"""

from __future__ import annotations

import inspect
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import fx, nn

from remat.core._hf import layerdrop_settings
from remat.errors import RematError
from remat.profiling import _traced_repeat
from remat.profiling._traced_cut import (
    MAX_SEGMENTS,
    MIN_SEGMENT_OPS,
    Traced,
    TracedError,
    _choose_cuts,
    _is_value,
    _signature,
    _sizes,
    traced,
)
from remat.profiling._traced_reads import WatchedReads
from remat.profiling._traced_run import HOLDER, Segment, TracedForward

__all__ = [
    "HOLDER",
    "MAX_SEGMENTS",
    "MIN_SEGMENT_OPS",
    "install_from_names",
    "is_traced_plan",
    "traced_units",
    "uninstall",
]

_PREFIX = "to_"


# --- segments -----------------------------------------------------------------------------------


def _install(
    model: nn.Module, trace: Traced, signature: inspect.Signature, cuts: list[int], only: list[int] | None = None
) -> list[str]:
    """Install the chain cut at ``cuts`` (``only``: those segments of it, a shorter chain); their names."""
    if HOLDER in model._modules or hasattr(model, HOLDER):
        raise TracedError(f"it already has an attribute {HOLDER!r}")
    nodes = trace.nodes
    bounds = [-1, *cuts, len(nodes) - 1]
    segments: OrderedDict[str, nn.Module] = OrderedDict()
    for k, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        if only is not None and k not in only:
            continue
        last = k == len(bounds) - 2
        segments[_PREFIX + ("output" if last else nodes[hi].name)] = Segment(model, trace, lo, hi, last)
    holder = nn.Sequential(segments)
    model._modules[HOLDER] = holder
    modes = {module: trace.modes[name] for name, module in model.named_modules() if name in trace.modes}
    model.forward = TracedForward(model, holder, signature, modes, WatchedReads(model, trace.reads))
    return [f"{HOLDER}.{name}" for name in segments]


def uninstall(model: nn.Module) -> None:
    """Take the traced segments off ``model`` (no-op when it has none): its class's forward runs again."""
    if isinstance(model.__dict__.get("forward"), TracedForward):
        del model.forward
    if isinstance(model._modules.get(HOLDER), nn.Sequential):
        del model._modules[HOLDER]


def _values(signature: inspect.Signature, inputs: Any) -> tuple:
    args, kwargs = (
        ((), dict(inputs))
        if isinstance(inputs, Mapping)
        else ((inputs, {}) if isinstance(inputs, tuple) else ((inputs,), {}))
    )
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


def _cut(model: nn.Module, inputs: Any, training: bool | None, shorten: bool) -> tuple[list[str], list[str]]:
    """Install the segments to profile; their names, and those of the whole chain (NOTE [Identical segments are
    profiled once]: the first may be a shorter chain)."""
    signature = _signature(model)
    try:
        values = _values(signature, inputs)
    except TypeError as exc:
        raise TracedError(f"its forward{signature} does not take the inputs given ({exc})") from exc
    trace = traced(model, training)
    nodes, carries = trace.nodes, trace.carries
    ops = sum(_is_value(n) for n in nodes)
    if ops < 2 * MIN_SEGMENT_OPS:
        raise TracedError(
            f"its traced forward runs {ops} op(s), too few to cut into segments of "
            f"{MIN_SEGMENT_OPS} or more that could save memory"
        )
    if not carries:
        raise TracedError(
            f"its traced forward ({ops} ops) has no point where a single value carries the state "
            "from one op to the rest (two or more values are alive after every op), so it cannot "
            "be cut into a chain"
        )
    found = _sizes(trace.gm, values)
    sizes, metas = found if found is not None else (None, None)
    if sizes is not None:  # a chain passes tensors: a tuple or a number alive alone is no place to cut
        carries = {p: n for p, n in carries.items() if n in sizes}
    cuts = _choose_cuts(nodes, carries, sizes)
    only = None
    short = _traced_repeat.short_chain(nodes, carries, cuts, metas)  # NOTE [Identical segments are profiled once]
    if short is not None:
        cuts, only = short[0], short[1] if shorten else None
    return _install(model, trace, signature, cuts, only), _install_names(nodes, cuts)


def _install_names(nodes: list[fx.Node], cuts: list[int]) -> list[str]:
    """The unit names of the chain cut at ``cuts``."""
    return [f"{HOLDER}.{_PREFIX}{nodes[c].name}" for c in cuts] + [f"{HOLDER}.{_PREFIX}output"]


@contextmanager
def traced_units(
    model: nn.Module, inputs: Any, *, training: bool | None, api: str, hint: str, shorten: bool = True
) -> Iterator[tuple[list[str], list[str]]]:
    """The names of ``model``'s traced segments (traced in ``training`` mode) installed for the ``with`` body
    and taken off after it, and those of the whole chain: the installed ones are a shorter chain when its
    middle segments repeat (NOTE [Identical segments are profiled once]).

    A RematError says why when the model has no blocks and cannot be cut along its traced forward either;
    the model is then left exactly as it was.
    """
    try:
        names, full = _cut(model, inputs, training, shorten)
    except TracedError as exc:
        uninstall(model)
        raise RematError(
            f"{api}: found no blocks in {type(model).__name__} (no container with repeated children), and cannot "
            f"cut its traced forward into segments either: {exc}. Pass blocks=[...] with the module names to "
            f"consider{hint}."
        ) from exc
    try:
        yield names, full
    finally:
        uninstall(model)


def is_traced_plan(names: Iterable[str]) -> bool:
    return any(name.startswith(HOLDER + ".") for name in names)


def install_from_names(model: nn.Module, names: Iterable[str], *, training: bool | None) -> bool:
    """Rebuild the segments a plan names (NOTE [Segments own nothing]) unless ``model`` has them already;
    True when it built them."""
    names = list(names)
    holder = model._modules.get(HOLDER)
    if holder is not None:
        have = sorted(f"{HOLDER}.{n}" for n, _ in holder.named_children())
        if have == sorted(n for n in names if n.startswith(f"{HOLDER}.")):
            return False
        raise RematError(
            f"remat.apply: {type(model).__name__} runs the segments of another plan's traced forward "
            f"({len(have)} segments, this plan has {len(names)}); take them off with "
            "remat.remove(model) first."
        )
    wanted = [n.removeprefix(f"{HOLDER}.{_PREFIX}") for n in names if n.startswith(f"{HOLDER}.{_PREFIX}")]
    skips = layerdrop_settings(model)
    if skips:  # NOTE [LayerDrop and nested segments] in remat.core._hf
        raise RematError(
            f"remat.apply: the plan checkpoints segments of {type(model).__name__}'s traced forward, but the model "
            f"skips layers at random (LayerDrop: {', '.join(skips)}) and a trace would fix one draw's path. Set "
            "LayerDrop to 0, or plan with blocks=[...] naming its layers."
        )
    try:
        signature = _signature(model)
        trace = traced(model, training)
    except TracedError as exc:
        raise RematError(
            f"remat.apply: the plan checkpoints segments of {type(model).__name__}'s traced forward, "
            f"but this model cannot be traced: {exc}."
        ) from exc
    position, carries = trace.position, trace.carries
    cuts = sorted(position[w] for w in wanted if w != "output" and w in position)
    bad = [w for w in wanted if w != "output" and (w not in position or position[w] not in carries)]
    if bad or "output" not in wanted:
        raise RematError(
            f"remat.apply: the plan names traced segments {bad or names} that {type(model).__name__}'s "
            "traced forward does not end a chain at; was the plan made for another model? Profile "
            "this one with remat.profile and plan again."
        )
    _install(model, trace, signature, cuts)
    return True
