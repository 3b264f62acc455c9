"""remat's own cost per block call: every block wrapped, remat against torch, step time over no checkpointing.

    PYTHONPATH=src python benchmarks/overhead.py                       # CPU: tiny GPT-2 and Llama
    PYTHONPATH=src python benchmarks/overhead.py --cuda                # the configurations of issue #16 on a GPU
    PYTHONPATH=src python benchmarks/overhead.py --set gpt2:layers=4 --rounds 12
    PYTHONPATH=src python benchmarks/overhead.py --write              # also into BENCHMARKS.md (one section per device)

Candidates, each with every block of the model wrapped (interleaved rounds, the
order shuffled per round, median of the per-round ratio to ``keep`` with the
25th-75th percentile of those ratios): ``remat full`` (``remat.wrap``), ``torch
full`` (torch's non-reentrant checkpoint on the block's forward), ``remat
selective`` (``policy="selective"``), ``remat selective (ops)`` (the op-level
policy: the list of ops to keep) and ``torch SAC`` (torch's selective checkpoint
with the same op list). On CUDA each step is synchronised before and after and
timed by the wall clock; on CPU steps run on one thread and are timed by that
thread's CPU time (``time.thread_time``: CPU autograd runs backward on the calling
thread), which other processes on a shared machine disturb far less than the wall
clock. ``--dtypes bf16`` runs the forward under bf16 autocast.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import _sections
import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import remat
from remat.bench._gpu_truth import autocast_forward
from remat.core._step import training_step
from remat.core.checkpoint import SAVE_OPS
from remat.zoo import build

CPU_CONFIGS = {
    "gpt2-tiny": ("gpt2", dict(layers=4, hidden=64, heads=4, vocab=256, batch=1, seq=32)),
    "llama-tiny": (
        "llama",
        dict(layers=4, hidden=64, intermediate=176, heads=4, kv_heads=2, vocab=256, batch=1, seq=32),
    ),
    "gpt2-small": ("gpt2", dict(layers=4, hidden=256, heads=4, vocab=1024, batch=2, seq=128)),
    "llama-small": (
        "llama",
        dict(layers=4, hidden=256, intermediate=704, heads=4, kv_heads=2, vocab=1024, batch=2, seq=128),
    ),
}
#: The rows of issue #16's H100 table.
CUDA_CONFIGS = {
    "gpt2-12x768": ("gpt2", dict(layers=12, hidden=768, heads=12, vocab=50257, batch=8, seq=1024)),
    "llama-16x2048": (
        "llama",
        dict(layers=16, hidden=2048, intermediate=5632, heads=16, kv_heads=8, vocab=32000, batch=2, seq=2048),
    ),
    "llama-4x1024": (
        "llama",
        dict(layers=4, hidden=1024, intermediate=2816, heads=8, kv_heads=4, vocab=8192, batch=2, seq=1024),
    ),
}
CANDIDATES = ("keep", "remat full", "torch full", "remat selective", "remat selective (ops)", "torch SAC")


class _TorchForward:
    """torch's checkpoint around a block's own forward (an instance attribute, like remat.wrap)."""

    def __init__(self, block: torch.nn.Module, context_fn: Callable[[], Any] | None) -> None:
        self.inner = type(block).forward.__get__(block)
        self.extra = {"context_fn": context_fn} if context_fn is not None else {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return torch_checkpoint(self.inner, *args, use_reentrant=False, **self.extra, **kwargs)


def _sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _install(blocks: list[torch.nn.Module], candidate: str) -> None:
    for block in blocks:
        remat.unwrap(block)
        block.__dict__.pop("forward", None)
        if candidate == "remat full":
            remat.wrap(block, policy="full")
        elif candidate == "remat selective":
            remat.wrap(block, policy="selective")
        elif candidate == "remat selective (ops)":
            block.forward = functools.partial(
                remat.checkpoint, type(block).forward.__get__(block), policy=sorted(SAVE_OPS, key=str)
            )
        elif candidate == "torch full":
            block.forward = _TorchForward(block, None)
        elif candidate == "torch SAC":
            block.forward = _TorchForward(block, functools.partial(create_selective_checkpoint_contexts, _sac_policy))


def _timer(zoo: Any, blocks: list[torch.nn.Module], candidate: str, cuda: bool) -> Callable[[], float]:
    def step() -> float:
        _install(blocks, candidate)
        zoo.model.zero_grad(set_to_none=True)
        clock = time.perf_counter if cuda else time.thread_time
        if cuda:
            torch.cuda.synchronize()
        start = clock()
        training_step(zoo.model, zoo.inputs, zoo.loss_fn)
        if cuda:
            torch.cuda.synchronize()
        return clock() - start

    return step


def measure_config(
    name: str, zoo_name: str, opts: dict[str, Any], *, bf16: bool, cuda: bool, rounds: int, steps: int
) -> str:
    zoo = build(zoo_name, **opts)
    device = "cuda" if cuda else "cpu"
    zoo.model.to(device)
    zoo.inputs = {k: v.to(device) for k, v in zoo.inputs.items()}
    if bf16:
        autocast_forward(zoo.model, torch.bfloat16)
    modules = dict(zoo.model.named_modules())
    blocks = [modules[b] for b in zoo.blocks]
    timers = [_timer(zoo, blocks, c, cuda) for c in CANDIDATES]
    times: list[list[float]] = [[] for _ in CANDIDATES]
    order = list(range(len(CANDIDATES)))
    for r in range(rounds + 1):  # round 0 warms every candidate up (first calls learn, allocator settles)
        order = order[1:] + order[:1]
        for i in order:
            seconds = statistics.median(timers[i]() for _ in range(steps))
            if r > 0:
                times[i].append(seconds)
    _install(blocks, "keep")
    cells = []
    for i, _ in enumerate(CANDIDATES[1:], start=1):
        ratios = sorted(a / b for a, b in zip(times[i], times[0]))
        q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        cells.append(f"{statistics.median(ratios):.2f}x ({q1:.2f}-{q3:.2f})")
    keep_ms = statistics.median(times[0]) * 1e3
    return f"| {name} | {'bf16 autocast' if bf16 else 'fp32'} | {keep_ms:.1f} ms | " + " | ".join(cells) + " |"


def _parse_sets(sets: list[str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for item in sets:
        name, _, assignments = item.partition(":")
        for pair in filter(None, assignments.split(",")):
            key, _, value = pair.partition("=")
            out.setdefault(name, {})[key] = int(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true", help="run issue #16's configurations on the GPU")
    parser.add_argument("--configs", nargs="*", help="configuration names (default: all of the device's)")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="zoo:key=value,... overrides")
    parser.add_argument("--dtypes", nargs="*", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="steps per candidate per round (median taken)")
    _sections.add_write_option(parser)
    args = parser.parse_args()
    if args.cuda and not torch.cuda.is_available():
        parser.error("--cuda: no CUDA device")
    part = "cuda" if args.cuda else "cpu"
    title = f"remat's own cost per block call ({part.upper()})"
    with _sections.recorded(__file__, title, write_to=args.write, part=part, cuda=args.cuda):
        _table(args)


def _table(args: argparse.Namespace) -> None:
    if not args.cuda:
        torch.set_num_threads(1)
    configs = CUDA_CONFIGS if args.cuda else CPU_CONFIGS
    overrides = _parse_sets(args.sets)
    device = torch.cuda.get_device_name() if args.cuda else f"{platform.machine()} CPU, 1 thread, thread CPU time"
    print(f"device: {device}; torch {torch.__version__}; {args.rounds} rounds x {args.steps} steps\n")
    print("| model | dtype | keep step | " + " | ".join(CANDIDATES[1:]) + " |")
    print("|---|---|---|" + "---|" * (len(CANDIDATES) - 1))
    for name in args.configs or list(configs):
        zoo_name, opts = configs[name]
        opts = {**opts, **overrides.get(zoo_name, {})}
        for dtype in args.dtypes:
            print(
                measure_config(
                    name, zoo_name, opts, bf16=dtype == "bf16", cuda=args.cuda, rounds=args.rounds, steps=args.steps
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
