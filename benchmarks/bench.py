"""remat beside today's options on every zoo model; writes its section of BENCHMARKS.md and Pareto plots.

    python benchmarks/bench.py                 # zoo defaults (about 20 minutes on 2 cores)
    python benchmarks/bench.py --quick         # small sizes, a minute or two

Timing benchmarks need a quiet machine: run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import _sections

from remat.bench import max_batch, run_bench
from remat.bench._report import plot
from remat.zoo import build, names

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", nargs="*", default=names())
    parser.add_argument("--max-batch", nargs="*", default=["llama"], help="models for the max-batch table")
    parser.add_argument("--repeat", type=int, default=7, help="timed rounds per model")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument(
        "--compile",
        type=float,
        nargs="*",
        default=[],
        metavar="BUDGET",
        help="also torch.compile at these activation memory budgets (about a minute each to compile)",
    )
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--plots", type=pathlib.Path, default=ROOT / "docs")
    args = parser.parse_args()
    command = _sections.command_line()

    def progress(text: str, done: int, total: int) -> None:
        print(f"[{done}/{total}] {text}", file=sys.stderr, flush=True)

    report = run_bench(
        args.models,
        quick=args.quick,
        repeat=args.repeat,
        warmup=args.warmup,
        compile_budgets=args.compile,
        progress=progress,
        command=command,
    )
    sections = [*_sections.header("remat beside today's options (zoo models)"), report.markdown()]
    for name in args.max_batch:
        from remat.bench import QUICK

        options = QUICK.get(name, {}) if args.quick else {}
        zoo = build(name, **options)
        from remat.bench._run import _peak
        from remat.bench._setups import no_checkpointing

        budget = _peak(zoo, no_checkpointing())  # what no checkpointing needs at the default batch
        result = max_batch(name, budget, options=options, progress=progress)
        sections += ["", f"### max batch: {name}", "", result.markdown()]
    paths = plot(report, args.plots)
    sections += ["", "Plots: " + ", ".join(f"[{p.stem}]({os.path.relpath(p, args.out.parent)})" for p in paths)]
    _sections.write(__file__, sections, path=args.out)  # the other benchmarks' sections are kept
    print("\n".join(sections))


if __name__ == "__main__":
    main()
