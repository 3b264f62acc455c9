"""The compiled chain peak model (remat.planning._compiled): fit, and the profile the planner sees."""

import itertools

import pytest

import remat
from remat.planning._compiled import ChainFit, chain_profile, design, fit, is_chain
from remat.planning._synthetic import synthetic_profile

POLICIES = ("keep", "selective", "full")
#: Bytes of the chain fitted to the 3-block GPT-2 of test_compiled_auto.py under aot_eager: negative
#: ``during`` and ``head`` (a backward that frees before it peaks) included.
TRUTH = ChainFit(
    saved={"keep": 3_088_000, "selective": 2_067_000, "full": 882_000},
    during={"keep": -1_370_000, "selective": -983_000, "full": 967_000},
    left=920_000,
    head=-1_326_000,
    margin=0,
    worst_error=0.0,
)


def _all(n):
    return list(itertools.product(POLICIES, repeat=n))


@pytest.mark.parametrize("n", [3, 5, 8])
def test_fit_from_the_design_predicts_every_assignment(n):
    resting = 10**6
    measured = {a: TRUTH.predict(a, resting) for a in design(POLICIES, n)}
    assert len(measured) == 15 and ("keep",) * n in measured and ("full",) * n in measured
    fitted = fit(measured, resting)
    assert all(fitted.predict(a, resting) >= v for a, v in measured.items())  # the margin: never below its data
    errors = [abs(fitted.predict(a, resting) - TRUTH.predict(a, resting)) / TRUTH.predict(a, resting) for a in _all(n)]
    assert max(errors) < 0.03, max(errors)


def test_chain_profile_predicts_what_the_chain_does_and_the_planner_meets_it():
    prof = synthetic_profile(4)
    assert is_chain(prof)
    fitted = ChainFit(**{**TRUTH.__dict__, "margin": 12_345})
    chained = chain_profile(prof, fitted, label="compiled (test)")
    names = [b.name for b in prof.blocks]
    for a in _all(4):
        assert chained.predict_peak(dict(zip(names, a))) == fitted.predict(a, prof.resting_bytes)
    assert "compiled (test)" in chained.notes[-1]
    keep_all = fitted.predict(("keep",) * 4, prof.resting_bytes)
    lowest = min(fitted.predict(a, prof.resting_bytes) for a in _all(4))
    assert remat.plan(chained, strategy="none", nested=False).min_peak_bytes == lowest
    for fraction in (0.9, 0.5, 0.0):
        budget = int(lowest + fraction * (keep_all - lowest))
        plan = remat.plan(chained, budget, nested=False)
        assert plan.baseline_peak_bytes == keep_all
        assert plan.predicted_peak_bytes == fitted.predict(tuple(plan.assignment.values()), prof.resting_bytes)
        assert plan.predicted_peak_bytes <= budget


def test_a_block_called_twice_is_not_a_chain():
    prof = synthetic_profile(3)
    name = prof.blocks[0].name
    prof.fwd_order.append(("fwd", name, 1))
    assert not is_chain(prof)
    assert chain_profile(prof, TRUTH, label="x") is None
