"""remat plans under torch.compile against compile's own ``activation_memory_budget``, at equal measured peaks.

    PYTHONPATH=src python benchmarks/compile_budget.py                        # gpt2, llama, vit; aot_eager
    PYTHONPATH=src python benchmarks/compile_budget.py --models gpt2 --backend inductor --rounds 7
    PYTHONPATH=src python benchmarks/compile_budget.py --write   # also into BENCHMARKS.md, one section per backend

Per zoo model (small sizes, below; GPT-2 and ViT with dropout 0.1):

* compile's budget: ``torch._functorch.config.activation_memory_budget`` at each of
  ``--budgets``, no checkpointing in the model; budget 1 is the reference (compiled,
  no checkpointing);
* remat + compile: ``remat.plan`` at a sweep of budgets (``--sweep`` points between the
  plan floor and 1), each plan applied and compiled; its compiled peak measured.

Each compile point is matched with the remat plan whose measured compiled peak is the
highest at or below the compile point's peak (equal or lower memory). Every setup is
timed in the same interleaved rounds (``remat.bench``'s rounds,
every setup once per round in a shuffled order, ratios to the reference within a round,
median over rounds). Gradients: one step with the same seed for every setup; loss and
largest gradient difference against the reference (``torch.equal`` is "= ref").

Peaks: the CPU allocator's own reports of one compiled step after the step that
compiles (``measure_peak(allocator=True)``), with the model's parameters and inputs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import platform
import random
import statistics
import time
from typing import Any

import _sections
import torch

import remat
from remat import zoo
from remat.bench._rounds import interleaved_rounds, ratio_to
from remat.core._loop import Loop
from remat.core._step import training_step
from remat.core.measure import measure_peak
from remat.planning._verify import _compiled_profile
from remat.profiling._format import human_bytes

SIZES = {
    "gpt2": {"layers": 4, "hidden": 128, "heads": 4, "vocab": 512, "seq": 128, "batch": 4, "dropout": 0.1},
    "llama": {
        "layers": 4,
        "hidden": 128,
        "intermediate": 344,
        "heads": 4,
        "kv_heads": 2,
        "vocab": 512,
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
        "batch": 8,
        "dropout": 0.1,
    },
}


class Setup:
    """One compiled training step: a copy of the model, compiled under its own budget (and plan)."""

    def __init__(
        self, label: str, built: zoo.ZooModel, backend: str, budget: float = 1.0, plan: remat.Plan | None = None
    ) -> None:
        self.label, self.budget, self.plan, self.inputs, self.loss_fn = label, budget, plan, built.inputs, built.loss_fn
        model = copy.deepcopy(built.model)
        if plan is not None:
            remat.apply(model, plan)
        self.model = torch.compile(model, backend=_own_backend(backend))
        start = time.perf_counter()
        self.peak = self._peak()  # the first step compiles
        self.compile_s = time.perf_counter() - start

    def _patched(self) -> contextlib.AbstractContextManager:
        return torch._functorch.config.patch(activation_memory_budget=self.budget)

    def _peak(self) -> int:
        with self._patched():
            measure_peak(self.model, self.inputs, self.loss_fn, allocator=True)
            peak, _, _ = measure_peak(self.model, self.inputs, self.loss_fn, allocator=True)
        return peak

    def timed(self) -> float:
        with self._patched():
            self.model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            training_step(self.model, self.inputs, self.loss_fn)
            return time.perf_counter() - start

    def gradients(self, seed: int = 1234) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with self._patched():
            self.model.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            loss = training_step(self.model, self.inputs, self.loss_fn)
        return loss, [p.grad.detach().clone() for p in self.model.parameters()]


def _own_backend(name: str) -> Any:
    """``name``'s compiler as a new callable: dynamo guards each compiled entry on its backend, so copies of one
    model compiled under different budgets keep their own graphs (with one backend they share the first)."""
    from torch._dynamo.backends.registry import lookup_backend

    compiler = lookup_backend(name)

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> Any:
        return compiler(graph, example_inputs)

    return backend


def _policies(plan: remat.Plan) -> str:
    short = {"keep": "k", "selective": "s", "selective-ops": "o", "full": "f"}
    return "".join(short[p] for p in plan.assignment.values())


def remat_sweep(built: zoo.ZooModel, backend: str, points: int, planner: str) -> list[Setup]:
    """remat plans at ``points`` budgets from the one-level floor to 1, distinct assignments, compiled.

    ``planner="compiled"``: planned with the chain fitted to compiled peaks, as ``remat.auto(compiled=backend)``
    plans (NOTE [Plans for compiled execution]; budgets are fractions of the compiled peak without
    checkpointing); ``"eager"``: planned with the eager profile (budgets: fractions of the eager peak)."""
    prof = remat.profile(built.model, built.inputs, built.loss_fn)
    if planner == "compiled":
        prof, _, _ = _compiled_profile(built.model, built.inputs, built.loss_fn, prof, backend, Loop())
        remat.remove(built.model)
    floor = remat.plan(prof, strategy="none", nested=False).min_peak_bytes / prof.baseline_peak_bytes
    fractions = [floor + (1 - floor) * i / (points - 1) for i in range(points)]
    setups, seen = [], set()
    for fraction in fractions:
        plan = remat.plan(prof, min(1.0, fraction + 1e-9), nested=False)
        key = tuple(plan.assignment.items())
        if key not in seen:
            seen.add(key)
            setups.append(Setup(f"remat {fraction:.2f} ({_policies(plan)})", built, backend, plan=plan))
    return setups


def match(point: Setup, sweep: list[Setup]) -> Setup | None:
    """The remat setup with the highest peak at or below ``point``'s."""
    fitting = [s for s in sweep if s.peak <= point.peak]
    return max(fitting, key=lambda s: s.peak) if fitting else None


def _gaps(setup: Setup, ref_loss: torch.Tensor, ref_grads: list[torch.Tensor]) -> str:
    loss, grads = setup.gradients()
    if torch.equal(loss, ref_loss) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True)):
        return "= ref"
    gap = max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads, strict=True))
    return f"loss {float((loss - ref_loss).abs()):.1e}, grad {gap:.1e}"


def _slower(a: list[float], b: list[float], ref: list[float]) -> str:
    """How much slower ``a`` is than ``b``: the median over rounds of their difference in units of the reference's
    step in the same round, with its 90% bootstrap interval ("beyond noise" when the interval excludes 0)."""
    diffs = [(x - y) / r for x, y, r in zip(a, b, ref, strict=True)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(2000))
    lo, hi = medians[100], medians[1899]
    return f"{statistics.median(diffs):+.2f} [{lo:+.2f}, {hi:+.2f}]{', beyond noise' if lo > 0 else ''}"


def model_table(name: str, budgets: list[float], backend: str, points: int, rounds: int, planner: str) -> list[str]:
    built = zoo.build(name, **SIZES[name])
    torch._dynamo.reset()
    compiled = [Setup(f"compile {b:g}", built, backend, budget=b) for b in budgets]
    ref = compiled[0]
    sweep = remat_sweep(built, backend, points, planner)
    pairs = [(c, match(c, sweep)) for c in compiled]
    timed = [*compiled, *sweep]  # every setup, so that dominance can be checked against every remat point
    times = dict(
        zip(map(id, timed), interleaved_rounds([s.timed for s in timed], warmup=2, repeat=rounds), strict=True)
    )
    ratio = {id(s): ratio_to(times[id(s)], times[id(ref)]) for s in timed}
    ref_loss, ref_grads = ref.gradients()
    out = [
        f"### {name} ({', '.join(f'{k} {v}' for k, v in SIZES[name].items())})",
        "",
        "| compile budget | peak | time | gradients | remat plan at or below | peak | time | gradients |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c, r in pairs:
        left = f"| {c.label} | {c.peak / ref.peak:.3f} | {ratio[id(c)]:.2f}x | {_gaps(c, ref_loss, ref_grads)} |"
        right = (
            " none reaches it | | | |"
            if r is None
            else f" {r.label} | {r.peak / ref.peak:.3f} | {ratio[id(r)]:.2f}x | {_gaps(r, ref_loss, ref_grads)} |"
        )
        out.append(left + right)
    monotone = all(a.peak <= b.peak for a, b in zip(sweep, sweep[1:], strict=False))
    dominated = [
        f"{c.label} over {r.label} (time {_slower(times[id(r)], times[id(c)], times[id(ref)])})"
        for c in compiled[1:]
        for r in sweep
        if c.peak < r.peak and ratio[id(c)] < ratio[id(r)]
    ]
    beyond = sum("beyond noise" in d for d in dominated)
    out += [
        "",
        f"Reference (compiled, no checkpointing): {human_bytes(ref.peak)}. remat sweep, from the floor up "
        "(compiled peak of the reference, time): "
        + ", ".join(f"{s.label} {s.peak / ref.peak:.3f} {ratio[id(s)]:.2f}x" for s in sweep)
        + f". remat's peaks monotone in the budget: {'yes' if monotone else 'NO'}. remat points dominated by "
        f"a compile budget (lower peak and time; {beyond} of {len(dominated)} beyond noise): "
        f"{'; '.join(dominated) or 'none'}. Compiles: "
        + ", ".join(f"{s.compile_s:.0f}" for s in [*compiled, *sweep])
        + " s.",
        "",
    ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama,vit")
    parser.add_argument("--budgets", default="1,0.8,0.5,0.3,0.1,0")
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--sweep", type=int, default=10, help="remat budgets between the plan floor and 1")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--planner",
        choices=("compiled", "eager"),
        default="compiled",
        help="plan remat's sweep for compiled peaks (as remat.auto(compiled=...)) or eager ones",
    )
    _sections.add_write_option(parser)
    args = parser.parse_args()
    title = f"remat under torch.compile against compile's activation_memory_budget ({args.backend})"
    with _sections.recorded(__file__, title, write_to=args.write, part=args.backend):
        _tables(args)


def _tables(args: argparse.Namespace) -> None:
    budgets = [float(b) for b in args.budgets.split(",")]
    budgets = [1.0, *(b for b in budgets if b != 1.0)]  # the reference first
    # Every setup is its own model copy: more compiled versions of one forward than dynamo's default 8.
    torch._dynamo.config.recompile_limit = 256
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, {args.backend}, CPU allocator peaks, remat planned for "
        f"{args.planner} peaks\n",
        flush=True,
    )
    for name in args.models.split(","):
        start = time.perf_counter()
        print("\n".join(model_table(name, budgets, args.backend, args.sweep, args.rounds, args.planner)), flush=True)
        print(f"({name}: {time.perf_counter() - start:.0f} s)\n", flush=True)


if __name__ == "__main__":
    main()
