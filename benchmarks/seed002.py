"""Seed 002's model at its own size: ``remat.auto`` on a forward with no submodules, traced and cut.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/seed002.py [LOOPS] [OPS] [--write]

``HeavyModel``'s forward loops ``heavy_function`` LOOPS times (1000), each OPS ops (100): 100,000 ops
on a scalar, with ``*`` for the seed's ``+`` (an add keeps nothing for backward, a mul keeps its
input). Prints the peak without checkpointing, the plan's predicted and measured peaks (and their
ratio), whether the loss and the gradients are ``torch.equal`` to the step without checkpointing,
and how long ``remat.profile`` and ``remat.auto`` took, in seconds and in units of one plain step.
"""

from __future__ import annotations

import argparse
import copy
import time

import _sections
import torch
from torch import nn

import remat
from remat.profiling import _traced_repeat


def make_model(loops: int, ops: int) -> nn.Module:
    def heavy_function(x, a):
        for _ in range(ops):
            x = x * a
        return x

    class HeavyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.tensor(1.0001))

        def forward(self, x):
            for _ in range(loops):
                x = heavy_function(x, self.a)
            return x

    return HeavyModel()


def step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.detach().clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    return loss.detach(), [x.grad, *(p.grad for p in model.parameters())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("loops", type=int, nargs="?", default=1000)
    parser.add_argument("ops", type=int, nargs="?", default=100)
    _sections.add_write_option(parser)
    args = parser.parse_args()
    title = "A forward with no submodules, traced and cut (seed 002's model)"
    with _sections.recorded(__file__, title, write_to=args.write):
        _run(args.loops, args.ops)


def _run(loops: int, ops: int) -> None:
    torch.manual_seed(0)
    model, x = make_model(loops, ops), torch.tensor(0.5)
    plain = copy.deepcopy(model)
    step(plain, x)
    start = time.perf_counter()
    want_loss, want_grads = step(plain, x)
    one_step = time.perf_counter() - start
    base = remat.measure(plain, x.requires_grad_(), warmup=0, repeat=1).peak_bytes

    widened: list = []
    widen = _traced_repeat.widen
    _traced_repeat.widen = lambda *args: widened.append(widen(*args)) or widened[-1]  # to say what ran
    start, cpu = time.perf_counter(), time.process_time()
    plan = remat.auto(model, x, budget=0.5)
    auto_s, auto_cpu = time.perf_counter() - start, time.process_time() - cpu
    got_loss, got_grads = step(model, x)
    equal = torch.equal(got_loss, want_loss) and all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
    measured = remat.measure(model, x, warmup=0, repeat=1).peak_bytes
    checkpointed = sum(policy != "keep" for policy in plan.assignment.values())
    print(f"HeavyModel {loops}x{ops} = {loops * ops} ops, torch {torch.__version__}, CPU")
    print(
        f"one plain step: {one_step:.3f} s; peak without checkpointing: {base} bytes "
        f"(plan's baseline {plan.baseline_peak_bytes})"
    )
    print(
        f"plan: {checkpointed} of {len(plan.assignment)} segments checkpointed, {len(plan.segments)} nested; "
        f"predicted {plan.predicted_peak_bytes} bytes ({plan.predicted_peak_bytes / base:.3f} of the peak), "
        f"measured {measured} ({measured / base:.3f}); predicted/measured {plan.predicted_peak_bytes / measured:.4f}"
    )
    print(f"loss and gradients torch.equal to no checkpointing: {equal}")
    print(f"remat.auto: {auto_s:.1f} s = {auto_s / one_step:.0f} plain steps; CPU time {auto_cpu:.1f} s")
    print(f"profiled: {widened[-1].notes[-1] if widened and widened[-1] else 'the whole chain'}")


if __name__ == "__main__":
    main()
