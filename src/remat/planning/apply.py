"""``remat.apply`` / ``remat.remove`` / ``remat.auto``: put a plan on a model, in place and reversibly.

Blocks are checkpointed by giving the module an instance-level ``forward``
(``remat.wrap``), never by inserting wrapper modules, so ``state_dict()`` keys,
``named_parameters()`` and ``named_modules()`` are unchanged.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace
from typing import Any

from torch import nn

from remat.core._conflicts import check_no_double_checkpointing
from remat.core._hf import disable_cache, restore_cache
from remat.core._segment import schedule_segments, unschedule
from remat.core._state import capture
from remat.core.checkpoint import is_wrapped, unwrap, wrap
from remat.core.measure import measure_peak
from remat.errors import RematError
from remat.planning.plan import Plan, parse_budget, plan as make_plan
from remat.profiling._format import human_bytes
from remat.profiling._blocks import find_blocks
from remat.profiling.profile import profile as make_profile

__all__ = ["apply", "auto", "remove"]

log = logging.getLogger("remat")

#: Re-plans ``auto`` makes with a measured margin before it gives up.
REPLANS = 2


def _mode(training: bool) -> str:
    return "training" if training else "eval"


def _warn_mode(model: nn.Module, plan: Plan) -> None:
    if plan.training is None or plan.training == model.training:
        return
    warnings.warn(
        f"remat.apply: the plan was made from a profile in {_mode(plan.training)} mode, but this "
        f"{type(model).__name__} is in {_mode(model.training)} mode; dropout and BatchNorm change what the blocks "
        f"keep, so its predicted peak holds only in {_mode(plan.training)} mode. Profile in the mode you train in "
        "(remat.profile(..., training=True), the default) or switch the model with model.train().",
        stacklevel=3,
    )


def apply(model: nn.Module, plan: Plan) -> nn.Module:
    """Checkpoint ``model``'s blocks as ``plan`` says; all or nothing. Returns ``model``.

    Warns when the plan was made in training mode and the model is in eval mode now, or
    the other way round: the plan's predicted peak holds in the mode it was made in.
    """
    if not isinstance(plan, Plan):
        raise RematError(f"remat.apply: expected a remat.Plan, got {type(plan).__name__}; make one with remat.plan(...).")
    _put(model, plan)
    _warn_mode(model, plan)
    return model


def _put(model: nn.Module, plan: Plan) -> None:
    modules = dict(model.named_modules())
    missing = sorted(n for n in plan.assignment if n not in modules)
    if missing:
        raise RematError(
            f"remat.apply: the plan names modules this {type(model).__name__} does not have: {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; was the plan made for another model?"
        )
    check_no_double_checkpointing(model, plan.checkpointed, api="remat.apply")
    for module in model.modules():
        unschedule(module)
    done: list[nn.Module] = []
    try:
        for name, policy in plan.assignment.items():
            if policy != "keep":
                wrap(modules[name], policy=policy)
                done.append(modules[name])
            elif is_wrapped(modules[name]):
                unwrap(modules[name])
        schedule_segments(model, list(plan.assignment), plan.segments)
    except Exception:
        for module in done:
            unwrap(module)
        raise
    if plan.checkpointed:
        disable_cache(model)


def remove(model: nn.Module) -> nn.Module:
    """Undo every remat checkpointing on ``model`` (``apply``, ``auto`` or ``wrap``). Returns ``model``."""
    for module in model.modules():
        unschedule(module)
        unwrap(module)
    restore_cache(model)
    return model


def auto(
    model: nn.Module, inputs: Any, budget: Any, *, loss_fn: Any = None, verify: bool = True, **profile_options: Any
) -> Plan:
    """Profile, plan for ``budget`` and apply, in one call. Returns the plan applied.

    ``inputs`` is what the model is called with: a tensor, a tuple, or a dict such as
    the batch a data loader yields (labels included: a Hugging Face model then
    returns ``output.loss``, which remat uses). ``profile_options`` go to
    :func:`remat.profile` (``blocks``, ``repeat``, ``training``, ``fake`` ...).

    NOTE [Verify when it can]
    The peak model is exact on chains of blocks; data flow it does not follow (a
    block's output used by the loss, tensors shared by every block) can make a plan
    peak higher than predicted. With ``verify`` (the default, real tensors only),
    auto measures one real step with the plan applied. Over the budget, it re-plans
    with the measured error as a margin (at most ``REPLANS`` times), then tries the
    lowest-peak plan; if none fits, it removes the plan and raises a RematError with
    the measured numbers. ``plan.measured_peak_bytes`` holds the figure; fake-tensor
    plans are not measured (``plan.verified`` is False).

    Nothing is applied when profiling, planning or verification fails.
    """
    check_no_double_checkpointing(model, find_blocks(model, profile_options.get("blocks")), api="remat.auto")
    remove(model)
    disable_cache(model)
    try:
        prof = make_profile(model, inputs, loss_fn, **profile_options)
        if verify and not prof.fake:
            chosen = _verified_plan(model, inputs, loss_fn, prof, budget)
        else:
            chosen = make_plan(prof, budget)
            _put(model, chosen)
    except Exception:
        remove(model)
        raise
    if not chosen.checkpointed:
        restore_cache(model)
    return chosen


def _measured(model: nn.Module, inputs: Any, loss_fn: Any, plan: Plan) -> int:
    """Peak of one real step with ``plan`` applied, in the plan's mode; the model is restored after."""
    _put(model, plan)
    state = capture(model)
    try:
        if plan.training is not None:
            model.train(plan.training)
        peak, _, _ = measure_peak(model, inputs, loss_fn)
    finally:
        state.restore()
    return peak


def _verified_plan(model: nn.Module, inputs: Any, loss_fn: Any, prof: Any, budget: Any) -> Plan:
    limit = parse_budget(budget, prof.baseline_peak_bytes)
    target, margin, notes, tried = limit, 0, [], []
    for _ in range(REPLANS + 1):
        try:
            candidate = make_plan(prof, target)
        except RematError:
            break  # the margin leaves no plan: only the lowest-peak plan is left to try
        measured = _measured(model, inputs, loss_fn, candidate)
        tried.append((candidate, measured))
        if measured <= limit:
            return replace(candidate, budget_bytes=limit, measured_peak_bytes=measured, notes=tuple(notes))
        margin = max(margin, measured - candidate.predicted_peak_bytes)
        notes.append(
            f"A plan predicted at {human_bytes(candidate.predicted_peak_bytes)} measured "
            f"{human_bytes(measured)}, over the budget: re-planned with a margin of {human_bytes(margin)}."
        )
        log.warning("remat.auto: %s", notes[-1])
        target = limit - margin
    lowest = make_plan(prof, strategy="none")
    lowest = make_plan(prof, lowest.min_peak_bytes)
    measured = next((m for p, m in tried if p.assignment == lowest.assignment), None)
    if measured is None:
        measured = _measured(model, inputs, loss_fn, lowest)
    if measured <= limit:
        notes.append("The lowest-peak plan fits the budget.")
        return replace(lowest, budget_bytes=limit, measured_peak_bytes=measured, notes=tuple(notes))
    remove(model)
    raise RematError(
        f"remat.auto: budget {human_bytes(limit)} ({limit} bytes, {limit / prof.baseline_peak_bytes:.3f} of the "
        f"{human_bytes(prof.baseline_peak_bytes)} peak without checkpointing) cannot be met: the lowest-peak plan "
        f"measured {human_bytes(measured)} ({measured} bytes) in a real step (predicted "
        f"{human_bytes(lowest.predicted_peak_bytes)}). Raise the budget to at least {measured} bytes, or lower the "
        "batch size / sequence length."
    )
