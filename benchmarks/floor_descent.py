"""What the two floor descents give on generated models: floors with and without them, measured.

The models are ``tests/planning/_generated.py``'s (2-5 blocks; aux losses, skips, a block called
twice, in-place ops, a tensor shared by all blocks, BatchNorm, dropout, frozen parts), drawn by
hypothesis derandomized, so a run sees the same ``--models`` every time. For each: one real
profile; the one-level floor (``nested=False``) and the nested floor with the descents (NOTE
[The one-level floor descends on the peak model] in ``remat/planning/_strategies.py``, NOTE [A
floor that does not follow the timings] in ``remat/planning/_nested_plan.py``) and with their
rounds set to 0 (on a copy of the profile without its cached floors); then each floor plan with
the descents applied, one step measured and its loss, gradients and buffers compared with an
un-checkpointed step (``torch.equal``). ``--write`` puts the table into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import _sections
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "planning"))
from _generated import build, features, model_specs, reference_step, same_step, train_step  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

import remat  # noqa: E402
from remat.planning import _nested_plan, _strategies  # noqa: E402


def specs(n: int) -> list[dict]:
    """``n`` distinct model specs, the same every run (hypothesis draws some twice)."""
    drawn: dict[str, dict] = {}

    @settings(
        max_examples=20 * n,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(model_specs())
    def draw(spec: dict) -> None:
        drawn.setdefault(repr(spec), spec)

    draw()
    return list(drawn.values())[:n]


@contextlib.contextmanager
def no_descent() -> Iterator[None]:
    """Both descents with no rounds (what the floors were before them)."""
    saved = _strategies._DESCENT_ROUNDS, _nested_plan._DESCENT_ROUNDS
    _strategies._DESCENT_ROUNDS = _nested_plan._DESCENT_ROUNDS = 0
    try:
        yield
    finally:
        _strategies._DESCENT_ROUNDS, _nested_plan._DESCENT_ROUNDS = saved


def floors(prof: remat.Profile) -> tuple[int, int]:
    """(one-level, nested) floors of a copy of ``prof`` without its cached floors."""
    fresh = copy.copy(prof)
    for key in [k for k in fresh.__dict__ if k.startswith("_remat_")]:
        del fresh.__dict__[key]
    return tuple(remat.plan(fresh, strategy="none", nested=n).min_peak_bytes for n in (False, True))  # type: ignore[return-value]


def measured(model: torch.nn.Module, x: torch.Tensor, plan: remat.Plan, ref: dict) -> tuple[int, list[str]]:
    """(measured peak, what differs from the un-checkpointed step) with ``plan`` applied to a copy of ``model``."""
    model = copy.deepcopy(model)  # the step updates BatchNorm's statistics
    remat.apply(model, plan)
    try:
        mode = model.training
        model.train()
        peak = remat.measure(model, x, repeat=1, warmup=0).peak_bytes
        got = train_step(model, x.detach().clone().requires_grad_(x.requires_grad))
        model.train(mode)
        return peak, same_step(ref, got)
    finally:
        remat.remove(model)


def one(spec: dict) -> dict:
    model, x = build(spec)
    ref = reference_step(model, x)
    mode = model.training
    model.train()
    prof = remat.profile(model, x, repeat=1, warmup=0)
    model.train(mode)
    with no_descent():
        before = floors(prof)
    after = floors(prof)
    row = {"blocks": len(spec["order"]), "features": features(spec), "before": before, "after": after, "runs": []}
    for nested, floor in zip((False, True), after):
        plan = remat.plan(prof, budget=floor, nested=nested)
        row["runs"].append((plan.predicted_peak_bytes, *measured(model, x, plan, ref)))
    return row


def report(rows: list[dict]) -> None:
    print("| model | blocks | one-level floor: before, after | nested floor: before, after | measured - predicted |")
    print("|---|---|---|---|---|")
    fell = {0: [], 1: []}
    worst, wrong = 0, []
    for k, r in enumerate(rows):
        for level in (0, 1):
            if r["after"][level] < r["before"][level]:
                fell[level].append(r["before"][level] - r["after"][level])
        over = [m - p for p, m, _ in r["runs"]]
        worst = max(worst, *over)
        wrong += [f"model {k}: {d}" for _, _, diffs in r["runs"] for d in diffs]
        if r["after"] != r["before"]:
            (b1, bn), (a1, an) = r["before"], r["after"]
            gaps = ", ".join(map(str, over))
            print(f"| {k} | {r['blocks']} | {b1:,} B, {a1:,} B | {bn:,} B, {an:,} B | {gaps} B |")
    print()
    for level, name in ((0, "one-level"), (1, "nested")):
        by = f" (by {min(fell[level]):,} to {max(fell[level]):,} B)" if fell[level] else ""
        print(f"The {name} floor fell on {len(fell[level])} of {len(rows)} models{by}.")
    which = f" ({'; '.join(wrong[:5])})" if wrong else ""
    print(
        f"Every floor plan measured at most {worst:,} B over its prediction (negative: under); "
        f"steps not bit-equal to the un-checkpointed one: {len(wrong)}{which}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=60, help="how many generated models")
    _sections.add_write_option(parser)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    with _sections.recorded(__file__, "Floor descents on generated models", write_to=args.write):
        print(f"{args.models} generated models; {_sections.device()}; torch {torch.__version__}.")
        print()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows = [one(s) for s in specs(args.models)]
        report(rows)


if __name__ == "__main__":
    main()
