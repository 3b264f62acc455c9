"""How long remat.plan takes on synthetic chains of 50-200 blocks.

    python benchmarks/planning_time.py
"""

from __future__ import annotations

import statistics
import time

import remat
from remat.planning._synthetic import synthetic_profile


def main() -> None:
    print("| blocks | first plan (with the minimum) | later plans, median |")
    print("|---|---|---|")
    for n in (50, 100, 200):
        prof = synthetic_profile(n)
        start = time.perf_counter()
        remat.plan(prof, 0.9)
        first = time.perf_counter() - start
        later = []
        for budget in (0.8, 0.7, 0.6, 0.5):
            start = time.perf_counter()
            remat.plan(prof, budget)
            later.append(time.perf_counter() - start)
        print(f"| {n} | {first:.2f} s | {statistics.median(later):.2f} s |")


if __name__ == "__main__":
    main()
