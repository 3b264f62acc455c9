"""The memory-time curve of remat's plans down to the nested floor.

Per budget (a fraction of the un-checkpointed peak): measured peak, predicted peak, the
error, the number of nested segments, and the step-time ratio against no checkpointing
(median of interleaved rounds, with the min-max range). Budgets run from 1.0 down to the
nested floor, with the one-level floor and the every-block-full point among them. Run:

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/nested.py --model conv [--rounds 9] [--at 58.7]
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/nested.py --model conv-flat   # the same, single layers
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/nested.py --model vgg-flat    # and ReLU(inplace=True)
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/nested.py --model gpt2   # any zoo name
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/nested.py --model vit --set layers=6 --set batch=2
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/nested.py --model gpt2 --fine   # also policy full-fine

``--write`` puts the output into BENCHMARKS.md, one section per model and ``--set`` (``benchmarks/_sections.py``).

Before the table it says where the peak of every block ``full`` (and ``full-fine``) sits: the segment,
the resting bytes (parameters, buffers, inputs), what else is live at its start (gradients made so far,
stored block inputs), what the segment itself adds (one block's recomputation and backward), and the
highest peak of the glue outside the blocks (embedding, head, loss), which no block's policy lowers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import _sections
import torch
from torch import nn

import remat
from remat.planning._nested import MAX_BLOCKS
from remat.planning._nested_plan import nested_floor


def conv_chain(channels: int = 64, blocks: int = 8, inplace: bool = False) -> nn.Sequential:
    """A stem and ``blocks`` conv-BN-ReLU blocks: the chain remat's nested plans are set beside rotor's on."""
    layers: list[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1)]
    for _ in range(blocks):
        layers.append(
            nn.Sequential(
                nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(inplace=inplace)
            )
        )
    return nn.Sequential(*layers)


def _setup(name: str, options: dict[str, int]) -> tuple[str, nn.Module, Any, Any]:
    if name == "conv":
        torch.manual_seed(0)
        return (
            "conv chain (stem + 8 conv-BN-ReLU, 64 ch, 64x64, batch 8)",
            conv_chain(),
            torch.randn(8, 3, 64, 64),
            None,
        )
    if name in ("conv-flat", "vgg-flat"):  # the same chain as rotor takes it: one flat Sequential of single layers
        torch.manual_seed(0)
        inplace = name == "vgg-flat"  # as torchvision's VGG writes it: each ReLU writes the BatchNorm's output
        chain = conv_chain(inplace=inplace)
        flat = nn.Sequential(
            *(layer for block in chain for layer in (block if isinstance(block, nn.Sequential) else [block]))
        )
        relu = "ReLU(inplace=True)" if inplace else "ReLU"
        return (
            f"conv chain written flat (25 single layers, {relu}, 64 ch, 64x64, batch 8)",
            flat,
            torch.randn(8, 3, 64, 64),
            None,
        )
    from remat.zoo import build

    zoo = build(name, **options)
    sizes = ", ".join(f"{k}={v}" for k, v in options.items()) or "defaults"
    return f"zoo {name} ({sizes})", zoo.model, zoo.inputs, zoo.loss_fn


def _option(text: str) -> tuple[str, int]:
    key, _, value = text.partition("=")
    return key, int(value)


def _where(prof: remat.Profile, policy: str) -> str:
    """Where the peak of every block under ``policy`` sits, in MiB (see the module docstring)."""
    timeline = prof.timeline({b.name: policy for b in prof.blocks})
    key, live, top = max(timeline, key=lambda t: t[2])
    glue = max((t for t in timeline if t[0][1] is None), key=lambda t: t[2])
    mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
    return (
        f"every block {policy}: peak {mib(top)} MiB in {key[0]} of {key[1] or 'glue'} = "
        f"resting {mib(prof.resting_bytes)}"
        f" + live above resting at its start {mib(live - prof.resting_bytes)} (gradients so far, kept inputs)"
        f" + the segment's own {mib(top - live)}; highest glue peak {mib(glue[2])} MiB ({glue[0][0]} glue "
        f"{glue[0][2]}: embedding, head, loss)"
    )


def _step_time(model: nn.Module, inputs: Any, loss_fn: Any, plan: remat.Plan | None) -> float:
    remat.remove(model)
    if plan is not None:
        remat.apply(model, plan)
    return remat.measure(model, inputs, loss_fn, repeat=1, warmup=0).step_time_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="conv")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--fine", action="store_true", help="also profile and plan with policy full-fine")
    ap.add_argument("--set", type=_option, action="append", default=[], help="a zoo option, e.g. layers=4")
    ap.add_argument(
        "--at",
        type=float,
        action="append",
        default=[],
        help="also a budget in MiB (e.g. 58.7: rotor's point on the conv chain)",
    )
    _sections.add_write_option(ap)
    args = ap.parse_args()
    part = " ".join([args.model, *(f"{k}={v}" for k, v in args.set)])  # one section per model and size
    with _sections.recorded(__file__, f"Nested plans down to the floor: {part}", write_to=args.write, part=part):
        _curve(args)


def _curve(args: argparse.Namespace) -> None:
    title, model, inputs, loss_fn = _setup(args.model, dict(args.set))
    start = time.perf_counter()
    policies = ("keep", "selective", "full", *(("full-fine",) if args.fine else ()))
    prof = remat.profile(model, inputs, loss_fn, policies=policies)
    profiled = time.perf_counter() - start
    base = prof.baseline_peak_bytes
    one_level = remat.plan(prof, strategy="none", nested=False).min_peak_bytes
    all_full = prof.predict_peak({b.name: "full" for b in prof.blocks})
    lowest = remat.plan(prof, strategy="none").min_peak_bytes  # the nested floor where nesting applies
    nested = (
        "nested floor" if nested_floor(prof) is not None else f"no nested view (not a chain of <= {MAX_BLOCKS} blocks)"
    )
    fine = prof.predict_peak({b.name: "full-fine" for b in prof.blocks}) if args.fine else None
    fine_text = "" if fine is None else f"every block full-fine {fine / base:.3f}; "
    print(
        f"{title}; torch {torch.__version__}, {prof.device}, {len(prof.blocks)} blocks; profiled in {profiled:.1f} s "
        f"({profiled / prof.step_time_s:.1f} steps of {prof.step_time_s:.3f} s). Peak without "
        f"checkpointing {base / 2**20:.1f} MiB; every block full {all_full / base:.3f}; "
        f"{fine_text}one-level floor "
        f"{one_level / base:.3f}; lowest {lowest / base:.3f} ({nested})"
    )
    for policy in ("full", "full-fine")[: 1 + args.fine]:
        print(_where(prof, policy))
    marks = {
        1.0,
        0.8,
        0.7,
        0.6,
        0.5,
        0.45,
        0.4,
        all_full / base,
        one_level / base,
        (lowest + 1) / base,
        *(() if fine is None else (fine / base,)),
        *(mib * 2**20 / base for mib in args.at),
    }
    fractions = sorted((f for f in marks if f * base >= lowest), reverse=True)
    rows = []
    for f in fractions:
        plan = remat.plan(prof, int(f * base))
        remat.remove(model)
        remat.apply(model, plan)
        measured = remat.measure(model, inputs, loss_fn, repeat=1, warmup=1).peak_bytes
        rows.append((f, plan, measured))
    times: list[list[float]] = [[] for _ in range(len(rows) + 1)]
    for _ in range(args.rounds):  # interleaved: each round times every plan once
        for i, plan in enumerate([None] + [r[1] for r in rows]):
            times[i].append(_step_time(model, inputs, loss_fn, plan))
    remat.remove(model)
    print("| budget | measured MiB (of peak) | predicted MiB | error | segments | time ratio: median (min-max) |")
    print("|---|---|---|---|---|---|")
    ref = statistics.median(times[0])
    for (f, plan, measured), t in zip(rows, times[1:]):
        ratios = [a / b for a, b in zip(t, times[0])]
        print(
            f"| {f:.3f} | {measured / 2**20:.1f} ({measured / base:.3f}) | {plan.predicted_peak_bytes / 2**20:.1f} | "
            f"{(plan.predicted_peak_bytes - measured) / measured:+.2%} | {len(plan.segments)} | "
            f"{statistics.median(t) / ref:.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )


if __name__ == "__main__":
    main()
