"""What a plan must be before remat puts it on a model: well-formed fields, and made for this model.

NOTE [A plan names the blocks of one model]
A plan is a policy per block name of the model it was profiled on. Names alone can
match another model (every GPT-2 has ``transformer.h.0``), so the plan also records the
model's class and its parameter count; ``remat.apply`` compares both and every name
before it changes anything. The root cannot be a block (checkpointing the whole step
recomputes everything and saves nothing), blocks cannot nest, and a lone torch layer
(a Linear, a ReLU, a norm) saves nothing: its own backward keeps what checkpointing keeps.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from remat.core._policy_registry import NAMES
from remat.errors import RematError
from remat.profiling._blocks import check_block_modules, check_disjoint

_INT, _FLOAT, _STR, _BOOL = "an integer", "a number", "a string", "true or false"
#: field -> (what it must be, may it be null)
_FIELDS = {
    "predicted_peak_bytes": (_INT, False),
    "baseline_peak_bytes": (_INT, False),
    "min_peak_bytes": (_INT, False),
    "budget_bytes": (_INT, True),
    "measured_peak_bytes": (_INT, True),
    "parameters": (_INT, True),
    "predicted_overhead": (_FLOAT, False),
    "strategy": (_STR, False),
    "model": (_STR, False),
    "training": (_BOOL, True),
}


def _is(value: Any, kind: str) -> bool:
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if kind == _FLOAT:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, str if kind == _STR else bool)


def _field_error(name: str, value: Any, want: str) -> RematError:
    return RematError(
        f"remat.Plan.from_json: field {name!r} is {value!r} ({type(value).__name__}); it must be {want}. "
        "Save plans with plan.to_json() and load them unchanged."
    )


def check_plan_fields(data: dict[str, Any]) -> None:
    """A RematError naming the first field of a loaded plan that is not what ``Plan.to_json`` writes."""
    for name, (kind, nullable) in _FIELDS.items():
        if name in data and not (data[name] is None and nullable) and not _is(data[name], kind):
            want = ("a non-negative " if kind == _INT else "") + kind + (" or null" if nullable else "")
            raise _field_error(name, data[name], want)
    for name in ("notes", "unchained", "without_grad"):
        value = data.get(name, [])
        if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
            raise _field_error(name, value, "a list of strings")
    if data.get("execution", "eager") not in ("eager", "compiled"):
        raise _field_error("execution", data["execution"], '"eager" or "compiled"')
    segments = data.get("segments", [])
    if not isinstance(segments, (list, tuple)) or not all(
        isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(n, str) for n in pair)
        for pair in segments
    ):
        raise _field_error("segments", segments, 'a list of [first block, last block] pairs, e.g. [["0", "3"]]')
    assignment = data["assignment"]
    if not isinstance(assignment, dict):
        raise _field_error("assignment", assignment, 'an object of block name -> policy, e.g. {"layers.0": "full"}')
    bad = {b: p for b, p in assignment.items() if p not in NAMES}
    if bad:
        raise RematError(
            f"remat.Plan.from_json: field 'assignment' has unknown policies {bad}; use "
            f"{', '.join(NAMES[:-1])} or {NAMES[-1]}."
        )
    _refuse_root(assignment, "remat.Plan.from_json: field 'assignment'")
    check_disjoint(list(assignment), api="remat.Plan.from_json: field 'assignment':")


def _refuse_root(assignment: dict[str, str], api: str) -> None:
    if "" in assignment:
        raise RematError(
            f"{api} names the root module ''; a plan checkpoints blocks inside the model (the "
            "whole step recomputed saves nothing). Name the blocks (e.g. 'layers.0') instead."
        )


def check_plan_fits(model: nn.Module, plan: Any) -> None:
    """A RematError unless ``plan`` was made for ``model`` (NOTE above); nothing is changed."""
    # FSDP2's fully_shard makes the class FSDP<Name>, a subclass: a plan made on the sharded
    # model fits the unsharded one, and the other way round.
    names = {cls.__name__ for cls in type(model).__mro__}
    what = type(model).__name__
    if plan.model and plan.model not in names and plan.model.removeprefix("FSDP") not in names:
        inside = [n for n, m in model.named_modules() if n and type(m).__name__ == plan.model]
        hint = (
            f" It is inside this one at {inside[0]!r}: apply the plan to that module."
            if inside
            else " A plan applies to the whole model it was profiled on, not to a part of it or another model; "
            "profile this one with remat.profile and plan again."
        )
        raise RematError(f"remat.apply: the plan was made for a {plan.model}, this model is a {what}.{hint}")
    modules = dict(model.named_modules())
    missing = sorted(n for n in plan.assignment if n not in modules)
    if missing:
        raise RematError(
            f"remat.apply: the plan names blocks this {what} does not have: {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; was the plan made for another model, or for a part of it?"
        )
    count = sum(p.numel() for p in model.parameters())
    if plan.parameters is not None and count != plan.parameters:
        raise RematError(
            f"remat.apply: the plan was made for a {plan.model} with {plan.parameters} parameters, this one has "
            f"{count}: another configuration (width, depth, vocabulary). Profile this model and plan again."
        )
    _refuse_root(plan.assignment, "remat.apply: the plan")
    check_disjoint(list(plan.assignment), api="remat.apply:")
    in_segments = _in_segments(plan)
    check_block_modules(model, [b for b in plan.checkpointed if b not in in_segments], api="remat.apply")


def _in_segments(plan: Any) -> set[str]:
    """Blocks inside the plan's nested segments: a lone layer there is recomputed with the run around it."""
    order = list(plan.assignment)
    index = {n: i for i, n in enumerate(order)}
    inside: set[str] = set()
    for first, last in plan.segments:
        if first in index and last in index:
            inside.update(order[index[first] : index[last] + 1])
    return inside
