"""What a fake profile costs, with alike blocks profiled once and with every block profiled, side by side.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/fake_profile_cost.py [--rounds N] [--write]

For each model of the H100 ground truth (``benchmarks/gpu-truth/h100.json``, built on the meta device),
``remat.profile(fake=True, target="h100")`` is run alternately as remat runs it (a stack of alike blocks
profiled once: NOTE [Identical blocks are profiled once]) and with every block profiled, ``--rounds`` times
each after one warm-up of each. Prints CPU seconds (``time.process_time``, median and range), their
ratio, the same in units of the H100 step without checkpointing that the truth file measured, and whether
the two profiles predict the same peak for 100 random assignments.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time

import _sections

import remat
from remat.bench._gpu_truth import build_config, load
from remat.profiling import _repeated_blocks


@contextlib.contextmanager
def _every_block():
    saved = _repeated_blocks.short_stack

    @contextlib.contextmanager
    def off(*args):
        yield None

    _repeated_blocks.short_stack = off
    try:
        yield
    finally:
        _repeated_blocks.short_stack = saved


def _timed(zoo) -> tuple[float, remat.Profile]:
    start = time.process_time()
    prof = remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, fake=True, target="h100")
    return time.process_time() - start, prof


def _same(a: remat.Profile, b: remat.Profile) -> bool:
    names = [blk.name for blk in b.blocks]
    rng = random.Random(0)
    picks = [{n: rng.choice(b.policies) for n in names} for _ in range(100)]
    return a.blocks == b.blocks and all(a.predict_peak(p) == b.predict_peak(p) for p in picks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    _sections.add_write_option(parser)
    args = parser.parse_args()
    title = "A fake profile of alike blocks, profiled once"
    with _sections.recorded(__file__, title, write_to=args.write):
        _run(args.rounds)


def _run(rounds: int) -> None:
    truth = load("h100.json")
    print(
        "| model | blocks | once (CPU s) | every block (CPU s) | ratio | once, in H100 steps "
        "| every block, in H100 steps | same predictions |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, entry in truth["models"].items():
        zoo = build_config(truth, label)
        times: dict[str, list[float]] = {"once": [], "every": []}
        profs = {}
        for k in range(rounds + 1):  # the first round warms up
            for kind in ("once", "every"):
                with _every_block() if kind == "every" else contextlib.nullcontext():
                    seconds, profs[kind] = _timed(zoo)
                if k:
                    times[kind].append(seconds)
        once, every = (statistics.median(times[k]) for k in ("once", "every"))
        step = entry["assignments"]["none"]["t"]
        span = {k: f"{min(v):.2f}-{max(v):.2f}" for k, v in times.items()}
        print(
            f"| {label} | {len(profs['every'].blocks)} | {once:.2f} ({span['once']}) | {every:.2f} ({span['every']}) "
            f"| {once / every:.2f} | {once / step:.1f} | {every / step:.1f} | {_same(profs['once'], profs['every'])} |"
        )
    print()
    print(
        "H100 steps: CPU seconds over the truth file's median step without checkpointing (fp32, torch 2.11, "
        "H100 80GB); the fake profile runs on the host, here this machine's CPU, one thread."
    )


if __name__ == "__main__":
    main()
