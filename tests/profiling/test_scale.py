"""A profile carried to another batch size from two real ones (remat.profiling._scale)."""

from __future__ import annotations

import pytest

import remat
from remat.profiling._scale import profile_at_batch
from remat.zoo import build

OPTS = dict(layers=3, hidden=64, heads=4, vocab=256, seq=32, dropout=0.0)


def _profile(batch: int) -> remat.Profile:
    zoo = build("gpt2", **OPTS, batch=batch)
    return remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, blocks=list(zoo.blocks), repeat=1, warmup=0)


@pytest.fixture(scope="module")
def profiles():
    return {b: _profile(b) for b in (2, 4, 7)}


def test_scaled_profile_predicts_a_third_batch(profiles):
    # Every byte count is affine in the batch on GPT-2: interpolated and extrapolated
    # predictions equal the real profile's for every uniform and mixed assignment.
    names = [b.name for b in profiles[2].blocks]
    assignments = [
        {},
        {n: "full" for n in names},
        {n: "selective" for n in names},
        dict(zip(names, ["full", "keep", "selective"])),
    ]
    for b1, b2, target in [(2, 7, 4), (2, 4, 7)]:
        scaled = profile_at_batch(profiles[b1], b1, profiles[b2], b2, target)
        for a in assignments:
            real, predicted = profiles[target].predict_peak(a), scaled.predict_peak(a)
            assert abs(predicted - real) <= 0.005 * real, (b1, b2, target, a, predicted, real)
        assert "scaled to batch" in scaled.notes[-1]


def test_scaling_needs_two_batches_of_the_same_model(profiles):
    with pytest.raises(remat.RematError, match="two different batch sizes"):
        profile_at_batch(profiles[2], 2, profiles[2], 2, 4)
    other = build("gpt2", **{**OPTS, "layers": 2}, batch=4)
    two_layers = remat.profile(other.model, other.inputs, other.loss_fn, repeat=1, warmup=0)
    with pytest.raises(remat.RematError, match="same blocks"):
        profile_at_batch(profiles[2], 2, two_layers, 4, 3)
