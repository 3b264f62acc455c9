"""remat.bench._rounds: interleaved timing rounds and per-round ratios."""

from __future__ import annotations

import pytest

from remat.bench._rounds import interleaved_rounds, ratio_to
from remat.errors import RematError


def _recorder(calls: list[str], name: str, seconds: float):
    def step() -> float:
        calls.append(name)
        return seconds

    return step


def test_every_candidate_once_per_round_in_a_seeded_shuffled_order():
    calls: list[str] = []
    names = "abcde"
    timed = [_recorder(calls, n, i + 1.0) for i, n in enumerate(names)]
    times = interleaved_rounds(timed, warmup=2, repeat=6)
    rounds = [calls[i : i + len(names)] for i in range(0, len(calls), len(names))]
    assert len(rounds) == 8 and all(sorted(r) == list(names) for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1, "the order should change between rounds"
    assert times == [[i + 1.0] * 6 for i in range(len(names))]  # warm-up rounds dropped
    again: list[str] = []
    interleaved_rounds([_recorder(again, n, 0.0) for n in names], warmup=2, repeat=6)
    assert again == calls  # seeded: a rerun repeats the order


def test_ratio_is_the_median_of_per_round_ratios():
    # A drift that doubles every step's time in the last rounds cancels within each round.
    reference = [1.0, 1.0, 2.0, 2.0, 2.0]
    candidate = [1.1, 1.2, 2.2, 2.4, 2.2]
    assert ratio_to(candidate, reference) == pytest.approx(1.1)
    with pytest.raises(ValueError):
        ratio_to([1.0], [1.0, 2.0])


def test_progress_reports_each_round():
    seen = []
    interleaved_rounds(
        [lambda: 0.0],
        warmup=1,
        repeat=2,
        label="m: timing",
        progress=lambda msg, done, total: seen.append((msg, done, total)),
    )
    assert seen == [("m: timing round 1/3", 1, 3), ("m: timing round 2/3", 2, 3), ("m: timing round 3/3", 3, 3)]


@pytest.mark.parametrize(("warmup", "repeat"), [(-1, 3), (1, 0)])
def test_bad_round_counts_are_an_error(warmup, repeat):
    with pytest.raises(RematError, match="at least one timed round"):
        interleaved_rounds([lambda: 0.0], warmup=warmup, repeat=repeat)
