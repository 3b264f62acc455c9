"""Synthetic chain profiles, for testing the solver and timing it at sizes no CPU model reaches."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import replace

from remat.core._policy_registry import FULL, KEEP, SELECTIVE
from remat.profiling._types import BlockProfile, Key, Profile, SegmentCost

_POLICIES = (KEEP, SELECTIVE, FULL)


def synthetic_profile(n_blocks: int, *, seed: int = 0, resting: int = 10**8) -> Profile:
    """A chain of ``n_blocks`` transformer-like blocks with randomised sizes and times."""
    rng = random.Random(seed)
    names = [f"layers.{i}" for i in range(n_blocks)]
    segments: dict[str, dict[Key, SegmentCost]] = {p: {} for p in _POLICIES}
    fwd_order: list[Key] = [("fwd", None, 0)]
    bwd_order: list[Key] = [("bwd", None, 0)]
    blocks = []
    out_bytes = 2**20
    for p in _POLICIES:
        segments[p][("fwd", None, 0)] = SegmentCost(out_bytes, out_bytes, 0.001)
    for name in names:
        saved = {KEEP: rng.randint(8, 16) * 2**20, SELECTIVE: 0, FULL: 0}
        saved[SELECTIVE] = saved[KEEP] // rng.randint(2, 4)
        grads = rng.randint(1, 4) * 2**20
        fwd_s = rng.uniform(0.01, 0.03)
        extra = {KEEP: 0.0, SELECTIVE: fwd_s * rng.uniform(0.2, 0.5), FULL: fwd_s}
        for p in _POLICIES:
            kept = saved[p] + out_bytes
            segments[p][("fwd", name, 0)] = SegmentCost(kept, kept + 2**20, fwd_s)
            # Backward: recomputation rebuilds what was not kept; everything is freed at the end.
            segments[p][("bwd", name, 0)] = SegmentCost(grads - kept, saved[KEEP] - saved[p] + 2**21, 2 * fwd_s)
        fwd_order.append(("fwd", name, 0))
        blocks.append(
            BlockProfile(
                name, out_bytes, out_bytes, saved, fwd_s, 2 * fwd_s, extra, 10**9, {p: 2 * 10**9 for p in _POLICIES}
            )
        )
    for p in _POLICIES:
        segments[p][("fwd", None, 1)] = SegmentCost(4 * 2**20, 8 * 2**20, 0.002)
        segments[p][("bwd", None, 0)] = SegmentCost(-(2**20), 4 * 2**20, 0.004)
    fwd_order.append(("fwd", None, 1))
    bwd_order.extend(("bwd", name, 0) for name in reversed(names))
    return Profile(
        model="Synthetic",
        device="cpu",
        blocks=tuple(blocks),
        resting_bytes=resting,
        param_bytes=resting,
        grad_bytes=resting,
        step_time_s=sum(b.fwd_time_s + b.bwd_time_s for b in blocks),
        policies=_POLICIES,
        fwd_order=fwd_order,
        bwd_order=bwd_order,
        segments=segments,
    )


def fixed_times(profile: Profile, seconds: Mapping[str, float]) -> Profile:
    """``profile`` with every block's extra time under each policy set to ``seconds[policy]``: plans made from it
    do not depend on the machine's timings (a test can then know which plan the planner picks)."""
    blocks = tuple(replace(b, extra_time_s={p: float(seconds[p]) for p in b.extra_time_s}) for b in profile.blocks)
    return replace(profile, blocks=blocks)
