"""The memory-time curve of remat's plans down to the nested floor (issue #19).

Prints, per budget fraction of the un-checkpointed peak: measured peak, predicted peak,
the number of nested segments, and the step-time ratio against no checkpointing
(median of interleaved rounds, with the min-max range). Run:

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/nested.py [--channels 64 --size 64 --batch 8]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

import remat
from remat.planning._nested import nested_floor


def conv_chain(channels: int, blocks: int = 8) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1)]
    for _ in range(blocks):
        layers.append(nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()))
    return nn.Sequential(*layers)


def _times(model: nn.Module, x: torch.Tensor, plans: list, rounds: int) -> list[list[float]]:
    """Interleaved: each round times every plan once (None: no checkpointing)."""
    out: list[list[float]] = [[] for _ in plans]
    for _ in range(rounds):
        for i, plan in enumerate(plans):
            remat.remove(model)
            if plan is not None:
                remat.apply(model, plan)
            out[i].append(remat.measure(model, x, repeat=1, warmup=0).step_time_s)
    remat.remove(model)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = conv_chain(args.channels)
    x = torch.randn(args.batch, 3, args.size, args.size)
    prof = remat.profile(model, x)
    base = prof.baseline_peak_bytes
    one_level = remat.plan(prof, strategy="none").min_peak_bytes
    floor = nested_floor(prof)[0]
    print(f"conv chain {args.channels}ch {args.size}x{args.size} batch {args.batch}, torch {torch.__version__}, "
          f"device cpu; peak without checkpointing {base / 2**20:.1f} MiB; one-level floor {one_level / base:.3f}, "
          f"nested floor {floor / base:.3f}")
    fractions = [1.0, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.37, floor / base + 0.001]
    plans = []
    for f in fractions:
        plan = remat.plan(prof, int(f * base))
        remat.apply(model, plan)
        measured = remat.measure(model, x, repeat=1, warmup=1).peak_bytes
        remat.remove(model)
        plans.append((f, plan, measured))
    times = _times(model, x, [None] + [p for _, p, _ in plans], args.rounds)
    print("| budget | measured MiB | predicted MiB | error | segments | time ratio (median, min-max) |")
    print("|---|---|---|---|---|---|")
    ref = statistics.median(times[0])
    for (f, plan, measured), t in zip(plans, times[1:]):
        ratios = [a / b for a, b in zip(t, times[0])]
        print(f"| {f:.3f} | {measured / 2**20:.1f} ({measured / base:.3f}) | {plan.predicted_peak_bytes / 2**20:.1f} | "
              f"{(plan.predicted_peak_bytes - measured) / measured:+.1%} | {len(plan.segments)} | "
              f"{statistics.median(t) / ref:.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
