"""remat under ``torch.distributed``: one plan for every rank, memory counted per rank.

NOTE [Memory per rank under FSDP2 and DDP]
FSDP2 (``fully_shard`` per block, then on the root): profiling the sharded model
on every rank gives the per-rank accounting for free.
remat's storage tracker counts real storages, so parameters are their local
shards (1/N, padded), a block's parameters are counted from their all-gather to
their reshard (the unsharded working set, including FSDP's prefetch of the next
block in backward), and gradients from their reduce-scatter on are 1/N. Predicted
and measured per-rank peaks agree exactly (see ``tests/planning/test_distributed.py``).
Every rank profiles: each has its own shards, and a real step runs collectives.

DDP keeps one more copy of the gradients in its communication buckets, alive
for the whole step. They are allocated when DDP is built, so no tracked op
creates them; ``remat.measure`` finds them when the reducer first writes them and
counts them as resting (``remat.core._memtrack``, NOTE [Resting storages nobody
listed]). For planning, the unwrapped module is profiled (exact, and no
collectives, so only rank 0 does it) and ``ddp=True`` adds the buckets, one copy
of the gradients, to its resting bytes.

NOTE [One plan for every rank]
Timings differ between ranks (and between runs), so plans made independently
can differ even for identical models, and ranks that checkpoint different blocks
still train correctly but no longer have the memory the plan promised. Rank 0
plans; every rank receives the same plan as JSON. Errors on rank 0 (a budget
below the minimum) are sent too, so every rank raises instead of waiting forever.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from remat.core._conflicts import check_no_double_checkpointing
from remat.errors import RematError
from remat.planning._budget import Unreachable
from remat.planning._within import profile_within
from remat.planning.apply import FINEST, apply, may_go_finer, noted_finer, remove
from remat.planning.plan import Plan
from remat.planning.plan import plan as make_plan
from remat.profiling._blocks import find_blocks
from remat.profiling._types import Profile

__all__ = ["auto", "is_sharded", "plan_on_rank0"]

log = logging.getLogger("remat")


def is_sharded(model: nn.Module) -> bool:
    """True when ``model`` or a submodule is sharded with FSDP2's ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _with_ddp_buckets(profile: Profile) -> Profile:
    note = f"DDP gradient buckets ({profile.grad_bytes} bytes) added to the resting bytes."
    return replace(profile, resting_bytes=profile.resting_bytes + profile.grad_bytes, notes=[*profile.notes, note])


def _group_rank(group: Any) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _plan_here(profile: Profile | Callable[[], Profile], budget: Any, strategy: str, ddp: bool) -> Plan:
    prof = profile() if callable(profile) else profile
    if not isinstance(prof, Profile):
        raise RematError(
            f"remat.distributed.plan_on_rank0: expected a remat.Profile or a function returning one, "
            f"got {type(prof).__name__}."
        )
    prof = _with_ddp_buckets(prof) if ddp else prof
    return make_plan(prof, budget, strategy=strategy)  # Unreachable below the floor, sent as its own kind


def plan_on_rank0(
    profile: Profile | Callable[[], Profile],
    budget: Any = None,
    *,
    group: Any = None,
    strategy: str = "optimal",
    ddp: bool = False,
) -> Plan:
    """Plan on rank 0 of ``group`` and return that same plan on every rank.

    Args:
        profile: a :class:`remat.Profile` (only rank 0's is used), or a function
            that returns one, called on rank 0 only (for an unsharded model,
            whose profile needs no collectives).
        budget: per-rank budget, as for :func:`remat.plan`; a fraction is of rank 0's
            per-rank peak without checkpointing.
        group: the process group (default: the whole world).
        strategy: as for :func:`remat.plan`.
        ddp: the model is (or will be) trained in ``DistributedDataParallel``:
            count its gradient buckets, one more copy of the gradients, as resting.

    Every rank of ``group`` must call it. Without an initialised process group
    it plans locally, so the same script runs with or without ``torchrun``.
    """
    if not dist.is_initialized():
        return _plan_here(profile, budget, strategy, ddp)
    message: list[Any] = [None]
    failure: BaseException | None = None
    if _group_rank(group) == 0:
        try:
            message[0] = ("plan", _plan_here(profile, budget, strategy, ddp).to_json())
        except Exception as exc:  # sent to the other ranks, re-raised here below
            kind = "unreachable" if isinstance(exc, Unreachable) else "error"
            failure, message[0] = exc, (kind, f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(message, group=group, group_src=0)
    if failure is not None:
        raise failure
    kind, payload = message[0]
    if kind != "plan":
        error = Unreachable if kind == "unreachable" else RematError
        raise error(f"remat.distributed.plan_on_rank0: planning failed on rank 0: {payload}")
    return Plan.from_json(payload)


def auto(
    model: nn.Module, inputs: Any, budget: Any, *, loss_fn: Any = None, group: Any = None, **profile_options: Any
) -> Plan:
    """:func:`remat.auto` for distributed training: the same plan applied on every rank.

    ``model`` is as it is trained: wrapped in ``DistributedDataParallel`` (its
    module is profiled on rank 0 and its buckets counted), sharded with FSDP2's
    ``fully_shard`` (profiled on every rank, so that parameters, gradients and
    all-gathers count per rank), or plain (profiled on rank 0). ``budget`` is per
    rank. No rank runs a step over it where some plan fits it: the step without
    checkpointing is profiled on fake tensors first. Every rank of ``group`` must call it.
    """
    ddp = isinstance(model, DistributedDataParallel)
    target = model.module if isinstance(model, DistributedDataParallel) else model  # narrows to DDP's module
    check_no_double_checkpointing(
        target, find_blocks(target, profile_options.get("blocks")), api="remat.distributed.auto"
    )
    remove(target)

    sharded = is_sharded(target)

    def run(options: dict) -> Profile:
        # NOTE [Ranks profile within the budget]
        counted = _with_ddp_buckets if ddp else None
        agreed = functools.partial(_anywhere, group=group) if sharded else bool
        return profile_within(
            target,
            inputs,
            loss_fn,
            budget,
            api="remat.distributed.auto",
            options=options,
            counted=counted,
            agreed=agreed,
        ).profile

    def planned(options: dict) -> Plan:
        profile = run(options) if sharded else functools.partial(run, options)
        return plan_on_rank0(profile, budget, group=group, ddp=ddp)

    try:
        chosen = planned(profile_options)
    except Unreachable:  # on every rank alike: NOTE [Finer only when needed] in remat.planning.apply
        if not may_go_finer(target, None, None, profile_options):
            raise
        chosen = noted_finer(planned({**profile_options, "policies": FINEST}), FINEST, "profiled again with")
    apply(target, chosen)
    return chosen


def _anywhere(here: bool, *, group: Any) -> bool:
    """Whether ``here`` holds on any rank of ``group`` (every rank must call it)."""
    if not dist.is_initialized():
        return here
    flag = [here]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, flag, group=group)
    return any(f[0] for f in everyone)


# NOTE [Ranks profile within the budget]
# A profile runs real steps, the step without checkpointing among them; on a device that
# step does not fit, it would die of out-of-memory (and leave the other ranks waiting).
# So the model is profiled within the budget as remat.auto does (NOTE [Within the budget]
# in remat.planning._within): on fake tensors first, DDP's buckets counted in the step
# without checkpointing, and for real only if that step fits. An unsharded model is
# profiled on rank 0 alone. A sharded model is profiled on every rank: its fake profile
# counts each rank's shards (NOTE [A sharded model on fake tensors] in
# remat.profiling._fsdp_fake) and runs no collective, so ranks make it on their own;
# its real profile runs collectives, so every rank must run it or none. The shards
# of ranks can differ in size (padding), so the step can be over the budget on one
# rank alone: the ranks agree to run the real profile only where it fits on all of them.
