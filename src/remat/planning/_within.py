"""The profile a plan for a budget is made on, running no real step over that budget.

``remat.auto``, ``remat.distributed.auto`` and the command line's ``plan``/``profile --budget``
all profile through :func:`profile_within`; the command line passes its own ``run`` (a progress line
around the same ``remat.profile`` call).

NOTE [Within the budget]
On a device where the step without checkpointing does not fit, any step run over the
budget would die of OutOfMemoryError before a plan is made; on a larger device it would
still hold more than the user allowed. So the profile is first made on fake tensors,
which allocate nothing (memory exact: on the CPU the same bytes as a real profile, the
roofline of the device's target for times). If that profile's step without
checkpointing fits the budget, the real profile runs as it always did. Otherwise the
plan is made on the fake profile: a real profile runs every policy uniformly and always
the ``keep`` step, its baseline, which is over the budget, and a profile without it
would have no baseline for the peak model; the price is step times from the roofline
rather than measured ones. A real profile that runs out of memory is a step over the
budget too (NOTE [Out of memory is an answer] in remat.planning._verify_step): the profile
restored the model, its tensors are collected, the allocator's cache is emptied, and
the plan is made on the fake one. A model fake tensors cannot run is profiled for real,
as before, and the log says so. auto then verifies with real steps only plans predicted
within the budget, the lowest-peak one first (NOTE [The step verified plans are compared
with]).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from remat.core._memtrack import empty_device_cache
from remat.core.measure import device_of
from remat.errors import OutOfMemory, RematError
from remat.planning._verify_step import out_of_memory_reason
from remat.planning.plan import parse_budget
from remat.profiling._format import human_bytes
from remat.profiling._types import Profile
from remat.profiling.profile import profile as make_profile
from remat.profiling.targets import get_target

__all__ = ["OVER_THE_BUDGET", "RAN_OUT", "Within", "device_target", "profile_within", "with_memory_beside"]

log = logging.getLogger("remat")

#: ``Within.fake_because``: the fake profile's step without checkpointing is over the budget.
OVER_THE_BUDGET = "over the budget"
#: ``Within.fake_because``: the real profile ran out of device memory.
RAN_OUT = "ran out of device memory"


@dataclass(frozen=True)
class Within:
    """A profile to plan on, and why it is on fake tensors when it is."""

    profile: Profile
    fake_because: str | None = None
    """None: measured (or fake because the caller asked); else OVER_THE_BUDGET or RAN_OUT."""
    budget_bytes: int | None = None
    """The budget in bytes, as a fraction of the fake profile's peak when it was one (None: no fake profile)."""


Run = Callable[[dict[str, Any]], Profile]


def profile_within(
    model: nn.Module,
    inputs: Any,
    loss_fn: Any,
    budget: Any,
    *,
    api: str,
    options: dict[str, Any],
    run: Run | None = None,
    counted: Callable[[Profile], Profile] | None = None,
    fake_options: dict[str, Any] | None = None,
    agreed: Callable[[bool], bool] = bool,
) -> Within:
    """The profile to plan ``budget`` on (NOTE [Within the budget]).

    ``options`` go to :func:`remat.profile`; ``run(options)`` makes a profile (default: ``remat.profile`` on
    ``model``); ``counted`` adds to a profile what it does not see (DDP's buckets) before it is compared with
    the budget. With ``budget`` None or ``fake`` in ``options``, the one profile asked for is made.
    ``fake_options`` go to the fake profile only (auto traces ``full-fine`` there ahead of need). A budget of
    the whole peak without checkpointing (a share of 1 or more) runs the real profile first: it fits, and
    a fake profile is made only if it runs out of memory. ``agreed(over)``: whether the step without
    checkpointing is over the budget anywhere, given whether it is here (ranks that profile together must
    all run the real profile or none: NOTE [Ranks agree on the real profile] in remat.distributed).
    """
    if run is None:

        def run(opts: dict[str, Any]) -> Profile:
            return make_profile(model, inputs, loss_fn, **opts)

    if budget is None or options.get("fake"):
        return Within(run(options))
    timed = {k: v for k, v in options.items() if k not in ("warmup", "repeat")}  # a fake step is not timed
    fake_run = {**timed, **(fake_options or {}), "fake": True, "target": device_target(model, inputs)}
    share = _share(budget)
    if share is not None and share >= 1:
        try:
            return Within(run(options))
        except torch.OutOfMemoryError as exc:  # NOTE [Out of memory is an answer]
            reason = out_of_memory_reason(exc)
        gc.collect()
        empty_device_cache()
        log.warning("%s: the real profile ran out of device memory (%s): planned on fake tensors.", api, reason)
        fake = _beside_the_model(run(fake_run), model, inputs)
        return Within(fake, RAN_OUT, parse_budget(budget, fake.baseline_peak_bytes))
    try:
        fake = _beside_the_model(run(fake_run), model, inputs)
    except RematError as exc:
        log.info("%s: fake tensors cannot run this model (%s): profiled on real tensors.", api, exc)
        return Within(_real_profile(run, options, api, exc))
    peak = (counted(fake) if counted is not None else fake).baseline_peak_bytes
    limit = parse_budget(budget, peak)
    if agreed(peak > limit):
        log.info(
            "%s: the step without checkpointing (%s) is over the budget %s: planned on fake tensors.",
            api,
            human_bytes(peak),
            human_bytes(limit),
        )
        return Within(fake, OVER_THE_BUDGET, limit)
    try:
        return Within(run(options), None, limit)
    except torch.OutOfMemoryError as exc:  # NOTE [Out of memory is an answer]; the profile restored the model
        reason = out_of_memory_reason(exc)
    gc.collect()
    empty_device_cache()
    log.warning("%s: the real profile ran out of device memory (%s): planned on fake tensors.", api, reason)
    return Within(fake, RAN_OUT, limit)


def _real_profile(
    run: Callable[[dict[str, Any]], Profile], options: dict[str, Any], api: str, why: RematError
) -> Profile:
    """The real profile made because fake tensors cannot run the model (``why``); its out-of-memory error says so,
    where the generic one would send the user back to the fake profile that failed."""
    try:
        return run(options)
    except torch.OutOfMemoryError as exc:
        raise OutOfMemory(
            f"{api}: fake tensors cannot run this model, so it was profiled on real tensors, and the step without "
            f"checkpointing ran out of device memory ({out_of_memory_reason(exc)}). The model was restored. Why fake "
            f"tensors cannot: {why} Lower the batch size until that step fits, or keep that part of the forward "
            "from reading tensor values while remat plans."
        ) from exc


# NOTE [Memory beside the model on the GPU]
# On CUDA a real profile counts its resting bytes as the allocator does (NOTE [Peaks as the
# allocator counts them]): the model's tensors, the libraries' workspaces, and whatever else
# the process holds there (another model, an EMA copy, a test's reference gradients), since
# all of it shares the device. A fake profile sees the model's tensors and its target's
# library bytes (``persistent_bytes``) only, so where the step runs on the GPU beside more, its
# plans were predicted low by that much and ran out. A fake profile made for the GPU the model
# is on therefore takes what the allocator holds beyond the model's tensors now, where that
# is more than the library bytes it counted. (Before any step, the libraries have allocated
# nothing yet and their bytes stay counted; after one, they are part of what is held.)


def _beside_the_model(fake: Profile, model: nn.Module, inputs: Any) -> Profile:
    """``fake`` with the memory the process holds beside the model on its GPU (NOTE [Memory beside the model on
    the GPU]); unchanged off CUDA."""
    device = device_of(model, inputs)
    if device.type != "cuda" or fake.target is None:
        return fake
    cuda = get_target(fake.target).cuda
    gc.collect()  # tensors only reference cycles hold are not beside the model: they go at the next collection
    return with_memory_beside(fake, torch.cuda.memory_allocated(device), cuda.persistent_bytes if cuda else 0)


def with_memory_beside(fake: Profile, allocated: int, library_bytes: int) -> Profile:
    """``fake``, whose resting bytes count ``library_bytes`` for its target's libraries, on a device whose
    allocator holds ``allocated`` bytes now: what is held beyond the model's resting tensors, where that is more
    than ``library_bytes``, is added to its resting bytes."""
    beside = allocated - (fake.resting_bytes - library_bytes)
    if beside <= library_bytes:
        return fake
    added = beside - library_bytes
    note = (
        f"The GPU holds {human_bytes(beside)} beside the model's tensors (its libraries' workspaces and other "
        f"tensors of the process): {human_bytes(added)} added to the fake profile's resting bytes."
    )
    return replace(fake, resting_bytes=fake.resting_bytes + added, notes=[*fake.notes, note])


def _share(budget: Any) -> float | None:
    """The share of the peak without checkpointing a relative budget (``0.6``, ``"60%"``) asks for; None for
    bytes."""
    big = 1 << 50
    share = parse_budget(budget, big)
    return None if share == parse_budget(budget, 2 * big) else share / big


def device_target(model: nn.Module, inputs: Any) -> str:
    """The fake profile's target for the device the model runs on: its kernels, workspaces and roofline."""
    device = device_of(model, inputs)
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    # an unknown GPU takes the H100's kernel choices; verification measures what they miss
    return "a100" if "a100" in name else "h100"
