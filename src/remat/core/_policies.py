"""Checkpoint policies as values: the names a block can have and the selective-checkpoint policy
function each one runs, eager and under ``torch.compile``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from remat.core._policy_registry import FULL, KEEP, POLICIES, SELECTIVES
from remat.core._rng import draws_random
from remat.errors import RematError

__all__ = ["POLICIES", "SAVE_OPS", "policy_function", "compiled_policy_function"]

_aten = torch.ops.aten
#: Ops whose outputs the selective policy keeps: matmuls, convolutions, attention.
#: On CPU SDPA dispatches to the ``_for_cpu`` flash kernel (see measurements.md).
SAVE_OPS = frozenset(
    op
    for op in (
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten.convolution.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        getattr(_aten, "_scaled_dot_product_cudnn_attention", None)
        and _aten._scaled_dot_product_cudnn_attention.default,
    )
    if op is not None
)


def _save_compute_intensive(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# NOTE [Random ops under compile's selective]
# Eager "selective" keeps what a block's random submodules make (a dropout mask is cheaper to keep
# than to recompute: NOTE [Selective by module]). Under compile "selective" is torch's op-level
# selective checkpoint, which recomputed every random op from its own functionalized generator state:
# correct, but drawing random numbers again is real work (CPU generators draw element by element).
# It keeps them instead, as eager does (drawing them again made every block selective clearly slower on
# the ViT of benchmarks/compile_budget.py, which has dropout). A kept random op is also off the
# path of compiled recomputation of random ops (its own RNG stream on CUDA; pytorch/pytorch#198333).
# "full" recomputes everything, random ops included, as in eager.
def _save_compute_intensive_and_random(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS or draws_random(op) else CheckpointPolicy.PREFER_RECOMPUTE


def compiled_policy_function(policy: Any) -> Callable[..., Any] | None:
    """The selective-checkpoint policy of ``policy`` under compile (NOTE [Random ops under compile's selective])."""
    if isinstance(policy, str) and policy in SELECTIVES:
        return _save_compute_intensive_and_random
    return policy_function(policy)


def _overload(op: Any) -> Any:
    """The op overload a policy list names: a ``torch.library.custom_op`` stands for its only overload."""
    custom = getattr(getattr(torch, "_library", None), "custom_ops", None)
    if custom is not None and isinstance(op, custom.CustomOpDef):
        return op._opoverload
    return op


def _save_listed(ops: frozenset, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE


def policy_function(policy: Any) -> Callable[..., Any] | None:
    """The selective-checkpoint policy function of ``policy``; None for full recompute (or keep)."""
    if policy is None or (isinstance(policy, str) and policy in (FULL, KEEP)):
        return None
    if isinstance(policy, str) and policy in SELECTIVES:
        return _save_compute_intensive
    if isinstance(policy, (list, tuple, set, frozenset)):
        ops = [_overload(op) for op in policy]
        odd = [op for op in ops if not isinstance(op, torch._ops.OpOverload)]
        if odd:
            raise RematError(
                f"remat.checkpoint: a policy list holds aten op overloads to save, got {odd[0]!r} "
                f"({type(odd[0]).__name__}); name an overload, e.g. torch.ops.aten.mm.default."
            )
        return functools.partial(_save_listed, frozenset(ops))
    if callable(policy) and not isinstance(policy, str):
        return policy
    raise RematError(
        f"remat.checkpoint: unknown policy {policy!r}; use one of {', '.join(map(repr, POLICIES))}, a list of aten "
        "ops to save, or a torch selective-checkpoint policy function (ctx, op, *args, **kwargs)."
    )
