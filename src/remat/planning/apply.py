"""``remat.apply`` / ``remat.remove`` / ``remat.auto``: put a plan on a model, in place and reversibly.

Blocks are checkpointed by giving the module an instance-level ``forward``
(``remat.wrap``), never by inserting wrapper modules, so ``state_dict()`` keys,
``named_parameters()`` and ``named_modules()`` are unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from remat.core._conflicts import check_no_double_checkpointing
from remat.core._hf import disable_cache, restore_cache
from remat.core.checkpoint import is_wrapped, unwrap, wrap
from remat.errors import RematError
from remat.planning.plan import Plan, plan as make_plan
from remat.profiling._blocks import find_blocks
from remat.profiling.profile import profile as make_profile

__all__ = ["apply", "auto", "remove"]

def apply(model: nn.Module, plan: Plan) -> nn.Module:
    """Checkpoint ``model``'s blocks as ``plan`` says; all or nothing. Returns ``model``."""
    if not isinstance(plan, Plan):
        raise RematError(f"remat.apply: expected a remat.Plan, got {type(plan).__name__}; make one with remat.plan(...).")
    modules = dict(model.named_modules())
    missing = sorted(n for n in plan.assignment if n not in modules)
    if missing:
        raise RematError(
            f"remat.apply: the plan names modules this {type(model).__name__} does not have: {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; was the plan made for another model?"
        )
    check_no_double_checkpointing(model, plan.checkpointed, api="remat.apply")
    done: list[nn.Module] = []
    try:
        for name, policy in plan.assignment.items():
            if policy != "keep":
                wrap(modules[name], policy=policy)
                done.append(modules[name])
            elif is_wrapped(modules[name]):
                unwrap(modules[name])
    except Exception:
        for module in done:
            unwrap(module)
        raise
    if plan.checkpointed:
        disable_cache(model)
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo every remat checkpointing on ``model`` (``apply``, ``auto`` or ``wrap``). Returns ``model``."""
    for module in model.modules():
        unwrap(module)
    restore_cache(model)
    return model


def auto(model: nn.Module, inputs: Any, budget: Any, *, loss_fn: Any = None, **profile_options: Any) -> Plan:
    """Profile, plan for ``budget`` and apply, in one call. Returns the plan applied.

    ``profile_options`` go to :func:`remat.profile` (``blocks``, ``repeat`` ...).
    Nothing is applied when profiling or planning fails.
    """
    check_no_double_checkpointing(model, find_blocks(model, profile_options.get("blocks")), api="remat.auto")
    remove(model)
    disable_cache(model)
    try:
        chosen = make_plan(make_profile(model, inputs, loss_fn, **profile_options), budget)
    except Exception:
        restore_cache(model)
        raise
    apply(model, chosen)
    if not chosen.checkpointed:
        restore_cache(model)
    return chosen
