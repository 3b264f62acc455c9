"""How long remat.plan takes on synthetic chains of 24-200 blocks, nested plans included.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/planning_time.py

Per chain: whether nested plans apply (chains of at most ``MAX_BLOCKS`` blocks), the lowest peak one
level deep and nested (fractions of the peak without checkpointing), the first ``remat.plan`` (it also
finds the floor, once per profile) and the median of four later plans at budgets from 0.8 to 0.35 of
the peak (above the floor). ``--write`` puts the table into BENCHMARKS.md (``benchmarks/_sections.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import _sections

import remat
from remat.planning._nested import MAX_BLOCKS
from remat.planning._synthetic import synthetic_profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _sections.add_write_option(parser)
    args = parser.parse_args()
    with _sections.recorded(__file__, "Planning time on synthetic chains", write_to=args.write):
        _table()


def _table() -> None:
    print("| blocks | nested | one-level floor | lowest | first plan (with the floor) | later plans, median |")
    print("|---|---|---|---|---|---|")
    for n in (24, 48, 64, 100, 128, 200):
        prof = synthetic_profile(n)
        base = prof.baseline_peak_bytes
        start = time.perf_counter()
        first = remat.plan(prof, 0.9)
        first_s = time.perf_counter() - start
        one_level = remat.plan(prof, strategy="none", nested=False).min_peak_bytes
        later = []
        for budget in (0.8, 0.6, 0.45, 0.35):
            start = time.perf_counter()
            remat.plan(prof, max(budget, (first.min_peak_bytes + 1) / base))
            later.append(time.perf_counter() - start)
        print(
            f"| {n} | {'yes' if n <= MAX_BLOCKS else 'no'} | {one_level / base:.3f} | "
            f"{first.min_peak_bytes / base:.3f} | {first_s:.2f} s | {statistics.median(later):.2f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
