"""``remat.plan``: the fastest choice of policy per block whose predicted peak fits a budget."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass
from typing import Any

from remat.core._policy_registry import FULL, FULL_FINE, KEEP, NAMES, SELECTIVE, SELECTIVE_OPS
from remat.errors import RematError
from remat.planning._budget import ACCEPTED_BUDGETS, Unreachable, parse_budget
from remat.planning._nested_plan import nested_floor, plan_nested
from remat.planning._plan_checks import check_plan_fields
from remat.planning._solve import cast_credits, chain_of, relax, solve
from remat.planning._strategies import descended, greedy, hand_made, kept_blocks
from remat.profiling._format import human_bytes, load_versioned
from remat.profiling._types import Profile

__all__ = ["Plan", "parse_budget", "plan"]

PLAN_SCHEMA = 3
_PLAN_SCHEMAS_READ = (
    1,
    2,
    3,
)  # 1: before training, measured_peak_bytes and notes; 2: before parameters, execution and segments


@dataclass(frozen=True)
class Plan:
    """A policy per block, with what the profile predicts for it."""

    assignment: dict[str, str]
    """Block name -> ``keep`` / ``selective`` / ``full``, for every profiled block."""
    predicted_peak_bytes: int
    """Peak of a training step under this plan, from the profile's peak model."""
    predicted_overhead: float
    """Extra step time as a fraction of the un-checkpointed step (0.25 = 25% slower)."""
    baseline_peak_bytes: int
    """Predicted (= profiled) peak without checkpointing."""
    min_peak_bytes: int
    """Lowest peak any plan reaches on this profile: the nested floor where nested plans apply (one level
    deep when planned with ``nested=False``)."""
    budget_bytes: int | None
    """The budget the plan was made for (None for hand-made strategies)."""
    strategy: str
    """``optimal`` or the hand-made strategy it reproduces."""
    model: str
    """Class name of the profiled model."""
    training: bool | None = None
    """The mode the profile ran in (True: training); apply warns when the model is in the other."""
    measured_peak_bytes: int | None = None
    """Peak of one real step with the plan applied, measured by ``remat.auto`` (None: not measured)."""
    notes: tuple[str, ...] = ()
    """What ``remat.auto`` did to make the plan fit (re-plans with a margin), in order."""
    parameters: int | None = None
    """Parameter elements of the profiled model; ``remat.apply`` refuses a model with another count
    (None: not recorded, in plans saved before remat recorded it)."""
    execution: str = "eager"
    """What the plan's budget was verified for: ``eager`` or ``compiled`` (``remat.auto(..., compiled=...)``)."""
    segments: tuple[tuple[str, str], ...] = ()
    """Nested plans: runs of consecutive blocks (first, last) checkpointed as one region, recomputed in
    backward with the blocks' own policies inside; ranges nest or are disjoint (``remat.planning._nested``)."""
    loop: str = ""
    """What the planned step holds beyond forward and backward (an optimizer's state and step, accumulated
    gradients: NOTE [The step a loop repeats]); empty: neither."""
    unchained: tuple[str, ...] = ()
    """Blocks whose output the profiled forward read outside the next block (a skip, a list the parent keeps,
    a write in place): ``remat.apply`` refuses a segment holding one (NOTE [What the parent does with a
    block's output] in remat.planning._nested), hand-made segments too."""
    without_grad: tuple[str, ...] = ()
    """Blocks every profiled forward of which ran with gradients off: they save nothing for backward, so every
    plan keeps them (NOTE [A block run without gradients is kept] in remat.planning._solve)."""

    @property
    def verified(self) -> bool:
        """True when a real step with this plan was measured within its budget."""
        return self.measured_peak_bytes is not None and (
            self.budget_bytes is None or self.measured_peak_bytes <= self.budget_bytes
        )

    @property
    def checkpointed(self) -> dict[str, str]:
        """Only the blocks that are not kept."""
        return {b: p for b, p in self.assignment.items() if p != KEEP}

    def summary(self) -> str:
        """One paragraph a user can read."""
        counts = {p: sum(1 for v in self.assignment.values() if v == p) for p in NAMES}
        budget = f" for a budget of {human_bytes(self.budget_bytes)}" if self.budget_bytes is not None else ""
        saved = 1 - self.predicted_peak_bytes / self.baseline_peak_bytes if self.baseline_peak_bytes else 0.0
        text = (
            f"{self.strategy} plan{budget} on {self.model}: {counts[FULL]} blocks full recompute, "
            + (f"{n} full with their sub-layers checkpointed, " if (n := counts[FULL_FINE]) else "")
            + f"{counts[SELECTIVE]} selective, "
            + (f"{counts[SELECTIVE_OPS]} selective op by op, " if counts[SELECTIVE_OPS] else "")
            + f"{counts[KEEP]} kept. Predicted peak "
            f"{human_bytes(self.predicted_peak_bytes)} ({saved:.0%} below {human_bytes(self.baseline_peak_bytes)} "
            f"without checkpointing) at +{self.predicted_overhead:.0%} step time."
        )
        if self.measured_peak_bytes is not None:
            verdict = "within the budget" if self.verified else "OVER the budget"
            text += f" Measured peak of one real step: {human_bytes(self.measured_peak_bytes)} ({verdict})."
        elif self.budget_bytes is not None and self.predicted_peak_bytes > self.budget_bytes:
            text += (
                f" Predicted OVER the budget by {human_bytes(self.predicted_peak_bytes - self.budget_bytes)}: "
                f"the {self.strategy} strategy does not look at the budget; the optimal one fits it."
            )
        if self.loop:
            text += f" Peaks include {self.loop}."
        text += "".join(f" {note}" for note in self.notes)
        if self.min_peak_bytes >= self.baseline_peak_bytes * 0.99:
            text += " No plan lowers this model's peak by more than 1%: " + no_saving_reason(
                self.without_grad, len(self.assignment)
            )
        return text

    def to_json(self) -> str:
        """Serialise, with a schema version."""
        return json.dumps({"schema": PLAN_SCHEMA, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Load and validate what :meth:`to_json` wrote."""
        data = load_versioned(text, what="remat.Plan.from_json", schema=_PLAN_SCHEMAS_READ)
        fields = set(cls.__dataclass_fields__)
        required = {n for n, f in cls.__dataclass_fields__.items() if f.default is MISSING}
        if not required <= set(data) <= fields:
            raise RematError(
                f"remat.Plan.from_json: expected fields {sorted(fields)}, got {sorted(data)}: missing "
                f"{sorted(required - set(data))}, unknown {sorted(set(data) - fields)}."
            )
        check_plan_fields(data)
        segments = tuple(tuple(pair) for pair in data.get("segments", ()))
        lists = {name: tuple(data.get(name, ())) for name in ("notes", "unchained", "without_grad")}
        return cls(**{**data, **lists, "segments": segments})


def no_saving_reason(without_grad: Sequence[str], blocks: int) -> str:
    """Why no plan lowers a model's peak, for a plan summary or a benchmark note."""
    if without_grad and len(without_grad) >= blocks:
        return (
            f"{'its block runs' if blocks == 1 else f'all {blocks} blocks run'} with gradients off (inside an "
            "autograd Function's forward, as reversible layers do, or under no_grad), so they save nothing for "
            "backward and checkpointing them frees nothing."
        )
    rebuilds = (
        "the peak is set where recomputation rebuilds the same tensors (typically inside the first block's backward)"
    )
    if not without_grad:
        return rebuilds + "."
    return (
        f"{rebuilds}, or inside the {len(without_grad)} of {blocks} blocks that run with gradients off (they save "
        "nothing for backward, so every plan keeps them)."
    )


def _with_cast_credits(profile: Profile, limit: int, safe: dict[str, str] | None) -> dict[str, str] | None:
    """Under autocast the chain's safe view keeps cached weight casts until backward, which can cost
    recomputation; solve again crediting their release (``_solve._Casts``) and keep the cheapest plan
    whose exact predicted peak fits. Without autocast casts: ``safe`` as it is."""
    candidates = [safe] if safe is not None else []
    for credit in cast_credits(profile)[1:]:
        chain = chain_of(profile, credit)
        if chain is None:  # the caller has a chain, and the credit does not change the blocks' order
            raise RuntimeError("a profile whose blocks form a chain gave no chain view with a cast credit")
        found = solve(chain, limit)
        if found is not None:
            trial = {b: chain.policies[j] for b, j in zip(chain.blocks, found[0])}
            if profile.predict_peak(trial) <= limit:
                candidates.append(trial)
    return min(candidates, key=profile.predict_time) if candidates else None


def _make(profile: Profile, assignment: dict[str, str], strategy: str, budget: int | None, minimum: int) -> Plan:
    full = {b.name: assignment.get(b.name, KEEP) for b in profile.blocks}
    extra = profile.predict_time(full) - profile.step_time_s
    return Plan(
        assignment=full,
        predicted_peak_bytes=profile.predict_peak(full),
        predicted_overhead=extra / profile.step_time_s if profile.step_time_s > 0 else 0.0,
        baseline_peak_bytes=profile.baseline_peak_bytes,
        min_peak_bytes=minimum,
        budget_bytes=budget,
        strategy=strategy,
        model=profile.model,
        training=profile.training,
        parameters=profile.parameters,
        loop=profile.loop,
        unchained=tuple(profile.unchained),
        without_grad=tuple(b.name for b in profile.blocks if b.without_grad),
    )


def _minimum(profile: Profile) -> tuple[int, dict[str, str]]:
    """The lowest predicted peak and a plan that reaches it (cached on the profile: planning
    several budgets on one profile solves for the minimum once)."""
    cached = profile.__dict__.get("_remat_minimum")
    if cached is None:
        cached = profile.__dict__["_remat_minimum"] = _solve_minimum(profile)
    return cached


def _solve_minimum(profile: Profile) -> tuple[int, dict[str, str]]:
    chain = chain_of(profile)
    names = [b.name for b in profile.blocks if b.name not in kept_blocks(profile)]
    candidates: list[dict[str, str]] = [{}]
    candidates += [{n: p for n in names} for p in NAMES if p != KEEP and p in profile.policies]
    if chain is not None:
        lowest = solve(chain, math.inf, minimise_peak=True)
        if lowest is None:
            raise RuntimeError("minimising the peak with no budget found no plan")
        picks, _ = lowest
        candidates.append({b: chain.policies[j] for b, j in zip(chain.blocks, picks)})
    best = min(((profile.predict_peak(a), a) for a in candidates), key=lambda t: t[0])
    return descended(profile, best[1])  # NOTE [The one-level floor descends on the peak model]


#: DP solves per plan when storages that cross blocks push a plan over its budget.
_RESOLVES = 4


def _solve_fitting(profile: Profile, chain: Any, limit: int) -> dict[str, str] | None:
    """The DP's plan, checked with the full peak model; tightened where it is over, then greedy.

    The DP sees each block's own segments only; a storage whose lifetime depends on
    other blocks' policies (NOTE [Storages across blocks]) can put its plan over the
    budget. Each re-solve lowers the DP's budget by the overshoot it missed; on chains
    the first solve fits and the plan is exact as before.
    """
    target = limit
    for _ in range(_RESOLVES):
        found = solve(chain, target)
        if found is None:
            break
        assignment = {b: chain.policies[j] for b, j in zip(chain.blocks, found[0])}
        peak = profile.predict_peak(assignment)
        if peak <= limit:
            return assignment
        target -= peak - limit
    return greedy(profile, limit)


def plan(profile: Profile, budget: Any = None, *, strategy: str = "optimal", nested: bool = True) -> Plan:
    """The plan of least predicted extra time whose predicted peak fits ``budget``.

    Args:
        profile: from :func:`remat.profile`.
        budget: a fraction ``0 < f <= 1`` of the peak without checkpointing
            (``0.5``, ``"0.5"``, ``"50%"``), bytes with a unit (``"6GiB"``, ``"500MB"``),
            or whole bytes of at least 1024 (:func:`parse_budget` has the one rule).
        strategy: ``"optimal"`` (needs a budget), or a hand-made choice to compare
            on the same footing: ``"none"``, ``"all"`` (full recompute everywhere),
            ``"selective"``, ``"sqrt"`` (ceil(sqrt(n)) evenly spaced blocks), ``"every:K"``.
        nested: below the lowest peak of one policy per block, checkpoint runs of blocks as nested
            segments (``Plan.segments``; blocks called as a chain, ``remat.planning._nested``);
            ``Plan.min_peak_bytes`` is then the nested floor. False: one level, its own minimum.

    For a chain of blocks the solver is a dynamic program that is exact up to a
    rounding of live bytes to 1/32768 of their range, always on the safe
    side (see ``remat.planning._solve``). Other structures use a greedy fallback.
    """
    if not isinstance(profile, Profile):
        raise RematError(f"remat.plan: expected a remat.Profile (from remat.profile), got {type(profile).__name__}.")
    one_level, lowest = _minimum(profile)
    minimum = _lowest_peak(profile, one_level) if nested else one_level
    if strategy != "optimal":
        return _make(
            profile,
            hand_made(profile, strategy),
            strategy,
            None if budget is None else parse_budget(budget, profile.baseline_peak_bytes),
            minimum,
        )
    if budget is None:
        raise RematError("remat.plan: the optimal strategy needs a budget; give " + ACCEPTED_BUDGETS + ".")
    baseline = profile.baseline_peak_bytes
    limit = parse_budget(budget, baseline)
    if limit < one_level and nested:
        found = _nested(profile, limit, minimum)
        if found is not None:
            return found
    if limit < one_level:
        raise (Unreachable if limit < minimum else RematError)(
            f"remat.plan: budget {human_bytes(limit)} ({limit} bytes, {limit / baseline:.3f} of the baseline) is "
            f"below the lowest peak any plan reaches on this profile: {human_bytes(minimum)} ({minimum} bytes, "
            f"{minimum / baseline:.3f} of the baseline {human_bytes(baseline)}). Raise the budget to at least "
            "that, or lower the batch size / sequence length"
            + (
                ""
                if FULL_FINE in profile.policies
                else ", or profile with policies=(..., 'full-fine') (each "
                "block's sub-layers checkpointed inside its recomputation: a lower floor; remat.auto does so itself)"
            )
            + "."
            + profile.held_by_loop()
        )
    chain = chain_of(profile)
    if chain is not None:
        assignment = _with_cast_credits(profile, limit, _solve_fitting(profile, chain, limit))
    else:
        assignment = greedy(profile, limit)
    if assignment is None:
        # Rounding refuses budgets within a grid cell per block of the minimum; the
        # lowest-peak plan fits them by definition.
        assignment = lowest
    return _make(profile, relax(profile, assignment, limit), "optimal", limit, minimum)


def _lowest_peak(profile: Profile, one_level: int) -> int:
    """The lowest predicted peak of any plan: one policy per block, or nested where the profile allows."""
    floor = nested_floor(profile)
    return min(one_level, floor[0]) if floor is not None else one_level


def _nested(profile: Profile, limit: int, minimum: int) -> Plan | None:
    """The fastest nested plan within ``limit`` (None: none fits)."""
    found = plan_nested(profile, limit)
    if found is None:
        return None
    assignment, segments, peak, extra = found
    # in the order blocks run: a segment's range is read from it (remat.core._segment), and a U-Net's blocks
    # run in another order than they are registered in
    order = dict.fromkeys([*(k[1] for k in profile.fwd_order if k[1] is not None), *(b.name for b in profile.blocks)])
    return Plan(
        assignment={name: assignment.get(name, KEEP) for name in order},
        predicted_peak_bytes=peak,
        predicted_overhead=extra / profile.step_time_s if profile.step_time_s > 0 else 0.0,
        baseline_peak_bytes=profile.baseline_peak_bytes,
        min_peak_bytes=minimum,
        budget_bytes=limit,
        strategy="optimal",
        model=profile.model,
        training=profile.training,
        parameters=profile.parameters,
        segments=segments,
        loop=profile.loop,
        unchained=tuple(profile.unchained),
        without_grad=tuple(b.name for b in profile.blocks if b.without_grad),
    )
