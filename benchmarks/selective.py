"""Issue #16 item 2: selective by module against op-level selective, keep and full.

Every block of a zoo model under one policy: keep (no checkpointing), full, op-level selective
(torch's selective-checkpoint dispatch mode on every op, remat before #16) and selective by module
(remat.core._by_module). Per model: median over interleaved rounds of each policy's step time as a
ratio to keep's in the same round, and the peak from remat.measure. Tiny tensors on a CPU stand in
for a fast GPU step (Python overhead dominates). Run:

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/selective.py [--rounds 15] [--write]
"""

from __future__ import annotations

import argparse
from typing import Any

import _sections
import torch

import remat
from remat.bench._rounds import interleaved_rounds, ratio_to, timed_step
from remat.zoo import build

MODELS = {
    "gpt2 tiny (2x64, 1x32)": ("gpt2", {"layers": 2, "hidden": 64, "heads": 2, "vocab": 256, "seq": 32, "batch": 1}),
    "gpt2 small (4x128, 2x64)": ("gpt2", {"layers": 4, "hidden": 128, "heads": 4, "vocab": 512, "seq": 64, "batch": 2}),
    "llama tiny (2x64, 1x32)": (
        "llama",
        {
            "layers": 2,
            "hidden": 64,
            "intermediate": 172,
            "heads": 2,
            "kv_heads": 1,
            "vocab": 256,
            "seq": 32,
            "batch": 1,
        },
    ),
    "llama small (4x128, 2x64)": (
        "llama",
        {
            "layers": 4,
            "hidden": 128,
            "intermediate": 344,
            "heads": 4,
            "kv_heads": 2,
            "vocab": 512,
            "seq": 64,
            "batch": 2,
        },
    ),
}
SETUPS = ("keep", "full", "selective (op-level)", "selective (by module)")


def _candidates(zoo: Any) -> dict[str, tuple[Any, Any]]:
    """Per setup, (on, off) around a step: wrap every block."""
    blocks = [dict(zoo.model.named_modules())[b] for b in zoo.blocks]

    def wrapping(policy: str) -> tuple[Any, Any]:
        def on() -> None:
            for b in blocks:
                remat.wrap(b, policy=policy)

        def off() -> None:
            for b in blocks:
                remat.unwrap(b)

        return on, off

    return {
        "keep": wrapping("keep"),
        "full": wrapping("full"),
        "selective (op-level)": wrapping("selective-ops"),
        "selective (by module)": wrapping("selective"),
    }


def run(label: str, name: str, options: dict[str, int], rounds: int) -> dict[str, tuple[float, int]]:
    zoo = build(name, **options)
    setups = _candidates(zoo)
    timed = [timed_step(zoo.model, zoo.inputs, zoo.loss_fn, on=on, off=off) for on, off in setups.values()]
    times = interleaved_rounds(timed, warmup=2, repeat=rounds, label=label)
    out = {}
    for (setup, (on, off)), t in zip(setups.items(), times):
        on()
        try:
            peak = remat.measure(zoo.model, zoo.inputs, zoo.loss_fn, warmup=1, repeat=1).peak_bytes
        finally:
            off()
        out[setup] = (ratio_to(t, times[0]), peak)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    _sections.add_write_option(parser)
    args = parser.parse_args()
    with _sections.recorded(__file__, "Selective by module against op-level selective", write_to=args.write):
        _table(args)


def _table(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {args.rounds} interleaved rounds, median time ratio to keep; peak (KiB)\n")
    print("| model (layers x hidden, batch x seq) | " + " | ".join(SETUPS) + " |")
    print("|---|" + "---|" * len(SETUPS))
    for label, (name, options) in MODELS.items():
        row = run(label, name, options, args.rounds)
        cells = [f"{row[s][0]:.2f}x, {row[s][1] / 1024:.0f} KiB" for s in SETUPS]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
