"""Plans not solved for: the hand-made strategies of ``remat.plan`` (``none``, ``all``, ``selective``, ``sqrt``,
``every:K``), the greedy plan for profiles whose blocks are not a simple chain, and the floor's descent.

NOTE [The one-level floor descends on the peak model]
The lowest one-level peak is the least, under the full peak model (``Profile.predict_peak``), of the
uniform plans and the DP's lowest-peak plan. The DP sees each block's own segments only: what the model
adds beside them (a block returning an aux loss recomputed at the start of the backward, storages across
blocks) can make its lowest plan other than the model's, and a profile that is no chain has no DP at
all. A generated chain [plain, aux loss + in-place ReLU, plain] had its floor at 152,952 B (the DP's
plan) while a plan the DP did not pick predicts and measures 136,568 B, the least of all 64. So the best
of those plans then moves one block to another allowed policy while the model predicts a lower peak
(ties: less time), round after round (at most three; a round is n x P predictions, 0.6 ms each on a 48-block GPT-2).
Above 256 blocks the floor stays the best of those plans: a round over 1,000 blocks takes 10 s (3.2 ms a
prediction), and such profiles are the loops of one function, plain chains the DP solves exactly.
"""

from __future__ import annotations

import math

from remat.core._policy_registry import FULL, KEEP, NAMES, SELECTIVE
from remat.errors import RematError
from remat.planning._solve import kept_one_level
from remat.profiling._types import Profile

__all__ = ["descended", "greedy", "hand_made", "kept_blocks"]

_DESCENT_ROUNDS = 3
_DESCENT_BLOCKS = 256


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


def descended(profile: Profile, assignment: dict[str, str]) -> tuple[int, dict[str, str]]:
    """(predicted peak, plan): ``assignment`` with one block's policy changed while that predicts a lower peak
    (NOTE [The one-level floor descends on the peak model])."""
    kept = kept_blocks(profile)

    def scored(a: dict[str, str]) -> tuple[int, float, dict[str, str]]:
        return profile.predict_peak(a), profile.predict_time(a), a

    best = scored(assignment)
    for _ in range(_DESCENT_ROUNDS if len(profile.blocks) <= _DESCENT_BLOCKS else 0):
        lower = best
        for b in profile.blocks:
            if b.name in kept:
                continue
            now = best[2].get(b.name, KEEP)
            for p in profile.policies:
                if p != now and (trial := scored({**best[2], b.name: p}))[:2] < lower[:2]:
                    lower = trial
        if lower is best:
            break
        best = lower
    return best[0], best[2]
