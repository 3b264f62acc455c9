"""Putting a plan's checkpointing on a model and taking it off again: all or nothing."""

from __future__ import annotations

from torch import nn

from remat.core._compiled import eager_module, prepare_compile
from remat.core._conflicts import check_no_double_checkpointing
from remat.core._fine import FINE, unwrap_fine, wrap_fine
from remat.core._hf import disable_cache, restore_cache
from remat.core._policy_registry import KEEP
from remat.core._segment import schedule_segments, unschedule
from remat.core.checkpoint import unwrap, wrap
from remat.planning._plan_checks import check_plan_fits
from remat.planning.plan import Plan
from remat.profiling._traced import install_from_names, is_traced_plan, uninstall

__all__ = ["applied_budget", "put", "remove"]


def put(model: nn.Module, plan: Plan) -> None:
    """Checkpoint ``model``'s blocks as ``plan`` says; on any failure (an interrupt too) nothing stays on."""
    # NOTE [Segments own nothing]: a traced model's segments are rebuilt from the plan's names
    installed = is_traced_plan(plan.assignment) and install_from_names(model, plan.assignment, training=plan.training)
    prepare_compile()  # segments alone wrap nothing, and the model may be compiled before its first eager call
    try:
        _put(model, plan)
    except BaseException:
        if installed:
            uninstall(model)
        raise


def _put(model: nn.Module, plan: Plan) -> None:
    check_plan_fits(model, plan)
    modules = dict(model.named_modules())
    check_no_double_checkpointing(model, plan.checkpointed, api="remat.apply")
    for module in model.modules():
        unschedule(module)
    done: list[nn.Module] = []
    try:
        for name, policy in plan.assignment.items():
            done.append(modules[name])
            unwrap_fine(modules[name])
            if policy == FINE:
                wrap_fine(modules[name])
            elif policy != KEEP:
                wrap(modules[name], policy=policy)
        schedule_segments(model, list(plan.assignment), plan.segments, plan.unchained)
    except BaseException:
        for module in done:
            unschedule(module)
            unwrap_fine(module)
        raise
    if plan.checkpointed:
        disable_cache(model)
    if plan.budget_bytes is not None:
        eager_module(model).__dict__[_BUDGET] = plan.budget_bytes
    else:
        eager_module(model).__dict__.pop(_BUDGET, None)


#: Where a model keeps the budget of the plan put on it (``applied_budget``).
_BUDGET = "_remat_plan_budget"


def applied_budget(model: nn.Module) -> int | None:
    """The budget, in bytes, of the plan ``remat.apply`` or ``remat.auto`` put on ``model``; None: none put, or a
    plan without a budget. The doctor weighs the plan's checkpoints against it."""
    return eager_module(model).__dict__.get(_BUDGET)


def remove(model: nn.Module) -> nn.Module:
    """Undo every remat checkpointing on ``model`` (``apply``, ``auto`` or ``wrap``). Returns ``model``."""
    eager_module(model).__dict__.pop(_BUDGET, None)
    for module in eager_module(model).modules():
        unschedule(module)
        unwrap(module)
    uninstall(eager_module(model))
    restore_cache(model)
    return model
