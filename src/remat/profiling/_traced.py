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
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn

from remat.core._region import REGION_BUFFER_MODULES
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

__all__ = [
    "HOLDER",
    "MAX_SEGMENTS",
    "MIN_SEGMENT_OPS",
    "install_from_names",
    "is_traced_plan",
    "traced_units",
    "uninstall",
]

#: The attribute of the model that holds the segments while they are installed.
HOLDER = "remat_traced"
_PREFIX = "to_"


class _Segment(nn.Module):
    """One segment: the Python fx writes for its graph, run with ``self`` this module; attributes it does not
    have come from the model (NOTE [Segments own nothing])."""

    def __init__(
        self, model: nn.Module, code: Callable, consts: dict[str, Any], buffer_owners: tuple[str, ...]
    ) -> None:
        super().__init__()
        object.__setattr__(self, "_remat_code", code)
        object.__setattr__(self, "_remat_owner", model)
        object.__setattr__(self, "_remat_consts", consts)
        # NOTE [Buffers a segment reads]
        object.__setattr__(self, REGION_BUFFER_MODULES, tuple(model.get_submodule(n) for n in buffer_owners))

    def forward(self, *args: Any) -> Any:
        return self.__dict__["_remat_code"](self, *args)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            owner, consts = self.__dict__.get("_remat_owner"), self.__dict__.get("_remat_consts", {})
            if name in consts:
                return consts[name]
            if owner is None:
                raise
            return getattr(owner, name)


class _TracedForward:
    """The model's instance-level ``forward`` while traced: binds the call, runs the segments as a chain.

    The trace holds the Python branches as they went when it was made, ``self.training`` ones included, the
    plain attributes it read (``self.alpha``; NOTE [The attributes a trace holds] in remat.profiling._traced_reads)
    and the grad mode; in any other mode (``model.eval()`` on a model traced for training), without gradients,
    or once an attribute it read changed, the class's forward runs instead, so the model computes what it would
    without remat (and checkpoints nothing: call ``remat.auto`` again for a plan of the changed model).
    """

    def __init__(
        self,
        model: nn.Module,
        holder: nn.Sequential,
        signature: inspect.Signature,
        modes: dict[nn.Module, bool],
        reads: WatchedReads,
    ) -> None:
        self.holder = holder
        self.signature = signature
        self.modes = modes
        self.own = type(model).forward.__get__(model)
        self.reads = reads
        self.warned = False

    def _warn_once(self) -> None:
        if self.warned:
            return
        self.warned = True
        changed = sorted(self.reads.changed())
        warnings.warn(
            f"remat: {', '.join(changed)} changed since the model's forward was traced for its plan, which holds "
            "the values it read: the class's forward runs instead, checkpointing nothing. Call remat.auto (or "
            "remat.apply with a new plan) again to checkpoint the changed model.",
            stacklevel=3,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or any(m.training != mode for m, mode in self.modes.items()):
            return self.own(*args, **kwargs)
        if not self.reads.unchanged():
            self._warn_once()
            return self.own(*args, **kwargs)
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = tuple(bound.arguments.values())
        carry = values[0]
        for segment in self.holder:
            carry = segment(carry, *values)
        return carry


# --- segments -----------------------------------------------------------------------------------


def _segment_graph(
    nodes: list[fx.Node], lo: int, hi: int, carry_in: fx.Node | None, carry_out: fx.Node | None
) -> fx.Graph:
    """Ops lo..hi (inclusive) as a graph of (carry, *the model's inputs) -> carry (or the model's output)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    carry = graph.placeholder("remat_carry")
    if carry_in is not None:
        env[carry_in] = carry
    for node in nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env and n.op == "get_attr":
            env[n] = graph.get_attr(str(n.target))  # a get_attr node's target is the attribute's qualified name
        return env[n]

    for node in nodes[lo : hi + 1]:
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "output":
            graph.output(fx.map_arg(node.args[0], lookup))
            return graph
        env[node] = graph.node_copy(node, lookup)
    if carry_out is None:
        raise RuntimeError("a segment that does not end the forward hands a carry on (remat.profiling._traced_cut)")
    graph.output(lookup(carry_out))
    return graph


def _segment_code(
    model: nn.Module, gm: fx.GraphModule, graph: fx.Graph
) -> tuple[Callable, dict[str, Any], tuple[str, ...]]:
    """The Python fx writes for ``graph``, compiled, the trace's constants it reads, and the modules whose buffers it
    reads (NOTE [Buffers a segment reads])."""
    consts = {}
    owners: dict[str, None] = {}
    buffers = dict(model.named_buffers())
    for node in graph.nodes:  # tensors fx made from constants in the forward live on the trace, not the model
        if node.op == "get_attr" and not _has_attr(model, node.target):
            head = node.target.split(".")[0]
            consts[head] = getattr(gm, head)
        elif node.op == "get_attr" and node.target in buffers:
            owners[node.target.rpartition(".")[0]] = None
    code = graph.python_code(root_module="self")
    scope = dict(code.globals)
    exec(compile(code.src, "<remat traced segment>", "exec"), scope)  # noqa: S102 (fx's own code)
    return scope["forward"], consts, tuple(owners)


# NOTE [Buffers a segment reads]
# A traced segment runs its modules' code inlined: BatchNorm's ``F.batch_norm`` on ``self.bn.running_mean``, a
# subclass's ``num_batches_tracked.add_(1)``. No module is entered, so the checkpoint's region, which watches the
# buffers of the modules a forward enters (NOTE in remat.core._region), would see none, and a recomputation would
# update the statistics a second time. Each segment names the modules whose buffers its code reads
# (``REGION_BUFFER_MODULES`` in remat.core._region), and the region watches them from the start of its forward.


def _has_attr(model: nn.Module, target: str) -> bool:
    obj: Any = model
    for part in target.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _install(
    model: nn.Module, trace: Traced, signature: inspect.Signature, cuts: list[int], only: list[int] | None = None
) -> list[str]:
    """Install the chain cut at ``cuts`` (``only``: those segments of it, a shorter chain); their names."""
    if HOLDER in model._modules or hasattr(model, HOLDER):
        raise TracedError(f"it already has an attribute {HOLDER!r}")
    nodes, carries = trace.nodes, trace.carries
    bounds = [-1, *cuts, len(nodes) - 1]
    segments: OrderedDict[str, nn.Module] = OrderedDict()
    for k, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        if only is not None and k not in only:
            continue
        last = k == len(bounds) - 2
        if (lo, hi) not in trace.code:  # NOTE [One trace per model and mode]
            graph = _segment_graph(nodes, lo + 1, hi, carries.get(lo), None if last else carries[hi])
            trace.code[lo, hi] = _segment_code(model, trace.gm, graph)
        segments[_PREFIX + ("output" if last else nodes[hi].name)] = _Segment(model, *trace.code[lo, hi])
    holder = nn.Sequential(segments)
    model._modules[HOLDER] = holder
    modes = {module: trace.modes[name] for name, module in model.named_modules() if name in trace.modes}
    model.forward = _TracedForward(model, holder, signature, modes, WatchedReads(model, trace.reads))
    return [f"{HOLDER}.{name}" for name in segments]


def uninstall(model: nn.Module) -> None:
    """Take the traced segments off ``model`` (no-op when it has none): its class's forward runs again."""
    if isinstance(model.__dict__.get("forward"), _TracedForward):
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
