"""Plans not solved for: the hand-made strategies of ``remat.plan`` (``none``, ``all``, ``selective``, ``sqrt``,
``every:K``) and the greedy plan for profiles whose blocks are not a simple chain."""

from __future__ import annotations

import math

from remat.core._policy_registry import FULL, KEEP, NAMES, SELECTIVE
from remat.errors import RematError
from remat.planning._solve import kept_one_level
from remat.profiling._types import Profile

__all__ = ["greedy", "hand_made", "kept_blocks"]


def hand_made(profile: Profile, strategy: str) -> dict[str, str]:
    """The hand-made ``strategy``'s plan, its lone layers and blocks run without gradients kept (NOTE [A lone layer
    is kept one level deep] in remat.planning._solve)."""
    kept = kept_blocks(profile)
    return {n: p for n, p in _strategy_plan(profile, strategy).items() if n not in kept}


def _strategy_plan(profile: Profile, strategy: str) -> dict[str, str]:
    names = [b.name for b in profile.blocks]
    if strategy == "none":
        return {}
    if strategy in ("all", SELECTIVE):  # the strategy "selective": every block the policy
        policy = FULL if strategy == "all" else SELECTIVE
        return {n: policy for n in names}
    if strategy.startswith("every:"):
        try:
            k = int(strategy.split(":", 1)[1])
        except ValueError:
            k = 0
        if k >= 1:
            return {n: FULL for i, n in enumerate(names) if i % k == 0}
    if strategy == "sqrt":
        # torch's checkpoint_sequential keeps only segment boundaries; per block, the
        # closest equivalent recomputes ceil(sqrt(n)) evenly spaced blocks fully.
        k = max(1, round(len(names) / math.ceil(math.sqrt(len(names)))))
        return {n: FULL for i, n in enumerate(names) if i % k == 0}
    raise RematError(
        f"remat.plan: unknown strategy {strategy!r}; use 'optimal', 'none', 'all', 'selective', 'sqrt' or 'every:K'."
    )


def kept_blocks(profile: Profile) -> set[str]:
    """The blocks a plan keeps one level deep (NOTE [A lone layer is kept one level deep] and NOTE [A block run
    without gradients is kept] in remat.planning._solve)."""
    return {b.name for b in profile.blocks if kept_one_level(b)}


def greedy(profile: Profile, budget: float) -> dict[str, str] | None:
    """For profiles that are not a simple chain: add the cheapest bytes-per-second step until it fits."""
    assignment: dict[str, str] = {}
    order, kept = list(NAMES), kept_blocks(profile)
    while profile.predict_peak(assignment) > budget:
        current = profile.predict_peak(assignment)
        best = None
        for b in profile.blocks:
            if b.name in kept:
                continue
            now = assignment.get(b.name, KEEP)
            for p in order[order.index(now) + 1 :]:
                if p not in profile.policies:
                    continue
                trial = {**assignment, b.name: p}
                gain = current - profile.predict_peak(trial)
                cost = b.extra_time_s[p] - b.extra_time_s[now] + 1e-9
                if gain > 0 and (best is None or gain / cost > best[0]):
                    best = (gain / cost, trial)
        if best is None:
            return None
        assignment = best[1]
    return assignment
