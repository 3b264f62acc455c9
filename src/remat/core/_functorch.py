"""A checkpointed call inside a ``torch.func`` transform.

NOTE [Under torch.func transforms]
Inside ``vmap``, ``jvp`` or ``functionalize`` a tensor is a wrapper with no storage of
its own, and a region watches storages (NOTE [What recomputation must not repeat] in
``remat.core._region``): remat's checkpoint failed there with "Cannot access storage of
BatchedTensorImpl", where torch's runs. Inside ``grad``, ``vjp``, ``jacrev`` or
``hessian`` torch's checkpoint cannot run at all: those transforms refuse saved-tensor
hooks, which checkpointing is made of.

So under a transform that only maps or pushes tangents forward, the call runs as torch's
own non-reentrant checkpoint with the same policy and options, and does what torch's
does there. What remat adds on top (buffers written once per step, in-place writes to
inputs) rests on storages and does not apply; a BatchNorm that updates its statistics is
refused by ``vmap`` itself. Under a transform that differentiates, the call raises
:class:`remat.errors.TransformError` naming the way out, instead of torch's
"don't yet support saved tensor hooks".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from remat.core._contexts import policy_contexts
from remat.core._torch_options import CallOptions
from remat.errors import TransformError

_DIFFERENTIATING = ("Grad",)
"""functorch's transform types that differentiate (``vjp``, ``jacrev`` and ``hessian`` run as ``Grad``)."""


def active_transforms() -> tuple[str, ...]:
    """The names of the ``torch.func`` transforms the current call runs under, outermost first."""
    stack = getattr(torch._C._functorch, "get_interpreter_stack", lambda: None)()
    return tuple(interpreter.key().name for interpreter in stack) if stack else ()


def run_under_transform(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    transforms: tuple[str, ...],
    *,
    policy_fn: Callable[..., Any] | None,
    preserve_rng_state: bool,
    options: CallOptions,
) -> Any:
    """``fn(*args, **kwargs)`` checkpointed as torch would under ``transforms`` (NOTE [Under torch.func
    transforms]), with ``policy_fn`` (None: full) as torch's own selective checkpoint."""
    if any(name in _DIFFERENTIATING for name in transforms):
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise TransformError(
            f"remat.checkpoint: {name} was called inside torch.func.grad (or vjp, jacrev, hessian; transforms "
            f"{' > '.join(transforms)}), where no checkpoint can run: torch.func refuses the saved-tensor hooks "
            "that checkpointing is made of, and torch.utils.checkpoint fails there too. Call it without "
            "checkpointing inside the transform: remat.unwrap(module) for a wrapped module, remat.remove(model) "
            "for a plan, or the undecorated function."
        )
    return _torch_checkpoint(
        functools.partial(fn, **kwargs),  # every keyword is fn's: none may reach torch as an option
        *args,
        use_reentrant=False,
        preserve_rng_state=preserve_rng_state,
        # torch's own selective checkpoint: remat's random-stream ledger reads generator states, which a transform
        # wraps (NOTE in remat.core._rng); remat's policies recompute random ops rather than keep them.
        context_fn=functools.partial(policy_contexts, policy_fn, preserve_rng_state, options, ledger=False),
        **options.torch_kwargs(),
    )
