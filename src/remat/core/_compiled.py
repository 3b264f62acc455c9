"""remat's checkpoint under ``torch.compile``: torch's checkpoint higher-order operator.

NOTE [Under torch.compile]
remat's eager primitive (a region with a dispatch mode, saved-tensor hooks and a
holder object, ``remat.core.checkpoint``) cannot be traced by dynamo. A call made
while dynamo traces (``torch.compiler.is_compiling()``) therefore goes to torch's
non-reentrant checkpoint with a selective-checkpoint ``context_fn`` made from remat's
policy: dynamo records it as its ``tag_activation_checkpoint`` operator, AOT autograd
tags every op of the block with the policy's decision, and the partitioner saves what
is tagged to be saved and recomputes the rest in the backward graph. The block
compiles with the model: no graph break, ``fullgraph=True`` works.

What remat's region guarantees in eager holds here by construction of the compiled
graph, not by remat's code (each is tested in tests/core/test_compiled.py):

* buffers (BatchNorm's running statistics): the forward graph writes them once; the
  recomputed copy of the write in the backward graph has no user and is dropped.
* random ops: torch ignores ``preserve_rng_state`` under compile and always
  functionalizes the RNG of every recomputed random op (``run_and_save_rng_state``
  in the forward graph, ``run_with_rng_state`` in the backward graph, one state per
  op). A random op the policy saves is simply not rerun, and since every recomputed
  op carries its own state, the others draw the same masks: the rule of NOTE [A saved
  random op must still advance the generator] holds without remat's ledger.
* autocast and keyword arguments are traced like any other code.

A backend that runs dynamo's graph as Python (``backend="eager"``; ``torch._dynamo.explain``)
runs the operator itself with torch's eager checkpoint: not a fallback (the block was
traced), and there a block that writes a buffer (BatchNorm) fails in backward with a
version-counter error, exactly as torch's own checkpoint does under that backend. Train
with ``aot_eager`` or inductor (the default).

``remat.is_recomputing()`` is never true inside a compiled block (recompute is part of
the backward graph, no Python runs), and the region's check of in-place writes to the
block's inputs does not exist here: torch's functionalization handles such writes.

NOTE [Python side effects in a compiled block]
A block whose Python code writes state outside itself is refused by torch's checkpoint
operator under dynamo by default ("HOP: Unsafe side effect"), since the eager checkpoint
reruns that code in backward and a compiled backward cannot: transformers 5.25 routes
Llama's attention through the ``kernels`` package's ``use_kernelized_func``, which sets and
resets a module-global context variable on every call, and every checkpointed Llama layer
ran eagerly (a 3-layer Llama: 4 graph breaks; torch's own checkpoint: 3). A recomputation
that does again what its forward did is what remat's region exists to prevent (buffers,
generators), and torch's ``skip_fwd_side_effects_in_bwd_under_checkpoint`` applies such
writes once, in the forward: so remat turns it on when it first checkpoints anything in
eager code (``remat.wrap``, ``remat.apply``, an eager ``remat.checkpoint``). It is a
process-wide dynamo setting, which torch's own checkpoint then follows too.

No silent eager fallback: when dynamo cannot trace a block (a graph break inside
it), it runs torch's checkpoint eagerly, which would update buffers twice. The
``context_fn`` sees that (it is called outside compilation) and stops the call before
anything ran; the block then runs with remat's eager primitive, every eager guarantee
kept, and remat warns once per block with dynamo's reason.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)
from torch.utils.checkpoint import (
    checkpoint as _torch_checkpoint,
)

__all__ = ["run_compiled", "eager_module", "prepare_compile", "runs_compiled"]


class _NotTraced(Exception):
    """torch's checkpoint was about to run eagerly: dynamo gave up tracing the block."""


def _recompute_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _in_traced_operator() -> bool:
    # A backend that runs dynamo's graph as Python (backend="eager", torch._dynamo.explain)
    # runs the traced operator with torch's eager checkpoint, inside preserve_node_meta.
    import torch.fx.traceback as fx_traceback

    return torch.compiler.is_compiling() or fx_traceback.has_preserved_node_meta()


def _contexts(policy_fn: Callable[..., Any] | None) -> tuple[Any, Any]:
    # Called by torch while AOT autograd traces the checkpoint operator, or by torch's
    # eager checkpoint after a graph break in the block: see the NOTE.
    if not _in_traced_operator():
        raise _NotTraced
    return create_selective_checkpoint_contexts(policy_fn or _recompute_everything)


def _block_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _dynamo_reason() -> str:
    """The first line of dynamo's latest graph-break reason that is not remat's own disabled region."""
    from torch._dynamo.utils import counters

    reasons = [r for r in counters["graph_break"] if "remat" not in r and "torch.compiler" not in r]
    return reasons[-1].strip().splitlines()[0] if reasons else "unknown (set TORCH_LOGS=graph_breaks to see it)"


#: Blocks already warned about (by qualified name): one warning per block and process.
_WARNED: set[str] = set()


def _warn_not_traced(fn: Callable) -> None:
    name = _block_name(fn)
    if name in _WARNED:
        return
    _WARNED.add(name)
    warnings.warn(
        f"remat.checkpoint: torch.compile could not trace {name} (dynamo: {_dynamo_reason()}). It runs eagerly "
        "with remat's own checkpoint, every guarantee kept, and the model around it is compiled in pieces "
        "(graph breaks). Remove the graph break inside the block to compile it whole.",
        stacklevel=4,
    )


def _not_context_fn_notice(record: logging.LogRecord) -> bool:
    return "context_fn is passed to torch.utils.checkpoint under torch.compile" not in str(record.msg)


def prepare_compile() -> None:
    """Settle, once per process, what torch.compile needs of remat's blocks.

    Drops torch's one-time log line about ``context_fn`` under compile (in-place ops in the region): remat
    passes a ``context_fn`` for every block, and in-place ops inside a compiled block are functionalized and
    tested (tests/core/test_compiled.py), so the line only worries the user. Lets a block's Python side effects
    be applied once, in forward (NOTE [Python side effects in a compiled block]). Called from eager code (wrap,
    an eager checkpoint): either, done while dynamo traces, would be a graph break.
    """
    global _prepared
    if _prepared:  # once per process: getLogger on every block call is measurable host time
        return
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    if _not_context_fn_notice not in logger.filters:
        logger.addFilter(_not_context_fn_notice)
    import torch._dynamo.config as dynamo_config

    if hasattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    _prepared = True


_prepared = False


def run_compiled(
    fn: Callable,
    policy_fn: Callable[..., Any] | None,
    args: tuple,
    kwargs: dict,
    *,
    eager: Callable[[], Any],
) -> Any:
    """``fn(*args, **kwargs)`` as torch's checkpoint operator under dynamo; ``eager()`` if it cannot be traced.

    ``policy_fn`` is the selective-checkpoint policy (None: recompute everything).
    """
    try:
        return _torch_checkpoint(
            fn, *args, use_reentrant=False, context_fn=functools.partial(_contexts, policy_fn), **kwargs
        )
    except _NotTraced:
        _warn_not_traced(fn)
        return eager()


def eager_module(model: Any) -> Any:
    """The module a ``torch.compile(model)`` wrapper runs (its ``_orig_mod``); ``model`` itself otherwise.

    remat puts plans on that module: the wrapper's names carry an ``_orig_mod.`` prefix
    the plan does not have, and dynamo guards on each block's ``forward``, so the next
    compiled call recompiles with the plan's checkpointing.
    """
    from torch._dynamo.eval_frame import OptimizedModule

    return model._orig_mod if isinstance(model, OptimizedModule) else model


# NOTE [A compiled step is counted without a dispatch mode]
# Dynamo does not compile a frame it meets under a Python dispatch mode, and it remembers the skip
# on the frame's code: ``remat.measure(torch.compile(model), x)`` counted the step under the storage
# tracker, and from then on that model, and any new ``torch.compile`` of its class, ran eagerly with
# no warning (other dropout masks, other speed) until ``torch._dynamo.reset()``. A model that runs
# compiled code (a ``torch.compile`` wrapper, or a submodule compiled in place) is counted from the CPU
# allocator's reports instead (remat.core.measure), as ``compiled_peak`` counts one: the compiled step, no mode.
def runs_compiled(model: torch.nn.Module) -> bool:
    from torch._dynamo.eval_frame import OptimizedModule

    return any(
        isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()
    )
