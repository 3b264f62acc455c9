"""The keyword options of ``torch.utils.checkpoint.checkpoint``, as ``remat.checkpoint`` reads them.

NOTE [torch's keyword names are remat's]
torch's ``checkpoint`` consumes ``use_reentrant``, ``context_fn``, ``determinism_check``,
``debug``, ``early_stop`` and ``preserve_rng_state`` and hands every other keyword to
the function; ``remat.checkpoint`` does the same, so a call written for torch means the
same under remat. Each option is either honoured with remat's guarantees or refused
with a RematError, never dropped:

* ``use_reentrant``: ``False``/``None`` accepted (remat is always non-reentrant);
  ``True`` runs remat's non-reentrant checkpoint too, with one warning per call
  site: the reentrant implementation is what freezes a block's parameters when no
  input requires grad, and code in the wild passes ``True`` (older Hugging Face
  defaults, tutorials, and torch's own ``checkpoint_sequential`` when its caller
  leaves ``use_reentrant`` unset), so refusing it would make remat no drop-in.
* ``context_fn``: a ``create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation=...)``
  pair becomes ``policy=`` (random streams kept through remat's ledger; a cached output
  written in place is recomputed, so ``allow_cache_entry_mutation`` has nothing left to
  refuse or allow: NOTE [Cached outputs written in place] in ``remat.core._contexts``); any other
  pair of context managers is entered around the forward and the recomputation,
  inside remat's own contexts.
* ``determinism_check`` (``"default"`` / ``"none"``) and ``early_stop`` go to torch.
* ``debug=True`` (or ``torch.utils.checkpoint.set_checkpoint_debug_enabled(True)``):
  torch's operator-trace dump needs its own ``context_fn``, which remat's replaces;
  remat runs the call, warns once, and a failed recomputation raises
  :class:`remat.errors.RecomputeError` naming the function.
* Options torch adds later arrive in ``**kwargs``, where remat would hand them to the
  function (a ``TypeError`` there). A keyword named like one of the installed torch's
  ``checkpoint`` parameters, or like one of ``RECENT_OPTIONS``, is taken as the option
  torch takes it for: honoured where remat knows it, else refused with a
  :class:`remat.errors.CheckpointOptionError` naming it.
* ``respect_saved_tensors_hooks`` (torch 2.14): whether the outputs a selective
  policy keeps go through the surrounding ``saved_tensors_hooks`` (``save_on_cpu``).
  Given, it is set on torch's selective-checkpoint mode; left unset, remat sets
  ``False``, torch's present default, which torch 2.14 would announce with a
  ``FutureWarning`` on every call under such hooks (NOTE [Saved-tensor hooks around
  a selective region]). ``True`` on a torch without the option is refused for the
  selective policies, and accepted for ``"full"``, where it changes nothing, as on
  torch (nothing is kept: every saved tensor goes through the hooks).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.utils.checkpoint as tuc

from remat.core._policy_registry import FULL, KEEP
from remat.errors import CheckpointOptionError

_DETERMINISM = ("default", "none")


@dataclass(frozen=True)
class CallOptions:
    """What a torch-style call asked for beyond remat's ``policy`` and ``preserve_rng_state``."""

    contexts: tuple[Any, Any] | None = None
    """A general ``context_fn``'s (forward, recompute) context managers, entered inside remat's."""
    allow_cache_entry_mutation: bool = False
    """From ``create_selective_checkpoint_contexts``: let the function mutate tensors the policy keeps."""
    determinism_check: str = "default"
    """torch's check that recomputed tensors have the forward's metadata (``"none"`` turns it off)."""
    early_stop: bool | None = None
    """Stop recomputing once every needed tensor is rebuilt (None: torch's global setting)."""
    respect_saved_tensors_hooks: bool | None = None
    """Route the outputs a selective policy keeps through the surrounding saved-tensor hooks (None: no)."""

    def torch_kwargs(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"determinism_check": self.determinism_check}
        if self.early_stop is not None:
            extra["early_stop"] = self.early_stop
        return extra


DEFAULT = CallOptions()


def _debug_requested(debug: bool | None) -> bool:
    enabled = getattr(tuc, "_checkpoint_debug_enabled", None)
    return bool(enabled if enabled is not None else debug)


def _warn_debug() -> None:
    # Python's default filter shows it once per calling line, not once per step.
    warnings.warn(
        "remat.checkpoint: debug=True (or set_checkpoint_debug_enabled(True)) runs the call, but torch's "
        "operator-trace dump is not produced: it needs its own context_fn, which remat's replaces. A failed "
        "recomputation raises remat.RecomputeError naming the function; remat.doctor(model, inputs) compares "
        "every module with and without checkpointing.",
        stacklevel=4,
    )


def _from_context_fn(context_fn: Callable[[], Any], policy: Any) -> tuple[Any, CallOptions]:
    """(policy, options) for a torch ``context_fn``: called once, as torch calls it once per checkpoint."""
    if not callable(context_fn):
        raise CheckpointOptionError(
            f"remat.checkpoint: context_fn must be a function returning two context managers, got "
            f"{type(context_fn).__name__}; e.g. functools.partial(create_selective_checkpoint_contexts, policy_fn)."
        )
    pair = context_fn()
    if not (isinstance(pair, tuple) and len(pair) == 2 and all(hasattr(c, "__enter__") for c in pair)):
        raise CheckpointOptionError(
            f"remat.checkpoint: context_fn() must return (forward context, recompute context), got "
            f"{type(pair).__name__}; see torch.utils.checkpoint.create_selective_checkpoint_contexts."
        )
    forward, recompute = pair
    if isinstance(forward, tuc._CachingTorchDispatchMode) and isinstance(recompute, tuc._CachedTorchDispatchMode):
        if policy not in (None, FULL):
            raise CheckpointOptionError(
                f"remat.checkpoint: both policy={policy!r} and a selective context_fn were given; they decide the "
                "same thing. Pass one: policy=... (remat's) or context_fn=... (torch's)."
            )
        return forward.policy_fn, CallOptions(allow_cache_entry_mutation=recompute.allow_cache_entry_mutation)
    return policy, CallOptions(contexts=(forward, recompute))


#: Options torch's ``checkpoint`` gained after the oldest torch remat supports, that remat honours.
RECENT_OPTIONS = ("respect_saved_tensors_hooks",)
_READ_BY_NAME = frozenset(
    {
        "function",
        "args",
        "kwargs",
        "use_reentrant",
        "context_fn",
        "determinism_check",
        "debug",
        "early_stop",
        "preserve_rng_state",
    }
)


def _torch_option_names() -> frozenset[str]:
    params: Iterable[inspect.Parameter]
    try:
        params = inspect.signature(tuc.checkpoint).parameters.values()
    except (TypeError, ValueError):  # no signature to read: only the names remat knows
        params = ()
    names = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return frozenset(names - _READ_BY_NAME)


#: The installed torch's own options among ``checkpoint``'s keywords (beyond those remat reads by name).
TORCH_OPTIONS = _torch_option_names()
#: Keywords ``remat.checkpoint`` takes as torch's options, not as the function's (NOTE above).
OPTION_NAMES = TORCH_OPTIONS | frozenset(RECENT_OPTIONS)


def split_torch_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the function's keywords, torch's options among them); call where ``OPTION_NAMES`` meets ``kwargs``."""
    options = {k: v for k, v in kwargs.items() if k in OPTION_NAMES}
    return {k: v for k, v in kwargs.items() if k not in OPTION_NAMES}, options


def _read_later_options(options: dict[str, Any], policy: Any) -> bool | None:
    """``respect_saved_tensors_hooks`` from the options torch added later; refuse any other."""
    unknown = sorted(set(options) - set(RECENT_OPTIONS))
    if unknown:
        raise CheckpointOptionError(
            f"remat.checkpoint: {unknown[0]}={options[unknown[0]]!r} is an option of torch {torch.__version__}'s "
            "checkpoint that this remat does not know, so it can neither honour it nor hand it to the function "
            "(torch would not either). Drop it, or use torch.utils.checkpoint.checkpoint for this call; "
            "remat's own options are policy= and preserve_rng_state=."
        )
    respect = options.get("respect_saved_tensors_hooks")
    if respect is not None and not isinstance(respect, bool):
        raise CheckpointOptionError(
            f"remat.checkpoint: respect_saved_tensors_hooks must be True, False or None, got {respect!r}."
        )
    if (
        respect
        and "respect_saved_tensors_hooks" not in TORCH_OPTIONS
        and not (isinstance(policy, str) and policy in (FULL, KEEP))
    ):
        raise CheckpointOptionError(
            f"remat.checkpoint: respect_saved_tensors_hooks=True with policy={policy!r} needs torch 2.14 or later "
            f"(this is torch {torch.__version__}): its selective checkpoint keeps op outputs outside the "
            "saved-tensor hooks and has no way to route them through. Upgrade torch, pass policy='full' (nothing "
            "is kept, every saved tensor goes through the hooks), or drop the option."
        )
    return respect


_SITES: set[tuple[str, int]] = set()
_PASS_THROUGH = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep, os.path.abspath(tuc.__file__))


def _warn_reentrant() -> None:
    """Warn once per call site: the first frame outside remat and torch's checkpoint module (a call through
    torch's ``checkpoint_sequential`` is told at the caller's line)."""
    frame: FrameType | None = sys._getframe(1)
    level = 2  # the stacklevel that names ``frame``
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PASS_THROUGH):
        frame, level = frame.f_back, level + 1
    site = (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("", 0)
    if site in _SITES:
        return
    _SITES.add(site)
    warnings.warn(
        "remat.checkpoint: use_reentrant=True is run with remat's non-reentrant checkpoint: reentrant "
        "checkpointing silently loses gradients for inputs that don't require grad (the parameters inside then "
        "get none either), so remat runs the non-reentrant one, whose gradients equal the un-checkpointed "
        "model's. torch's checkpoint_sequential passes use_reentrant=True when its own is left unset. To "
        "silence this warning, pass use_reentrant=False.",
        UserWarning,
        stacklevel=level,
    )


def read_torch_options(
    policy: Any,
    *,
    use_reentrant: bool | None,
    context_fn: Callable[[], Any] | None,
    determinism_check: str,
    debug: bool | None,
    early_stop: bool | None,
    later: dict[str, Any] | None = None,
) -> tuple[Any, CallOptions]:
    """The policy and options a torch-style call means (NOTE above); ``later``: the options torch added
    later (``split_torch_options``). CheckpointOptionError for what remat refuses."""
    if (
        use_reentrant is None
        and context_fn is None
        and determinism_check == "default"
        and debug is None
        and early_stop is None
        and not later
        and not getattr(tuc, "_checkpoint_debug_enabled", None)
    ):
        return policy, DEFAULT  # every block call of an applied plan: no checks, no new options object
    if determinism_check not in _DETERMINISM:
        raise CheckpointOptionError(
            f"remat.checkpoint: determinism_check={determinism_check!r}; torch accepts {_DETERMINISM}."
        )
    for name, value in (("early_stop", early_stop), ("debug", debug)):
        if value is not None and not isinstance(value, bool):
            raise CheckpointOptionError(f"remat.checkpoint: {name} must be True, False or None, got {value!r}.")
    options = DEFAULT
    if context_fn is not None and context_fn is not tuc.noop_context_fn:
        policy, options = _from_context_fn(context_fn, policy)
    respect = _read_later_options(later, policy) if later else None
    if use_reentrant:  # read as torch reads it; after every refusal, so a refused call warns nothing
        _warn_reentrant()
    if _debug_requested(debug):
        _warn_debug()
    return policy, CallOptions(
        contexts=options.contexts,
        allow_cache_entry_mutation=options.allow_cache_entry_mutation,
        determinism_check=determinism_check,
        early_stop=early_stop,
        respect_saved_tensors_hooks=respect,
    )


# NOTE [Saved-tensor hooks around a selective region]
# torch's selective checkpoint keeps the outputs its policy saves in a cache of its own, outside
# autograd's saved tensors, so hooks such as save_on_cpu never see them. torch 2.14 added
# respect_saved_tensors_hooks to route them through the hooks; left unset it keeps the old way and
# warns (FutureWarning) on every call under such hooks. torch sets the choice on its caching mode
# only when that mode is context_fn's first context, which remat's never is (its own contexts
# wrap torch's), so remat sets it itself: the caller's choice, else False, the behaviour torch has
# today and the one remat's memory model counts. Torches without the option have no such attribute.
def route_saved_tensors_hooks(caching_mode: Any, options: CallOptions) -> None:
    """Tell torch's selective-checkpoint caching mode whether kept outputs go through saved-tensor hooks."""
    if hasattr(caching_mode, "respect_saved_tensors_hooks"):
        caching_mode.respect_saved_tensors_hooks = bool(options.respect_saved_tensors_hooks)


def no_torch_debug() -> contextlib.AbstractContextManager[Any]:
    """torch's global debug switch off for remat's own call (NOTE above: it would refuse remat's context_fn)."""
    if getattr(tuc, "_checkpoint_debug_enabled", None) is None:
        return contextlib.nullcontext()
    return tuc.set_checkpoint_debug_enabled(None)
