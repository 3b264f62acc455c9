"""A traced forward at run time: its segments' code, and the model's instance-level forward that runs them.

NOTE [A traced plan pickles as its cuts]
A segment's code is Python fx wrote and ``exec`` compiled, which pickle cannot save. A
segment saves where it was cut instead (its first and last op in the trace, and that op's
name), and the loaded copy's forward traces the model again at its first call, in the modes
of the plan's trace, and compiles the same ops (the trace of a forward is the same from the
same code and attributes). Where the trace now has another op at that place (the class
changed between saving and loading), it raises, naming what to call: ``remat.remove`` and
``remat.apply``.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn

from remat.core._bound import PicklesBoundMethods
from remat.core._region import REGION_BUFFER_MODULES
from remat.errors import RematError
from remat.profiling._traced_cut import Traced, traced
from remat.profiling._traced_reads import WatchedReads

__all__ = ["HOLDER", "Segment", "TracedForward"]

#: The attribute of the model that holds the segments while they are installed.
HOLDER = "remat_traced"


class Segment(nn.Module):
    """One segment: the Python fx writes for its graph, run with ``self`` this module; attributes it does not
    have come from the model (NOTE [Segments own nothing] in remat.profiling._traced)."""

    def __init__(self, model: nn.Module, trace: Traced, lo: int, hi: int, last: bool) -> None:
        super().__init__()
        object.__setattr__(self, "_remat_owner", model)
        object.__setattr__(self, "_remat_cut", (lo, hi, last, trace.nodes[hi].name))  # NOTE [A traced plan ...]
        self._remat_compile(trace)

    def _remat_compile(self, trace: Traced) -> None:
        lo, hi, last, name = self.__dict__["_remat_cut"]
        model = self.__dict__["_remat_owner"]
        if len(trace.nodes) <= hi or trace.nodes[hi].name != name:
            raise RematError(
                f"remat: the traced plan of this {type(model).__name__} was cut after op {name!r}, which its "
                "forward's trace no longer has there (its class changed since the plan was saved with the model). "
                "Call remat.remove(model), then remat.apply(model, plan) or remat.auto again."
            )
        code, consts, buffer_owners = segment_code(model, trace, lo, hi, last)
        object.__setattr__(self, "_remat_code", code)
        object.__setattr__(self, "_remat_consts", consts)
        # NOTE [Buffers a segment reads]
        object.__setattr__(self, REGION_BUFFER_MODULES, tuple(model.get_submodule(n) for n in buffer_owners))

    def forward(self, *args: Any) -> Any:
        return self.__dict__["_remat_code"](self, *args)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_remat_code"}

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


@contextmanager
def _as_traced(model: nn.Module, modes: dict[nn.Module, bool]) -> Iterator[None]:
    """``model`` inside as its plan's trace saw it: its class's forward, no segments, each module in its mode."""
    forward, holder = model.__dict__.pop("forward"), model._modules.pop(HOLDER)
    before = {m: m.training for m in model.modules()}
    try:
        for m, mode in modes.items():
            m.training = mode
        yield
    finally:
        for m, mode in before.items():
            m.training = mode
        model._modules[HOLDER], model.__dict__["forward"] = holder, forward


def segment_code(
    model: nn.Module, trace: Traced, lo: int, hi: int, last: bool
) -> tuple[Callable, dict[str, Any], tuple[str, ...]]:
    """The compiled code of the segment of ops lo+1..hi, kept on the trace (NOTE [One trace per model and mode])."""
    if (lo, hi) not in trace.code:
        carries = trace.carries
        graph = _segment_graph(trace.nodes, lo + 1, hi, carries.get(lo), None if last else carries[hi])
        trace.code[lo, hi] = _segment_code(model, trace.gm, graph)
    return trace.code[lo, hi]


class TracedForward(PicklesBoundMethods):
    """The model's instance-level ``forward`` while traced: binds the call, runs the segments as a chain.

    The trace holds the Python branches as they went when it was made, ``self.training`` ones included, the
    plain attributes it read (``self.alpha``; NOTE [The attributes a trace holds] in remat.profiling._traced_reads)
    and the grad mode; in any other mode (``model.eval()`` on a model traced for training), without gradients,
    or once an attribute it read changed, the class's forward runs instead, so the model computes what it would
    without remat (and checkpoints nothing: call ``remat.auto`` again for a plan of the changed model).
    """

    _unpickled = ("compiled",)  # NOTE [A traced plan pickles as its cuts]

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
        self.compiled = True

    def _warn_once(self, what: str | None = None) -> None:
        if self.warned:
            return
        self.warned = True
        if what is None:
            changed = ", ".join(sorted(self.reads.changed()))
            what = f"{changed} changed since the model's forward was traced for its plan, which holds what it read"
        warnings.warn(
            f"remat: {what}: the class's forward runs instead, checkpointing nothing. Call remat.auto (or "
            "remat.apply with a new plan) again to checkpoint the changed model.",
            stacklevel=3,
        )

    def _other_modes(self) -> str:
        model = self.own.__self__
        names = {m: name for name, m in model.named_modules()}
        other = [names.get(m, "?") or "the model" for m, mode in self.modes.items() if m.training != mode]
        return (
            f"{len(other)} module(s) ({', '.join(other[:3])}{', ...' if len(other) > 3 else ''}) are in another "
            "training mode than when the model's forward was traced for its plan (model.train() switches modules "
            "frozen in eval mode, BatchNorm say, back on)"
        )

    def _compiled(self) -> None:
        """The segments' code, compiled again in a copy loaded from a pickle (NOTE [A traced plan pickles as its
        cuts])."""
        if self.compiled:
            return
        model = self.own.__self__
        with _as_traced(model, self.modes):
            trace = traced(model, None)
        for segment in self.holder:
            if isinstance(segment, Segment):
                segment._remat_compile(trace)
        self.compiled = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.own(*args, **kwargs)
        if any(m.training != mode for m, mode in self.modes.items()):
            if self.own.__self__.training:  # a training step, in other modes than the plan's: say so once
                self._warn_once(self._other_modes())
            return self.own(*args, **kwargs)
        if not self.reads.unchanged():
            self._warn_once()
            return self.own(*args, **kwargs)
        self._compiled()
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = tuple(bound.arguments.values())
        carry = values[0]
        for segment in self.holder:
            carry = segment(carry, *values)
        return carry


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
