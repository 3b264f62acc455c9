"""remat plans under torch.compile against compile's own ``activation_memory_budget``.

    PYTHONPATH=src python benchmarks/compile_budget.py                  # gpt2 and llama, small CPU sizes
    PYTHONPATH=src python benchmarks/compile_budget.py --models gpt2 --budgets 1,0.5,0.1 --repeat 5

For each zoo model (small sizes, below), compiled with inductor:

* compile's budget: ``torch._functorch.config.activation_memory_budget`` at each budget,
  no checkpointing in the model (budget 1 is the compiled reference);
* remat + compile: the same model with a remat plan (every block keep / selective / full,
  and mixes), each block torch's checkpoint operator under compile.

Per setup: the compiled step's peak from the CPU allocator's own reports
(``measure_peak(allocator=True)``, after a step that compiles), its ratio to the
reference's, the median step time of ``--repeat`` steps (after 2 warm-ups) as a ratio to
the reference's, and a gradient self-consistency check with the model's dropout: the same
seed gives the same forward masks (equal loss), so the gradients must equal the
reference's up to float reassociation of fused kernels; a backward that draws other masks
than its forward shows as a gap orders of magnitude larger. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import torch

import remat
from remat import zoo
from remat.core.measure import measure_peak
from remat.profiling._format import human_bytes

SIZES = {
    "gpt2": {"layers": 4, "hidden": 128, "heads": 4, "vocab": 512, "seq": 128, "batch": 4, "dropout": 0.1},
    "llama": {"layers": 4, "hidden": 128, "intermediate": 344, "heads": 4, "kv_heads": 2, "vocab": 512, "seq": 128,
              "batch": 4},
}
PLANS = {
    "keep all": ("keep",),
    "selective all": ("selective",),
    "full, keep": ("full", "keep"),
    "full, selective": ("full", "selective"),
    "full all": ("full",),
}


def _step(model: Any, inputs: dict, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]


def _run(built: zoo.ZooModel, budget: float, repeat: int) -> dict[str, Any]:
    """Peak, median step time, loss and gradients of one compiled setup (compiles first)."""
    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=budget):
        compiled = torch.compile(built.model)
        start = time.perf_counter()
        _step(compiled, built.inputs, seed=0)  # compiles
        compile_s = time.perf_counter() - start
        peak, _, _ = measure_peak(compiled, built.inputs, built.loss_fn, allocator=True)
        times = []
        for i in range(2 + repeat):
            start = time.perf_counter()
            _step(compiled, built.inputs, seed=i)
            if i >= 2:
                times.append(time.perf_counter() - start)
        loss, grads = _step(compiled, built.inputs, seed=1234)
    return {"peak": peak, "time": statistics.median(times), "loss": loss, "grads": grads, "compile_s": compile_s}


def _gap(row: dict, ref: dict) -> tuple[float, float]:
    loss_gap = float((row["loss"] - ref["loss"]).abs())
    grad_gap = max(float((a - b).abs().max()) for a, b in zip(row["grads"], ref["grads"], strict=True))
    return loss_gap, grad_gap


def _rows(name: str, budgets: list[float], repeat: int) -> list[tuple[str, dict]]:
    built = zoo.build(name, **SIZES[name])
    rows = [(f"compile budget {b:g}", _run(built, b, repeat)) for b in budgets]
    for label, policies in PLANS.items():
        for block, policy in zip(built.blocks, policies * len(built.blocks), strict=False):
            remat.wrap(built.model.get_submodule(block), policy=policy)
        rows.append((f"remat: {label}", _run(built, 1.0, repeat)))
        remat.remove(built.model)
    return rows


def _table(name: str, rows: list[tuple[str, dict]]) -> list[str]:
    ref = next(r for label, r in rows if label == "compile budget 1")
    out = [f"### {name} ({', '.join(f'{k} {v}' for k, v in SIZES[name].items())})", "",
           "| setup | peak | of budget 1 | step time | vs budget 1 | loss gap | max grad gap | compile |",
           "|---|---|---|---|---|---|---|---|"]
    for label, row in rows:
        loss_gap, grad_gap = _gap(row, ref)
        out.append(
            f"| {label} | {human_bytes(row['peak'])} | {row['peak'] / ref['peak']:.2f} | {row['time'] * 1e3:.0f} ms | "
            f"{row['time'] / ref['time']:.2f}x | {loss_gap:.1e} | {grad_gap:.1e} | {row['compile_s']:.0f} s |"
        )
    return [*out, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--budgets", default="1,0.5,0.1,0")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    if 1.0 not in budgets:
        budgets.insert(0, 1.0)  # the reference
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, inductor, CPU allocator peaks\n")
    for name in args.models.split(","):
        print("\n".join(_table(name, _rows(name, budgets, args.repeat))), flush=True)


if __name__ == "__main__":
    main()
