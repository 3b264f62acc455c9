"""``remat.checkpoint``: activation checkpointing that cannot silently freeze weights.

NOTE [Why a wrapper around torch's non-reentrant checkpoint]
The seed bug (a block on raw input trains nothing) comes from the reentrant
implementation, which only builds a graph when an *input* requires grad. The
non-reentrant implementation records the graph normally and only swaps saved
tensors for recompute handles, so parameters always get gradients; remat always
uses it. On top, remat adds what torch 2.13 still gets wrong (see
``remat.core._region``): buffers updated once per step and in-place ops on inputs.

The function's inputs are handed to torch inside an opaque holder, not as tensor
arguments: torch would keep them with a version check and refuse any in-place
op the function itself performs on them. The region keeps them instead, with its
own check against modification after the call. One empty tensor per device is
passed so that torch still stashes and restores the right device RNG streams.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.checkpoint import (
    _StopRecomputationError as _StopRecomputation,
)
from torch.utils.checkpoint import (
    checkpoint as _torch_checkpoint,
)

from remat.core._bound import PicklesBoundMethods
from remat.core._by_module import StructureRecorder, remember_learned, run_by_module
from remat.core._caches import CacheCopies
from remat.core._compiled import prepare_compile, run_compiled
from remat.core._contexts import ForwardContext, RecomputeContext, Stacked, policy_contexts
from remat.core._functorch import active_transforms, run_under_transform
from remat.core._host_rng import HOST_DRAWS, HostDraws
from remat.core._memo import STRUCTURES, device_markers, learned_memo, memo_key
from remat.core._policies import POLICIES, SAVE_OPS, compiled_policy_function, policy_function
from remat.core._policy_registry import FULL, KEEP, SELECTIVE
from remat.core._recompute_errors import recompute_failure
from remat.core._region import Region
from remat.core._torch_options import (
    DEFAULT,
    OPTION_NAMES,
    CallOptions,
    no_torch_debug,
    read_torch_options,
    split_torch_options,
)
from remat.errors import RematError

__all__ = ["checkpoint", "wrap", "unwrap", "is_wrapped", "POLICIES", "SAVE_OPS"]

F = TypeVar("F", bound=Callable[..., Any])


def forget_structure(module: nn.Module) -> None:
    """Forget what "selective" learned about ``module``: its next selective call learns again, op-level."""
    current = module.__dict__.get("forward")
    inner = current.inner if isinstance(current, _CheckpointedForward) else current
    key = memo_key(inner) if inner is not None else None
    for owner in (module, key[0] if key is not None else None):
        try:
            STRUCTURES.pop(owner, None)
        except TypeError:  # None, or not weakly referenceable: nothing remembered
            pass


def knows_structure(module: nn.Module) -> bool:
    """Whether ``module``'s next "selective" call takes its learned fast path (True where it is not wrapped so)."""
    current = module.__dict__.get("forward")
    if not isinstance(current, _CheckpointedForward) or not (
        isinstance(current.policy, str) and current.policy == SELECTIVE
    ):
        return True
    structure, _ = learned_memo(current.inner, STRUCTURES)
    return structure is not None


# NOTE [Eager calls under torch.compile]
# While dynamo traces, a call goes to torch's checkpoint operator instead
# (NOTE [Under torch.compile] in remat.core._compiled). A call dynamo cannot trace
# runs this eager primitive, disabled for dynamo, so that dynamo never looks inside
# the region. The disabled wrapper is made on first use, because
# ``torch.compiler.disable`` imports dynamo (a second at import time); torch's own
# checkpoint imports it on its first call anyway.
_uncompiled: Callable[..., Any] | None = None


def _run_uncompiled(
    fn: Callable, policy: Any, preserve_rng_state: bool, args: tuple, kwargs: dict, options: CallOptions = DEFAULT
) -> Any:
    global _uncompiled
    if _uncompiled is None:
        # Looked up at each call, not bound now: the doctor replaces _run_checkpointed while it runs.
        _uncompiled = torch.compiler.disable(
            lambda *a, **o: _run_checkpointed(*a, **o), reason="remat.checkpoint runs eagerly under torch.compile"
        )
    return _uncompiled(fn, policy, preserve_rng_state, args, kwargs, options=options)


# NOTE [Regions inside regions]
# The region holds its inputs itself (NOTE above), which is what torch would do at
# the top level. Inside another checkpoint's forward or recomputation (a nested
# plan, remat.core._segment) torch would instead hand them to the enclosing
# saved-tensor hooks, which keep only a handle: a region that held them would keep
# every inner block's input alive for the whole outer forward (measured: 12.0 MiB
# against torch's 10.0 on an 8-block chain), defeating the nesting. So where
# saved-tensor hooks are active the inputs also go to torch as tensor arguments and
# the region lets go of them after the forward, taking them back from torch in
# recomputation. Hooks unpack without a version check, so in-place writes still work.
def _modules_run(fn: Callable, owner: nn.Module | None) -> Any:
    """The modules a call runs, where known: its own module's, or a nested segment's blocks'."""
    if owner is not None:
        return owner.modules()
    modules_run = getattr(fn, "modules_run", None)
    return modules_run() if callable(modules_run) else None


def _inside_saved_tensor_hooks() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


def _run_checkpointed(
    fn: Callable, policy: Any, preserve_rng_state: bool, args: tuple, kwargs: dict, options: CallOptions = DEFAULT
) -> Any:
    owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    owner = owner if isinstance(owner, nn.Module) else None
    recorder, remember_structure = None, None
    if (
        owner is not None
        and isinstance(policy, str)
        and policy == SELECTIVE
        and options.contexts is None
        and not _inside_saved_tensor_hooks()
    ):
        structure, remember_structure = learned_memo(fn, STRUCTURES)  # NOTE in remat.core._by_module
        regions = structure.live() if structure is not None else None
        if regions:
            return run_by_module(fn, regions, args, kwargs, owner)
        if regions is None:
            recorder = StructureRecorder(owner, SAVE_OPS.__contains__)
    learned, remember = learned_memo(fn)
    caches = CacheCopies.of(args, kwargs, lambda: _modules_run(fn, owner))  # NOTE [Caches in recomputation] in _caches
    if caches is not None:
        args, kwargs = caches.stand_ins(args, kwargs)
    region = Region(args, kwargs, learned, owner)
    host = HostDraws(*learned_memo(fn, HOST_DRAWS), fn) if preserve_rng_state else None
    policy_fn = policy_function(policy)
    phase = {"forward": True}

    def context_fn() -> tuple[Any, Any]:
        fwd, rec = policy_contexts(policy_fn, preserve_rng_state, options)
        if recorder is not None:
            fwd = Stacked(fwd, recorder)
        return Stacked(ForwardContext(region, remember), fwd), Stacked(RecomputeContext(region), rec)

    markers = device_markers(region.input_tensors())
    nested = _inside_saved_tensor_hooks()

    def run(_holder: Region, *tensors: torch.Tensor) -> Any:
        if phase["forward"]:
            phase["forward"] = False
            fargs, fkwargs = (
                (region.args, region.kwargs) if caches is None else caches.originals(region.args, region.kwargs)
            )
            if host is None:
                return fn(*fargs, **fkwargs)
            return host.forward(lambda: fn(*fargs, **fkwargs))  # NOTE [Host generators in recomputation]
        if nested:
            region.restore_inputs(tensors[len(markers) :])
        rargs, rkwargs = region.recompute_inputs()
        if caches is not None:
            rargs, rkwargs = caches.fresh(rargs, rkwargs)
        try:
            if host is None:
                return fn(*rargs, **rkwargs)
            with host.recomputing():
                return fn(*rargs, **rkwargs)
        except (_StopRecomputation, RematError, torch.OutOfMemoryError):
            # torch's early stop, our own message (a region inside this one's included), or the device full: out of
            # memory says nothing of the function, and the caller tells (or answers) it (NOTE [Out of memory is an
            # answer] in remat.planning._verify_step)
            raise
        except Exception as exc:
            raise recompute_failure(fn, policy, region, exc) from exc

    with no_torch_debug():
        out = _torch_checkpoint(
            run,
            region,
            *markers,
            *(region.handed_inputs() if nested else ()),
            use_reentrant=False,
            preserve_rng_state=preserve_rng_state,
            context_fn=context_fn,
            **options.torch_kwargs(),
        )
    if nested:
        region.release_inputs()
    if recorder is not None:
        if remember_structure is None:
            raise RuntimeError("a structure recorder is made only beside its memo")
        structure = recorder.structure()
        remember_learned(lambda: remember_structure(structure))  # NOTE [Learning kept until the step ends]
    return out


def checkpoint(
    fn: Callable | None = None,
    *args: Any,
    policy: Any = FULL,
    preserve_rng_state: bool = True,
    use_reentrant: bool | None = None,
    context_fn: Callable[[], Any] | None = None,
    determinism_check: str = "default",
    debug: bool | None = None,
    early_stop: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` without keeping its activations; recompute them in backward.

    A drop-in for ``torch.utils.checkpoint.checkpoint`` that is always
    non-reentrant and adds these guarantees: parameters used inside get gradients
    whatever the inputs' ``requires_grad``; gradients equal the un-checkpointed
    run's (RNG restored for dropout); module buffers such as BatchNorm running
    statistics change once per step; in-place ops on the inputs work.

    Args:
        fn: the function or module to run. Called without ``fn``,
            ``remat.checkpoint(policy=...)`` returns a decorator.
        policy: ``"full"`` recomputes everything; ``"selective"`` keeps the
            outputs of matmuls, convolutions and attention and recomputes the
            rest; a list of aten ops to keep, or a torch
            selective-checkpoint policy function. For a module (or a bound
            method of one), ``"selective"`` decides op by op on its first call
            only; later calls recompute just its cheap submodules (norms,
            activations) as regions of their own, with no per-op hook, and keep
            what everything else saves, dropout masks included (more memory
            than op by op where the
            block's own code or a Linear saves a cheap output; NOTE in
            ``remat.core._by_module``). Functions, op lists, policy functions
            and ``"selective-ops"`` decide op by op on every call. Whatever it keeps, random streams are
            unchanged: a kept op that draws random numbers (CUDA attention with
            dropout) still advances the generator in recompute (NOTE in
            ``remat.core._rng``).
        preserve_rng_state: restore the RNG streams in recompute so dropout
            draws the same mask. Only turn off for functions that draw nothing.
        use_reentrant, context_fn, determinism_check, debug, early_stop: torch's
            options, read as torch reads them; ``use_reentrant=True`` runs the
            non-reentrant checkpoint too, with one warning per call site (NOTE in
            ``remat.core._torch_options``). Options later torches add
            (``respect_saved_tensors_hooks``) are honoured or refused, never
            handed to ``fn``.

    Like torch, every other keyword goes to ``fn``. A failure while recomputing raises
    :class:`remat.errors.RecomputeError`, which is also torch's ``CheckpointError``
    (a ``RuntimeError``); a refused option value is also a ``ValueError``.
    Under ``torch.compile`` the call is traced as torch's checkpoint operator with the same
    policy (NOTE [Under torch.compile] in ``remat.core._compiled``).
    """
    later: dict[str, Any] = {}
    if kwargs and not OPTION_NAMES.isdisjoint(kwargs):  # options torch added (NOTE in remat.core._torch_options)
        kwargs, later = split_torch_options(kwargs)
    torch_options = {
        "use_reentrant": use_reentrant,
        "context_fn": context_fn,
        "determinism_check": determinism_check,
        "debug": debug,
        "early_stop": early_stop,
        "later": later,
    }
    if fn is None:
        if args or kwargs:
            raise RematError(
                "remat.checkpoint: arguments were given but no function; call "
                "remat.checkpoint(fn, *args) or use @remat.checkpoint(policy=...) as a decorator."
            )
        return functools.partial(
            _decorate, policy=policy, preserve_rng_state=preserve_rng_state, torch_options=torch_options
        )
    return _checkpoint_call(fn, args, kwargs, policy, preserve_rng_state, torch_options)


_NO_TORCH_OPTIONS: dict[str, Any] = {
    "use_reentrant": None,
    "context_fn": None,
    "determinism_check": "default",
    "debug": None,
    "early_stop": None,
}


def _checkpoint_call(
    fn: Callable, args: tuple, kwargs: dict, policy: Any, preserve_rng_state: bool, torch_options: dict[str, Any]
) -> Any:
    """``remat.checkpoint`` once its own keywords are read: every keyword in ``kwargs`` is the function's."""
    if not callable(fn):
        raise RematError(f"remat.checkpoint: fn must be callable, got {type(fn).__name__}.")
    policy, options = read_torch_options(policy, **torch_options)
    policy_function(policy)  # validate before running anything
    if policy == KEEP or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():
        eager = functools.partial(_run_uncompiled, fn, policy, preserve_rng_state, args, kwargs, options)
        return run_compiled(fn, compiled_policy_function(policy), args, kwargs, eager=eager)  # NOTE in core/_compiled
    prepare_compile()
    transforms = active_transforms()
    if transforms:  # NOTE [Under torch.func transforms] in remat.core._functorch
        return run_under_transform(
            fn,
            args,
            kwargs,
            transforms,
            policy_fn=policy_function(policy),
            preserve_rng_state=preserve_rng_state,
            options=options,
        )
    return _run_uncompiled(fn, policy, preserve_rng_state, args, kwargs, options)


def _decorate(fn: F, *, policy: Any, preserve_rng_state: bool, torch_options: dict[str, Any]) -> F:
    @functools.wraps(fn)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        # Every keyword of the call is the function's, even one named like an option: torch's decorator form
        # (torch 2.14) does the same.
        return _checkpoint_call(fn, args, kwargs, policy, preserve_rng_state, torch_options)

    return checkpointed  # type: ignore[return-value]


class _CheckpointedForward(PicklesBoundMethods):
    """Instance-level ``forward`` that checkpoints the class's forward.

    An instance attribute, not a wrapper module: ``state_dict`` keys and
    parameter names stay exactly as they were (torch's ``checkpoint_wrapper``
    inserts ``_checkpoint_wrapped_module``).
    """

    def __init__(self, module: nn.Module, policy: str, preserve_rng_state: bool, previous: Any) -> None:
        self.inner = previous if previous is not None else type(module).forward.__get__(module)
        self.previous = previous
        self.policy = policy
        self.preserve_rng_state = preserve_rng_state
        self.fine_layers: tuple[nn.Module, ...] = ()  # the sub-layers ``wrap_fine`` wrapped inside it

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The module's keywords are its forward's, all of them (a `debug=` of its own included).
        return _checkpoint_call(self.inner, args, kwargs, self.policy, self.preserve_rng_state, _NO_TORCH_OPTIONS)


def wrap(module: nn.Module, *, policy: str = FULL, preserve_rng_state: bool = True) -> nn.Module:
    """Checkpoint ``module``'s forward in place (names and ``state_dict`` keys unchanged); returns it."""
    if not isinstance(module, nn.Module):
        raise RematError(f"remat.wrap: expected an nn.Module, got {type(module).__name__}.")
    if policy not in POLICIES:
        raise RematError(f"remat.wrap: policy must be one of {POLICIES}, got {policy!r}.")
    unwrap(module)
    prepare_compile()
    if policy != KEEP:
        previous = module.__dict__.get("forward")
        module.forward = _CheckpointedForward(module, policy, preserve_rng_state, previous)
    return module


def unwrap(module: nn.Module) -> nn.Module:
    """Undo :func:`wrap` on ``module`` (no-op when it is not wrapped); returns it."""
    current = module.__dict__.get("forward")
    if isinstance(current, _CheckpointedForward):
        if current.previous is None:
            del module.forward
        else:
            module.forward = current.previous
    return module


def is_wrapped(module: nn.Module) -> str | None:
    """The policy ``module`` is wrapped with, or None."""
    current = module.__dict__.get("forward")
    return current.policy if isinstance(current, _CheckpointedForward) else None
