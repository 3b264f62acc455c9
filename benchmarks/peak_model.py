"""Predicted vs measured peak for every zoo model under several assignments.

    python benchmarks/peak_model.py            # zoo defaults (a few minutes on 2 cores)
    python benchmarks/peak_model.py --quick    # small sizes, seconds
    python benchmarks/peak_model.py --write    # also into BENCHMARKS.md (``benchmarks/_sections.py``)

Prints a markdown table: the profile's predicted peak, ``remat.measure``'s
measured peak and the error, for no checkpointing, full recompute on every
block, selective on every block and a mixed assignment; and the same
profile on fake tensors (no allocation).
"""

from __future__ import annotations

import argparse
import platform
import random
import time

import _sections
import torch

import remat
from remat.profiling._format import human_bytes
from remat.zoo import build, names

QUICK = {
    "seed-cifar": {"batch": 32},
    "gpt2": {"layers": 3, "hidden": 64, "heads": 4, "vocab": 512, "seq": 64, "batch": 2},
    "llama": {
        "layers": 3,
        "hidden": 64,
        "intermediate": 172,
        "heads": 4,
        "kv_heads": 2,
        "vocab": 512,
        "seq": 64,
        "batch": 2,
    },
    "vit": {"layers": 2, "hidden": 64, "intermediate": 128, "heads": 4, "image": 32, "patch": 8, "classes": 10},
    "resnet50": {"image": 32, "batch": 2},
}  # resnet50 quick keeps the full 3-4-6-3 layout (16 blocks) on small images


def assignments(blocks: list[str]) -> dict[str, dict[str, str]]:
    rng = random.Random(0)
    mixed = {b: rng.choice(["keep", "selective", "full"]) for b in blocks}
    return {
        "none": {},
        "all full": {b: "full" for b in blocks},
        "all selective": {b: "selective" for b in blocks},
        "mixed": mixed,
    }


def measured_peak(zoo, assignment: dict[str, str]) -> int:
    modules = dict(zoo.model.named_modules())
    try:
        for name, policy in assignment.items():
            remat.wrap(modules[name], policy=policy)
        return remat.measure(zoo.model, zoo.inputs, zoo.loss_fn, warmup=0, repeat=1).peak_bytes
    finally:
        remat.remove(zoo.model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", nargs="*", default=names())
    _sections.add_write_option(parser)
    args = parser.parse_args()
    sizes = "quick sizes" if args.quick else "zoo defaults"
    with _sections.recorded(__file__, f"Predicted against measured peaks ({sizes})", write_to=args.write, part=sizes):
        _table(args)


def _table(args: argparse.Namespace) -> None:
    print(
        f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, "
        f"{'quick sizes' if args.quick else 'zoo defaults'}\n"
    )
    print("| model | assignment | predicted | measured | error | fake-tensor predicted | fake error |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        zoo = build(name, **(QUICK.get(name, {}) if args.quick else {}))
        start = time.perf_counter()
        prof = remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, repeat=1, warmup=0)
        took = time.perf_counter() - start
        fake = remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, fake=True, target="cpu")
        blocks = [b.name for b in prof.blocks]
        for label, assignment in assignments(blocks).items():
            predicted, measured = prof.predict_peak(assignment), measured_peak(zoo, assignment)
            faked = fake.predict_peak(assignment)
            print(
                f"| {name} ({len(blocks)} blocks) | {label} | {human_bytes(predicted)} | {human_bytes(measured)} | "
                f"{(predicted - measured) / measured:+.2%} | {human_bytes(faked)} | "
                f"{(faked - measured) / measured:+.2%} |"
            )
        print(f"<!-- {name}: profile took {took:.1f} s -->")


if __name__ == "__main__":
    main()
