"""Tracing a model's forward with ``torch.fx`` and finding where to cut it (NOTE [Cutting a traced forward]
in ``remat.profiling._traced``), the trace kept per model and mode (NOTE [One trace per model and mode])."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from remat.core._step import set_training
from remat.core._user_errors import first_line
from remat.errors import RematError
from remat.profiling._traced_reads import WatchedReads, plain_attributes, put_back_attributes, reads_recorded

#: Most segments a traced forward is cut into (the nested planner's chain grows with it).
MAX_SEGMENTS = 32
#: Fewest ops a segment is cut to hold, where the forward has enough: a segment of one op keeps in
#: backward what checkpointing it would keep (its input), so it saves nothing.
MIN_SEGMENT_OPS = 4


class TracedError(RematError):
    """A model's forward cannot be traced, or its trace cannot be cut into a chain."""


# --- tracing --------------------------------------------------------------------------------------


def _signature(model: nn.Module) -> inspect.Signature:
    signature = inspect.signature(type(model).forward.__get__(model))
    kinds = {p.kind for p in signature.parameters.values()}
    if not signature.parameters or kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        raise TracedError(
            "its forward takes no named inputs, or takes *args or **kwargs, which a traced forward cannot bind"
        )
    return signature


def _trace(
    model: nn.Module, training: bool | None
) -> tuple[fx.GraphModule, dict[nn.Module, bool], dict[tuple[nn.Module, str], Any]]:
    """The fx trace of ``model``'s class forward in ``training`` mode (None: its modes now), those modes, and the
    plain attributes it read (NOTE [The attributes a trace holds] in remat.profiling._traced_reads)."""
    if "forward" in model.__dict__:
        raise TracedError("it has an instance-level forward (already wrapped or patched), not its class's")
    before = {m: m.training for m in model.modules()}
    try:
        set_training(model, training)  # NOTE [Training mode keeps the modules the user froze]
        modes = {m: m.training for m in model.modules()}
        reads: dict[tuple[nn.Module, str], Any] = {}
        return _traced_with_buffers(model, reads), modes, reads
    except TracedError:
        raise
    except fx.proxy.TraceError as exc:
        raise TracedError(
            f"its forward has data-dependent control flow (torch.fx: {first_line(exc)}); "
            "an `if` or loop on a tensor's value cannot be traced (torch.where or torch.cond can "
            "express it)"
        ) from exc
    except Exception as exc:  # whatever fx cannot run is the reason to tell
        raise TracedError(
            f"torch.fx cannot trace its forward ({type(exc).__name__}: {first_line(exc)}); "
            "an untraceable op or Python on tensor values"
        ) from exc
    finally:
        for m, mode in before.items():
            m.training = mode


# NOTE [What a trace must not miss]
# torch.fx records the functions a forward calls on proxies, nothing of the state they run in. A
# ``torch.no_grad()``, ``set_grad_enabled(False)``, ``inference_mode`` or ``torch.autocast`` region in the
# forward runs at trace time and leaves no node: the recording runs those ops with gradients and without
# autocast (a statistic under no_grad got a gradient, 22% of a layer's). An autograd Function is traced
# through into its ``forward``, and its own ``backward`` is lost (a straight-through estimator's
# ``round`` gave its layers gradients of 0). So the tracer runs with gradients on and autocast off, refuses
# a node made in any other state (the forward is not traced; its module units stand, or it gets no plan),
# and records ``Function.apply`` as one call, its backward the Function's own. So too for what a forward
# does to state outside its tensors: setting a generator's state (``fork_rng``), rebinding a buffer
# (``self.steps += 1``, which leaves a Proxy where the buffer was), changing a plain attribute (a Python
# counter): each is put back and refused. A trace bakes in plain attributes it reads (``self.alpha``) and
# the grad mode; the installed forward runs the class's own where either differs (``_TracedForward``; NOTE
# [The attributes a trace holds] in remat.profiling._traced_reads).
_STATE_CHANGES = "turns gradients off or autocast on in a region (torch.no_grad, set_grad_enabled, autocast)"
_RNG_CHANGES = "sets a random generator's state (torch.random.fork_rng, manual_seed)"


def _grad_and_autocast() -> tuple[Any, ...]:
    devices = ("cpu", "cuda")
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        *(torch.is_autocast_enabled(d) for d in devices),
    )


class _BufferTracer(fx.Tracer):
    """fx's tracer with buffers as graph values: by default a buffer a forward reads through ``self`` is the real
    tensor while tracing, so a write to it (BatchNorm's ``num_batches_tracked.add_(1)`` in a subclass fx traces
    through, as timm's ``BatchNormAct2d``) runs once on the model at trace time and is missing from the trace. It
    also refuses what a trace would miss (NOTE [What a trace must not miss])."""

    proxy_buffer_attributes = True

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        with torch.enable_grad(), _autocast_off(), _functions_as_calls(self), _rng_state_refused():
            self._state = _grad_and_autocast()
            return super().trace(root, concrete_args)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        if _grad_and_autocast() != self._state:
            raise TracedError(f"its forward {_STATE_CHANGES}, which torch.fx does not record")
        return super().create_node(*args, **kwargs)


_RNG_SETTERS = (
    (torch, "set_rng_state"),
    (torch, "manual_seed"),
    (torch, "seed"),
    (torch.random, "set_rng_state"),
    (torch.random, "manual_seed"),
    (torch.random, "seed"),
    (torch.cuda, "set_rng_state"),
    (torch.cuda, "set_rng_state_all"),
    (torch.cuda, "manual_seed"),
    (torch.cuda, "manual_seed_all"),
)


@contextmanager
def _rng_state_refused() -> Iterator[None]:
    """While tracing, setting a generator's state (``torch.random.fork_rng``, a ``manual_seed`` in the forward)
    refuses the trace: it runs at trace time and leaves no node (NOTE [What a trace must not miss])."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in _RNG_SETTERS if hasattr(owner, name)]

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise TracedError(f"its forward {_RNG_CHANGES}, which torch.fx does not record")

    for owner, name, _ in saved:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@contextmanager
def _autocast_off() -> Iterator[None]:
    with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        yield


_APPLY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _applying(cls: type) -> Callable:
    """A function calling ``cls.apply``, one per Function class: a target fx's code keeps among its globals (a
    method of a torch class it would name by an import path ``apply`` does not have)."""
    call = _APPLY.get(cls)
    if call is None:

        def call(*args: Any, **kwargs: Any) -> Any:
            return cls.apply(*args, **kwargs)  # type: ignore[attr-defined]

        call.__name__ = call.__qualname__ = f"apply_{cls.__name__}"
        _APPLY[cls] = call
    return call


@contextmanager
def _functions_as_calls(tracer: fx.Tracer) -> Iterator[None]:
    """``torch.autograd.Function.apply`` on proxies recorded as one call (NOTE [What a trace must not miss])."""
    function = torch.autograd.Function
    original = function.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, fx.Proxy) for a in tree_flatten((args, kwargs))[0]):
            return tracer.create_proxy("call_function", _applying(cls), args, kwargs)
        return original.__get__(None, cls)(*args, **kwargs)

    function.apply = classmethod(apply)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        function.apply = original  # type: ignore[method-assign]


def _traced_with_buffers(model: nn.Module, reads: dict[tuple[nn.Module, str], Any]) -> fx.GraphModule:
    """``fx.symbolic_trace(model)`` with buffers traced (``_BufferTracer``); what the trace changed and fx did not
    record (a buffer's values, a buffer or a plain attribute rebound: ``self.steps += 1``) is put back and refused
    (NOTE [What a trace must not miss]). The plain attributes the forward read go in ``reads``."""
    owners = {name: m for name, m in model.named_modules()}
    buffers = {(name, k): b for name, m in owners.items() for k, b in m._buffers.items() if b is not None}
    values = {key: b.detach().clone() for key, b in buffers.items()}
    plain = plain_attributes(model)
    tracer = _BufferTracer()
    try:
        with reads_recorded(reads):
            graph = tracer.trace(model)
    finally:
        rebound = [key for key, b in buffers.items() if owners[key[0]]._buffers.get(key[1]) is not b]
        for module_name, k in rebound:
            owners[module_name]._buffers[k] = buffers[module_name, k]
        changed = [key for key, b in buffers.items() if not torch.equal(b, values[key])]
        with torch.no_grad():
            for key in changed:
                buffers[key].copy_(values[key])
        moved = put_back_attributes(owners, plain)
    what = (
        [f"rebinds buffer {_dotted(k)!r}" for k in rebound]
        + [f"writes buffer {_dotted(k)!r}" for k in changed]
        + [f"changes attribute {_dotted(k)!r}" for k in moved]
    )
    if what:
        raise TracedError(f"its forward {what[0]} in a way torch.fx does not record ({len(what)} such change(s))")
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _dotted(key: tuple[str, str]) -> str:
    return f"{key[0]}.{key[1]}" if key[0] else key[1]


def _is_value(node: fx.Node) -> bool:
    """A value computed by the forward (not an input, a parameter or a buffer)."""
    return node.op not in ("placeholder", "get_attr", "output")


def _carries(nodes: list[fx.Node]) -> dict[int, fx.Node]:
    """Position -> the one value alive after the op there, where exactly one is (NOTE [Cutting a traced forward])."""
    last_use: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        for used in node.all_input_nodes:
            last_use[used] = i
    live: set[fx.Node] = set()
    ends: dict[int, list[fx.Node]] = {}
    for node, i in last_use.items():
        ends.setdefault(i, []).append(node)
    found: dict[int, fx.Node] = {}
    last_op = max((i for i, n in enumerate(nodes) if _is_value(n)), default=0)
    for i, node in enumerate(nodes[:last_op]):  # a cut leaves ops on both sides
        if _is_value(node) and node in last_use:
            live.add(node)
        live.difference_update(ends.get(i, ()))
        if _is_value(node) and len(live) == 1:
            found[i] = next(iter(live))
    return found


class _Sizes(fx.Interpreter):
    """Runs the trace and records the bytes of every tensor value (NOTE [Cutting a traced forward])."""

    def __init__(self, gm: fx.GraphModule, fake: Any) -> None:
        super().__init__(gm)
        self.sizes: dict[fx.Node, int] = {}
        self.metas: dict[fx.Node, tuple] = {}
        self.fake = fake
        self.attrs: dict[str, Any] = {}

    def fetch_attr(self, target: str) -> Any:
        # each parameter made fake once: a real one met by an op is converted again at every op (ms each)
        if target not in self.attrs:
            value = super().fetch_attr(target)
            self.attrs[target] = self.fake.from_tensor(value) if isinstance(value, torch.Tensor) else value
        return self.attrs[target]

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.sizes[n] = out.numel() * out.element_size()
            self.metas[n] = (tuple(out.shape), tuple(out.stride()), out.dtype)
        return out


def _sizes(gm: fx.GraphModule, values: tuple) -> tuple[dict[fx.Node, int], dict[fx.Node, tuple]] | None:
    """Bytes of every tensor value, and its shape, strides and dtype, run on fake tensors (nothing allocated);
    None when fake tensors cannot run it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    sizes = _Sizes(gm, mode)
    buffers = [(b, b._version, b.clone()) for b in gm.buffers()]
    try:
        fake = tuple(mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in values)
        with torch.no_grad(), mode:
            sizes.run(*fake)
    except Exception:  # noqa: BLE001 (.item(), data-dependent shapes: cuts are then spread by op count)
        return None
    finally:
        _restore_written(buffers)
    return sizes.sizes, sizes.metas


def _restore_written(buffers: list[tuple[torch.Tensor, int, torch.Tensor]]) -> None:
    """Put back the buffers a fake run wrote to: a real buffer under ``allow_non_fake_inputs`` takes some writes
    for real (BatchNorm's ``num_batches_tracked += 1``), and sizing the cut must leave the model as it was."""
    with torch.no_grad():
        for buffer, version, before in buffers:
            if buffer._version != version:
                buffer.copy_(before)


def _choose_cuts(nodes: list[fx.Node], carries: dict[int, fx.Node], sizes: dict[fx.Node, int] | None) -> list[int]:
    """Up to MAX_SEGMENTS - 1 cut positions, spread evenly over the bytes made (the ops without ``sizes``),
    each the smallest carry near its place."""
    weights = [sizes.get(n, 0) if sizes is not None else int(_is_value(n)) for n in nodes]
    total = sum(weights) or 1
    cumulative, running = [], 0
    for w in weights:
        running += w
        cumulative.append(running)
    positions = sorted(carries)
    ops = sum(_is_value(n) for n in nodes)
    count = min(MAX_SEGMENTS, len(positions) + 1, ops // MIN_SEGMENT_OPS)
    cuts: list[int] = []
    for j in range(1, count):
        target, half = j * total / count, total / count / 2
        near = [p for p in positions if abs(cumulative[p] - target) <= half and (not cuts or p > cuts[-1])]
        if near:
            cuts.append(min(near, key=lambda p: ((sizes or {}).get(carries[p], 0), abs(cumulative[p] - target))))
    return cuts


# --- one trace per model and mode -----------------------------------------------------------------

# NOTE [One trace per model and mode]
# Tracing a forward of 100,000 ops takes seconds, and so does writing the Python of its segments; the
# profile, each plan remat.auto measures and remat.apply would each do it again. The trace, its carries
# and the code of each segment are kept per model (weakly: they go with it) and per what the trace
# depends on besides the code: the mode traced in, the modules it called (their names and classes), and
# the plain attributes its Python read (NOTE [The attributes a trace holds] in
# remat.profiling._traced_reads), which loops and branches read (``self.loops``); a change to any of
# them traces again, and nothing else does: a training loop's counter on the model, or remat's own
# attributes, leave the kept trace as it is. Segments are new modules at each install over the kept
# code, so no wrapper stays on one.
_TRACES: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Traced]] = weakref.WeakKeyDictionary()


@dataclass
class Traced:
    """A model's forward traced in one mode: its ops, where one value carries the state, compiled segments."""

    gm: fx.GraphModule
    modes: dict[str, bool]
    """Module name -> the mode it was traced in."""
    nodes: list[fx.Node]
    carries: dict[int, fx.Node]
    position: dict[str, int]
    reads: dict[tuple[str, str], Any]
    """(module name, attribute) -> the plain value the forward read (``MISSING``: looked for, not found)."""
    code: dict[tuple[int, int], tuple[Callable, dict[str, Any], tuple[str, ...]]] = field(default_factory=dict)
    """(first op, last op) -> the segment's compiled forward, the trace's constants it reads, and the modules whose
    buffers it reads."""


def _key(model: nn.Module, training: bool | None) -> tuple:
    """The modes and modules a trace of ``model`` depends on."""
    modes = training if training is not None else tuple(m.training for m in model.modules())
    return modes, tuple((name, type(m)) for name, m in model.named_modules())


def traced(model: nn.Module, training: bool | None) -> Traced:
    """``model``'s forward traced in ``training`` mode (None: its modes now), kept (NOTE [One trace per model
    and mode])."""
    key = _key(model, training)
    kept = _TRACES.get(model)
    if kept is None or kept[0] != key or not WatchedReads(model, kept[1].reads).unchanged():
        gm, modes, reads = _trace(model, training)
        nodes = list(gm.graph.nodes)
        names = {module: name for name, module in model.named_modules()}  # names: the kept trace holds no module
        # the latest trace only: a model's other modes are rarely asked for again
        _TRACES[model] = (
            key,
            Traced(
                gm,
                {names[m]: mode for m, mode in modes.items()},
                nodes,
                _carries(nodes),
                {n.name: i for i, n in enumerate(nodes)},
                {(names[m], k): v for (m, k), v in reads.items() if m in names},  # a module outside the model: held
            ),
        )
    return _TRACES[model][1]
