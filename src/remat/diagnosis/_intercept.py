"""The doctor's view of every checkpointed call: run it as written, observe it, or run it plainly.

NOTE [Where the doctor intercepts checkpointing]
Users reach torch's checkpoint through many doors: ``torch.utils.checkpoint.checkpoint``
called as an attribute or imported by name, ``checkpoint_sequential``, torch's
``checkpoint_wrapper`` and Hugging Face layers (both keep their own reference to the
function), and ``remat.checkpoint``/``remat.wrap`` (which call torch's non-reentrant
checkpoint). Swapping the public function would miss every kept reference. All these
doors end in one of two module globals that torch's ``checkpoint`` looks up at call
time: an ``autograd.Function`` (reentrant) and a generator (non-reentrant; the
composable ``checkpoint(module)`` API imports it by name, so its reference is swapped
too). Swapping those two sees every call and can turn any one of them into a plain call
of the function: the all-plain run is the doctor's reference.

Which two globals these are depends on torch's version: see NOTE [Finding the doors by what
checkpoint calls] in ``remat.diagnosis._doors``; what a call's record holds and how calls are
keyed: NOTE [Call keys] in ``remat.diagnosis._calls``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as tuc
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# The module (``remat.checkpoint`` as an attribute is the function): the doctor swaps its
# ``_run_checkpointed``.
from remat.core import checkpoint as remat_checkpoint
from remat.core._rng import SAVE_DECISIONS, draws_random
from remat.diagnosis._calls import ROOT, CallKey, CheckpointCall, call_site
from remat.diagnosis._doors import doors
from remat.errors import RematError

# The doctor's own frames, skipped when looking for the user's call site.
_MACHINERY = frozenset({functools.__file__, contextlib.__file__, __file__})
_UNSET_WARNING = "use_reentrant parameter should be passed explicitly"
_COMPOSABLE = "torch.distributed._composable.checkpoint_activation"


def never(key: CallKey) -> bool:
    return False


def always(key: CallKey) -> bool:
    return True


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _requires_grad(*trees: Any) -> bool:
    leaves, _ = tree_flatten(trees)
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)


class Interceptor:
    """Decides for every checkpointed call whether it runs as written or plainly, and records it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = {id(m): (n or ROOT) for n, m in model.named_modules()}
        self.plain: Callable[[CallKey], bool] = never
        self.recording = False
        self.calls: list[CheckpointCall] = []
        self.open: list[CheckpointCall] = []
        self.module_stack: list[str | None] = []
        self.forward_calls: Counter[str] = Counter()
        self.backward_calls: Counter[str] = Counter()
        self.completed: Counter[str] = Counter()
        self._occurrences: Counter[tuple[str, str]] = Counter()
        self._unset_pending = False
        self._remat: tuple[Callable, tuple, dict] | None = None

    def start(self, plain: Callable[[CallKey], bool], *, recording: bool) -> None:
        """Begin a step: which calls run plainly, and whether to record what happens."""
        self.plain, self.recording = plain, recording
        self.calls, self.open, self.module_stack = [], [], []
        self.forward_calls, self.backward_calls, self.completed = Counter(), Counter(), Counter()
        self._occurrences.clear()

    # -- naming ------------------------------------------------------------------------------
    def target(self, fn: Any) -> tuple[str, bool]:
        """(the module's qualified name or the function's, whether it is a module of the model)."""
        module = None
        while isinstance(fn, functools.partial):
            # Hugging Face layers checkpoint partial(forward, self, **kwargs).
            if fn.args and isinstance(fn.args[0], nn.Module):
                module = fn.args[0]
                break
            fn = fn.func
        if module is None:
            owner = getattr(fn, "__self__", None)
            module = fn if isinstance(fn, nn.Module) else owner if isinstance(owner, nn.Module) else None
        if module is not None and id(module) in self.names:
            return self.names[id(module)], True
        if module is not None:
            return type(module).__name__, False
        return getattr(fn, "__qualname__", type(fn).__name__), False

    # -- one call ----------------------------------------------------------------------------
    def begin(
        self, fn: Any, preserve: bool, inputs: tuple, *, reentrant: bool, unset: bool
    ) -> tuple[CheckpointCall | None, bool]:
        """(the record of this call or None, whether to run it plainly)."""
        if in_backward():
            return None, False
        site, api = call_site(_MACHINERY)
        target, is_module = self.target(fn)
        occurrence = self._occurrences[(site, target)]
        self._occurrences[(site, target)] += 1
        key = (site, target, occurrence)
        if self.plain(key):
            return None, True
        if not self.recording:
            return None, False
        call = CheckpointCall(
            key,
            api,
            reentrant,
            unset,
            bool(preserve),
            _requires_grad(inputs),
            len(self.open),
            len(self.module_stack),
            is_module,
        )
        self.calls.append(call)
        self.open.append(call)
        return call, False

    def end(self, call: CheckpointCall | None) -> None:
        self.open = [c for c in self.open if c is not call]

    # -- the doors ---------------------------------------------------------------------------
    def reentrant_apply(self, real: Any, function: Callable, preserve: bool, *args: Any) -> Any:
        unset, self._unset_pending = self._unset_pending, False
        call, plain = self.begin(function, preserve, args, reentrant=True, unset=unset)
        if plain:
            return function(*args)
        try:
            out = real.apply(function, preserve, *args)
        finally:
            self.end(call)
        if call is not None:
            call.output_requires_grad = _requires_grad(out)
        return out

    def non_reentrant(
        self, real: Callable, signature: inspect.Signature, fn: Any, *rest: Any, **kwargs: Any
    ) -> Iterator[None]:
        self._unset_pending = False
        bound = signature.bind(fn, *rest, **kwargs)
        bound.apply_defaults()
        inputs = (bound.arguments.get("args", ()), bound.arguments.get("kwargs", {}))
        if self._remat is not None:  # torch sees remat's closure; the user's function is this one
            fn, remat_args, remat_kwargs = self._remat
            inputs = (remat_args, remat_kwargs)
            self._remat = None
        call, plain = self.begin(fn, bound.arguments["preserve_rng_state"], tuple(inputs), reentrant=False, unset=False)
        if plain:
            yield  # torch's checkpoint calls the function itself between the two steps
            return
        if call is not None and bound.arguments.get("context_fn", tuc.noop_context_fn) is not tuc.noop_context_fn:
            bound.arguments["context_fn"] = functools.partial(_observed_contexts, bound.arguments["context_fn"], call)
        try:
            yield from real(*bound.args, **bound.kwargs)
        finally:
            self.end(call)

    def remat_run(
        self, real: Callable, fn: Callable, policy: Any, preserve: bool, args: tuple, kwargs: dict, **options: Any
    ) -> Any:
        self._remat = (fn, args, kwargs)
        try:
            return real(fn, policy, preserve, args, kwargs, **options)
        finally:
            self._remat = None

    # -- module and warning hooks ------------------------------------------------------------
    def on_root(self, module: nn.Module, args: Any) -> None:
        if not in_backward():
            self._occurrences.clear()

    def on_enter(self, module: nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        backward = in_backward()
        if name is not None:
            (self.backward_calls if backward else self.forward_calls)[name] += 1
            for call in [] if backward else self.open:
                call.modules.add(name)
                if len(self.module_stack) == call.module_depth:
                    call.top_modules.append(name)
        self.module_stack.append(name)

    def on_exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.module_stack:
            self.module_stack.pop()

    def on_complete(self, module: nn.Module, args: Any, output: Any) -> None:
        # Not called when the forward raises, as torch's early-stopping recomputation does
        # once it has what backward needs: then the module's own forward hooks do not run.
        name = self.names.get(id(module))
        if name is not None:
            self.completed[name] += 1

    def on_random_op(self, func: Any) -> None:
        if not self.open or in_backward():
            return
        where = next((n for n in reversed(self.module_stack) if n is not None), None) or str(func)
        for call in self.open:
            call.random_modules.add(where)
            call.random_ops += 1

    def on_warning(self, message: Any, *rest: Any, **kwargs: Any) -> None:
        # Every warning raised while the doctor runs the user's code is swallowed; the
        # use_reentrant one becomes a risky-call finding for the call that follows it.
        if _UNSET_WARNING in str(message):
            self._unset_pending = True


class _ReentrantDoor:
    """Stands in for ``torch.utils.checkpoint.CheckpointFunction`` (only ``apply`` is used)."""

    def __init__(self, icpt: Interceptor, real: Any) -> None:
        self.icpt, self.real = icpt, real

    def apply(self, function: Callable, preserve: bool, *args: Any) -> Any:
        return self.icpt.reentrant_apply(self.real, function, preserve, *args)


def _observed_contexts(context_fn: Callable[[], tuple[Any, Any]], call: CheckpointCall) -> tuple[Any, Any]:
    # torch's selective checkpointing asks its policy about every op right after running
    # it in forward; a random op it keeps is not rerun in recompute (NOTE in remat.core._rng).
    # remat's own regions replay the generator instead, so only torch's modes are watched.
    forward, recompute = context_fn()
    policy = getattr(forward, "policy_fn", None)
    if type(forward).__name__ == "_CachingTorchDispatchMode" and callable(policy):

        def observed(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            decision = policy(ctx, func, *args, **kwargs)
            if draws_random(func) and decision in SAVE_DECISIONS:
                call.saved_random_ops.append(str(func))
            return decision

        forward.policy_fn = observed
    return forward, recompute


class _RandomOps(TorchDispatchMode):
    """Reports every op that draws from an RNG (dropout's bernoulli_, rrelu, rand*)."""

    def __init__(self, icpt: Interceptor) -> None:
        super().__init__()
        self.icpt = icpt

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if draws_random(func):
            self.icpt.on_random_op(func)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def session(icpt: Interceptor) -> Iterator[None]:
    """Swap the checkpoint doors (NOTE above) and silence warnings; everything is put back on exit."""
    if isinstance(tuc.CheckpointFunction, _ReentrantDoor):
        raise RematError("remat.doctor: another remat.doctor is already running in this process; run one at a time.")
    function_name, generator_name = doors()
    real_gen = getattr(tuc, generator_name)
    door = functools.partial(icpt.non_reentrant, real_gen, inspect.signature(real_gen))
    patches = [
        (tuc, function_name, _ReentrantDoor(icpt, getattr(tuc, function_name))),
        (tuc, generator_name, door),
        (remat_checkpoint, "_run_checkpointed", functools.partial(icpt.remat_run, remat_checkpoint._run_checkpointed)),
    ]
    composable = sys.modules.get(_COMPOSABLE)
    if composable is not None and getattr(composable, generator_name, None) is real_gen:
        patches.append((composable, generator_name, door))
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("always")
        warnings.showwarning = icpt.on_warning
        stack.callback(_unleak, set(sys.modules), {id(new): getattr(obj, name) for obj, name, new in patches})
        for obj, name, new in patches:
            stack.callback(setattr, obj, name, getattr(obj, name))
            setattr(obj, name, new)
        stack.callback(icpt.model.register_forward_pre_hook(icpt.on_root).remove)
        yield


def _unleak(modules_before: set[str], originals: dict[int, Any]) -> None:
    # torch imports modules lazily on the first checkpoint call (torch._dynamo, the
    # composable API, ...); one that imported a swapped name by value while the doctor
    # ran would keep the doctor's door forever. Give those modules the original back.
    for name in set(sys.modules) - modules_before:
        namespace = getattr(sys.modules[name], "__dict__", {})
        for attr, value in list(namespace.items()):
            if id(value) in originals:
                namespace[attr] = originals[id(value)]


@contextlib.contextmanager
def observing(icpt: Interceptor) -> Iterator[None]:
    """Count module calls, track the module stack and random ops (the observed steps only)."""
    with contextlib.ExitStack() as stack:
        stack.callback(nn.modules.module.register_module_forward_pre_hook(icpt.on_enter).remove)
        stack.callback(nn.modules.module.register_module_forward_hook(icpt.on_exit, always_call=True).remove)
        stack.callback(nn.modules.module.register_module_forward_hook(icpt.on_complete).remove)
        stack.enter_context(_RandomOps(icpt))
        yield
