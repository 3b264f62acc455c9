"""The one-level floor's descent on the peak model (``remat.planning._strategies.descended``): the DP sees each
block's own segments only, and the floor is the lowest plan the full peak model knows of."""

from __future__ import annotations

import itertools

from _by_hand import measured_step, step_grads
from _generated import build, spec

import remat
from remat.planning._solve import chain_of, solve
from remat.planning._strategies import descended

# A block that returns an aux loss and starts with an in-place ReLU, between two plain blocks: checkpointed, it is
# recomputed at the start of the backward, which the DP does not see (NOTE [The one-level floor descends on the
# peak model]).
AUX_WRITER = spec([{}, {"aux": True, "relu_first": True}, {}])


def test_the_one_level_floor_is_the_lowest_plan_of_the_peak_model_where_the_dp_misses_it():
    model, x = build(AUX_WRITER)
    start = {n: b.clone() for n, b in model.named_buffers()}
    reference = step_grads(model, x, start)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    names = [b.name for b in prof.blocks]
    every = [prof.predict_peak(dict(zip(names, c))) for c in itertools.product(prof.policies, repeat=len(names))]
    chain = chain_of(prof)
    picks, _ = solve(chain, float("inf"), minimise_peak=True)
    dp = prof.predict_peak({b: chain.policies[j] for b, j in zip(chain.blocks, picks)})
    floor = remat.plan(prof, strategy="none", nested=False).min_peak_bytes
    assert floor == min(every) < dp  # the DP's lowest plan is above what the model knows (152,952 B vs 136,568)
    plan = remat.plan(prof, floor, nested=False)
    assert plan.predicted_peak_bytes == floor
    assert measured_step(model, x, plan, start, reference) <= plan.predicted_peak_bytes


def test_the_descent_never_raises_the_peak_and_stops_where_no_move_lowers_it():
    model, x = build(AUX_WRITER)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    names = [b.name for b in prof.blocks]
    for combo in itertools.product(prof.policies, repeat=len(names)):
        start = dict(zip(names, combo))
        peak, found = descended(prof, start)
        assert peak == prof.predict_peak(found) <= prof.predict_peak(start)
        again = descended(prof, found)
        assert again[0] == peak  # a local floor: no single block's move lowers it
