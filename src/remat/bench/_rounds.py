"""Interleaved timing rounds: every candidate once per round, in a shuffled order.

On a shared CPU a training step's time drifts by 10-15% from one moment to the
next. Timing candidates one after another lets that drift decide the
comparison; interleaving them puts every candidate through the same drift, and
comparing them round by round (ratios or differences within a round) cancels
most of it.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from remat.core._step import LossFn, training_step
from remat.errors import RematError

Progress = Callable[[str, int, int], None]
"""``progress(description, completed, total)``: how the bench reports progress (after each
round here); the CLI's progress bar (``remat.cli._ui.Ui.progress``) is one."""


def interleaved_rounds(
    timed: Sequence[Callable[[], float]],
    *,
    warmup: int,
    repeat: int,
    label: str = "timing",
    progress: Progress | None = None,
) -> list[list[float]]:
    """Per candidate, the seconds it reported in each of ``repeat`` rounds after ``warmup`` rounds.

    Each candidate is a callable that runs one step and returns the seconds that
    step took (setting up and tearing down around it is not timed). Round ``r``
    calls them in an order shuffled with seed ``r``, so reruns repeat it.
    """
    if warmup < 0 or repeat < 1:
        raise RematError(
            f"remat: timing needs warmup >= 0 and at least one timed round, got warmup={warmup}, "
            f"repeat={repeat}; pass a positive number of rounds."
        )
    times: list[list[float]] = [[] for _ in timed]
    order = list(range(len(timed)))
    for r in range(warmup + repeat):
        random.Random(r).shuffle(order)
        for i in order:
            seconds = timed[i]()
            if r >= warmup:
                times[i].append(seconds)
        if progress:
            progress(f"{label} round {r + 1}/{warmup + repeat}", r + 1, warmup + repeat)
    return times


def ratio_to(times: Sequence[float], reference: Sequence[float]) -> float:
    """Median over rounds of a candidate's time over the reference's time in the same round."""
    return statistics.median(a / b for a, b in zip(times, reference, strict=True))


def timed_step(
    model: nn.Module,
    inputs: Any,
    loss_fn: LossFn | None,
    *,
    on: Callable[[], None] | None = None,
    off: Callable[[], None] | None = None,
) -> Callable[[], float]:
    """A candidate for :func:`interleaved_rounds`: one training step of ``model``, timed.

    ``on``/``off`` run around it, untimed (installing and removing a setup).
    """

    def step() -> float:
        if on is not None:
            on()
        try:
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            training_step(model, inputs, loss_fn)
            return time.perf_counter() - start
        finally:
            if off is not None:
                off()

    return step
