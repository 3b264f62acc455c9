"""The keyword options of ``torch.utils.checkpoint.checkpoint``, as ``remat.checkpoint`` reads them.

NOTE [torch's keyword names are remat's]
torch's ``checkpoint`` consumes ``use_reentrant``, ``context_fn``, ``determinism_check``,
``debug``, ``early_stop`` and ``preserve_rng_state`` and hands every other keyword to
the function; ``remat.checkpoint`` does the same, so a call written for torch means the
same under remat. Each option is either honoured with remat's guarantees or refused
with a RematError, never dropped:

* ``use_reentrant``: ``False``/``None`` accepted (remat is always non-reentrant);
  ``True`` refused: the reentrant implementation is what freezes a block's
  parameters when no input requires grad.
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
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.utils.checkpoint as tuc

from remat.errors import RematError

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
        raise RematError(
            f"remat.checkpoint: context_fn must be a function returning two context managers, got "
            f"{type(context_fn).__name__}; e.g. functools.partial(create_selective_checkpoint_contexts, policy_fn)."
        )
    pair = context_fn()
    if not (isinstance(pair, tuple) and len(pair) == 2 and all(hasattr(c, "__enter__") for c in pair)):
        raise RematError(
            f"remat.checkpoint: context_fn() must return (forward context, recompute context), got "
            f"{type(pair).__name__}; see torch.utils.checkpoint.create_selective_checkpoint_contexts."
        )
    forward, recompute = pair
    if isinstance(forward, tuc._CachingTorchDispatchMode) and isinstance(recompute, tuc._CachedTorchDispatchMode):
        if policy not in (None, "full"):
            raise RematError(
                f"remat.checkpoint: both policy={policy!r} and a selective context_fn were given; they decide the "
                "same thing. Pass one: policy=... (remat's) or context_fn=... (torch's)."
            )
        return forward.policy_fn, CallOptions(allow_cache_entry_mutation=recompute.allow_cache_entry_mutation)
    return policy, CallOptions(contexts=(forward, recompute))


def read_torch_options(
    policy: Any,
    *,
    use_reentrant: bool | None,
    context_fn: Callable[[], Any] | None,
    determinism_check: str,
    debug: bool | None,
    early_stop: bool | None,
) -> tuple[Any, CallOptions]:
    """The policy and options a torch-style call means (NOTE above); RematError for what remat refuses."""
    if (use_reentrant is None and context_fn is None and determinism_check == "default" and debug is None
            and early_stop is None and not getattr(tuc, "_checkpoint_debug_enabled", None)):
        return policy, DEFAULT  # every block call of an applied plan: no checks, no new options object
    if use_reentrant not in (None, False):
        raise RematError(
            f"remat.checkpoint: use_reentrant={use_reentrant!r} is refused: remat is always non-reentrant, because "
            "the reentrant implementation gives a block's parameters no gradient when no input requires grad. "
            "Drop the argument (or pass use_reentrant=False)."
        )
    if determinism_check not in _DETERMINISM:
        raise RematError(
            f"remat.checkpoint: determinism_check={determinism_check!r}; torch accepts {_DETERMINISM}."
        )
    for name, value in (("early_stop", early_stop), ("debug", debug)):
        if value is not None and not isinstance(value, bool):
            raise RematError(f"remat.checkpoint: {name} must be True, False or None, got {value!r}.")
    if _debug_requested(debug):
        _warn_debug()
    options = DEFAULT
    if context_fn is not None and context_fn is not tuc.noop_context_fn:
        policy, options = _from_context_fn(context_fn, policy)
    return policy, CallOptions(
        contexts=options.contexts,
        allow_cache_entry_mutation=options.allow_cache_entry_mutation,
        determinism_check=determinism_check,
        early_stop=early_stop,
    )


def no_torch_debug() -> contextlib.AbstractContextManager[Any]:
    """torch's global debug switch off for remat's own call (NOTE above: it would refuse remat's context_fn)."""
    if getattr(tuc, "_checkpoint_debug_enabled", None) is None:
        return contextlib.nullcontext()
    return tuc.set_checkpoint_debug_enabled(None)
