"""What ``remat.auto`` itself holds and costs on a device its step without checkpointing does not fit.

    OMP_NUM_THREADS=2 PYTHONPATH=src python benchmarks/fit.py [--quick] [--rounds 3] [--write]
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/fit.py --cpu [--rounds 2]

Per zoo model and budget (0.8 and 0.6 of the peak without checkpointing):

* remat's own peak: the most bytes alive at once during the whole ``remat.auto`` call (fake profile,
  any real profile, verification steps), counted as the fit tests' simulated device counts them
  (``tests/_device.py``: every real storage, the model and batch included; fake tensors hold none),
  against the budget (NOTE [Within the budget] in remat.planning.apply);
* auto's wall time in units of one training step without checkpointing: auto and a plain step
  timed in alternation, ``--rounds`` times, medians of each (the machine's load drifts alike for both);
* where auto's time goes: the phases of the last timed call, as shares of it (NOTE [Where the time goes]
  in remat.core._costs; ``remat profile -v`` logs the same);
* what auto chose and how many real steps it verified with.

``--cpu`` times the same calls in this process's CPU time instead (``time.process_time``, after a warm-up call
of each; on one thread a loaded machine slows both alike, which wall time does not promise), and prints a
table of auto's time in steps without the peaks; ``--write`` does not apply to it.

``--defaults`` takes the zoo's default sizes instead (those of README's Results table, steps of about a second on
this CPU).

``--scale`` times the same calls in CPU time for GPT-2 and Llama at 1, 2 and 4 times the width and sequence
length of ``SIZES`` (same layers and batch): a fake step costs per op, not per byte, so auto's cost in steps
falls as the step grows.

``--write`` puts the table into BENCHMARKS.md between this script's markers (``benchmarks/_sections.py``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import remat
from remat.core._costs import Costs, costs
from remat.core._step import input_tensors, training_step
from remat.planning import _candidates
from remat.profiling._format import human_bytes
from remat.zoo import build

#: Sizes with a step of tens to hundreds of milliseconds on 2 CPU cores.
SIZES = {
    "gpt2": {"layers": 4, "hidden": 128, "heads": 4, "vocab": 2048, "seq": 128, "batch": 4},
    "llama": {
        "layers": 4,
        "hidden": 128,
        "intermediate": 344,
        "heads": 4,
        "kv_heads": 2,
        "vocab": 2048,
        "seq": 128,
        "batch": 4,
    },
    "vit": {
        "layers": 4,
        "hidden": 128,
        "intermediate": 512,
        "heads": 4,
        "image": 64,
        "patch": 8,
        "classes": 10,
        "batch": 4,
        "dropout": 0.1,
    },
    "resnet50": {
        "depths": (3, 3),
        "hidden_sizes": (64, 64),
        "embedding_size": 8,
        "image": 64,
        "classes": 10,
        "batch": 8,
    },
}
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import _sections  # noqa: E402  (this folder's writer of BENCHMARKS.md)
from _device import SimulatedDevice  # noqa: E402  (the fit tests' device: real storages, fake tensors not counted)
from _fit_zoo import ZOO as QUICK  # noqa: E402  (the fit tests' sizes: seconds per model)


def _auto(zoo, budget: int) -> remat.Plan:
    try:
        return remat.auto(zoo.model, zoo.inputs, budget, loss_fn=zoo.loss_fn, repeat=1, warmup=0)
    finally:
        remat.remove(zoo.model)


def _own_peak(zoo, budget: int) -> tuple[int, remat.Plan, int]:
    """(the most bytes alive during one auto call, the plan, real steps it verified with)."""
    steps, measured = [0], _candidates.measured_step

    def counting(*args, **kwargs):
        steps[0] += 1
        return measured(*args, **kwargs)

    device = SimulatedDevice(1 << 60, [*zoo.model.parameters(), *zoo.model.buffers(), *input_tensors(zoo.inputs)])
    _candidates.measured_step = counting
    try:
        with device:
            plan = _auto(zoo, budget)
    finally:
        _candidates.measured_step = measured
    return device.peak, plan, steps[0]


def _times(zoo, budget: int, rounds: int, clock=time.perf_counter, warm_auto: bool = False):
    """Medians of (one step without checkpointing, one auto call) on ``clock``, timed in alternation after a
    warm-up step (and a warm-up auto call with ``warm_auto``); the last call's phases and plan."""
    training_step(zoo.model, zoo.inputs, zoo.loss_fn)
    zoo.model.zero_grad(set_to_none=True)
    if warm_auto:
        _auto(zoo, budget)
    steps, autos = [], []
    for _ in range(rounds):
        start = clock()
        training_step(zoo.model, zoo.inputs, zoo.loss_fn)
        steps.append(clock() - start)
        zoo.model.zero_grad(set_to_none=True)
        start = clock()
        with costs("remat.auto") as ledger:
            plan = _auto(zoo, budget)
        autos.append(clock() - start)
    return statistics.median(steps), statistics.median(autos), ledger, plan


def _policies(plan: remat.Plan) -> str:
    counts = {p: list(plan.assignment.values()).count(p) for p in set(plan.assignment.values())}
    return ", ".join(f"{n} {p}" for p, n in sorted(counts.items()))


def cpu_rows(sizes: dict, budgets: tuple[float, ...], rounds: int) -> list[str]:
    lines = [
        "| model | budget | one step (CPU) | auto (CPU) | auto, in steps | where auto's time goes | plan |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, options in sizes.items():
        zoo = build(name, **options)
        keep = remat.measure(zoo.model, zoo.inputs, zoo.loss_fn, warmup=0, repeat=1).peak_bytes
        for fraction in budgets:
            torch.manual_seed(0)
            step_s, auto_s, ledger, plan = _times(zoo, int(fraction * keep), rounds, time.process_time, warm_auto=True)
            lines.append(
                f"| {name} | {fraction} | {step_s * 1e3:.0f} ms | {auto_s:.2f} s | {auto_s / step_s:.1f} | "
                f"{_where(ledger)} | {_policies(plan)} |"
            )
            print(lines[-1], flush=True)
    return lines


#: The width and length factors of ``--scale``.
FACTORS = (1, 2, 4)


def scaled(name: str, factor: int) -> dict:
    """``SIZES[name]`` with its width, MLP width and sequence length times ``factor``."""
    options = dict(SIZES[name])
    for key in ("hidden", "intermediate", "seq"):
        if key in options:
            options[key] *= factor
    return options


def scale_rows(names: list[str], budgets: tuple[float, ...], rounds: int) -> list[str]:
    lines = [
        "| model | hidden x seq | budget | one step (CPU) | auto (CPU) | auto, in steps | where auto's time goes |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        for factor in FACTORS:
            options = scaled(name, factor)
            zoo = build(name, **options)
            keep = remat.measure(zoo.model, zoo.inputs, zoo.loss_fn, warmup=0, repeat=1).peak_bytes
            for fraction in budgets:
                torch.manual_seed(0)
                step_s, auto_s, ledger, _ = _times(zoo, int(fraction * keep), rounds, time.process_time, True)
                lines.append(
                    f"| {name} | {options['hidden']} x {options['seq']} | {fraction} | {step_s * 1e3:.0f} ms | "
                    f"{auto_s:.2f} s | {auto_s / step_s:.1f} | {_where(ledger)} |"
                )
                print(lines[-1], flush=True)
    return lines


def _where(ledger: Costs) -> str:
    """The phases that took a tenth of the call or more, with their shares."""
    total = ledger.total()
    big = sorted(((s, p) for p, s in ledger.seconds.items() if s >= 0.1 * total), reverse=True)
    return ", ".join(f"{p} {s / total:.0%} ({ledger.counts[p]}x)" for s, p in big)


def rows(sizes: dict, budgets: tuple[float, ...], rounds: int) -> list[str]:
    lines = [
        "| model | budget | peak without checkpointing | remat's own peak during auto | within | "
        "auto, in steps | one step | where auto's time goes | real steps verified | plan |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, options in sizes.items():
        zoo = build(name, **options)
        keep = remat.measure(zoo.model, zoo.inputs, zoo.loss_fn, warmup=0, repeat=1).peak_bytes
        for fraction in budgets:
            budget = int(fraction * keep)
            torch.manual_seed(0)
            own, plan, verified = _own_peak(zoo, budget)
            step_s, auto_s, ledger, _ = _times(zoo, budget, rounds)
            lines.append(
                f"| {name} | {fraction} ({human_bytes(budget)}) | {human_bytes(keep)} | {human_bytes(own)} | "
                f"{'yes' if own <= budget else 'NO'} | {auto_s / step_s:.1f} | {step_s * 1e3:.0f} ms | "
                f"{_where(ledger)} | {verified} | {_policies(plan)} |"
            )
            print(lines[-1], flush=True)
    return lines


def _write(lines: list[str]) -> None:
    _sections.write(__file__, [*_sections.header("remat.auto on a device the step does not fit"), *lines])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the fit tests' small sizes")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds (medians)")
    parser.add_argument("--models", default=",".join(SIZES), help="comma-separated zoo models")
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    parser.add_argument("--cpu", action="store_true", help="auto and a step in CPU time (set OMP_NUM_THREADS=1)")
    parser.add_argument("--scale", action="store_true", help="--cpu for GPT-2 and Llama at growing widths")
    parser.add_argument("--defaults", action="store_true", help="the zoo's default sizes (README's Results table)")
    parser.add_argument("--budgets", default="0.8,0.6", help="fractions of the peak without checkpointing")
    args = parser.parse_args()
    table = QUICK if args.quick else SIZES
    sizes = {m: {} if args.defaults else table[m] for m in args.models.split(",")}
    budgets = tuple(float(b) for b in args.budgets.split(","))
    print(f"# {platform.machine()} CPU, torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    if args.scale:
        scale_rows([m for m in args.models.split(",") if m in ("gpt2", "llama")], budgets, args.rounds)
        return
    if args.cpu:
        cpu_rows(sizes, budgets, args.rounds)
        return
    lines = rows(sizes, budgets, args.rounds)
    if args.write:
        _write(lines)


if __name__ == "__main__":
    main()
