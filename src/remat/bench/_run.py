"""``remat.bench``: remat beside today's options, measured side by side in one process.

NOTE [How the numbers are taken]
Every setup of a model (no checkpointing, torch on every block, sqrt(n)
segments, torch selective, remat's plans) runs in the same process on the same
weights and batch. Peak memory comes from one tracked step of each
(``remat.measure``); step time from interleaved rounds after warm-up rounds,
every setup once per round in a shuffled order (seeded), so that drift and
position effects on a shared machine hit every setup alike. A setup's time
ratio is the median over rounds of its time over no checkpointing's time in the
same round; comparisons between two setups use their per-round differences
(``remat.bench._report``), since on a shared CPU a step's time moves by 10% from
one round to the next. Gradients and buffers after one step are compared bit for
bit with no checkpointing under the same seed.

NOTE [Compiled steps]
``torch.compile``'s generated kernels allocate without going through the
dispatcher, so remat's storage tracker cannot see them. On CPU a compiled
setup's peak is taken from the allocator's own reports instead
(``remat.core._memtrack.allocator_peak``; on eager steps the two agree to within a
few bytes), after a first step that compiles. Its gradients are not expected to
be bit-equal: inductor fuses and reorders floating-point work, and its dropout
draws from its own random stream.
"""

from __future__ import annotations

import datetime
import platform
import statistics
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

import remat
from remat.bench._report import BenchReport
from remat.bench._rounds import Progress, interleaved_rounds, timed_step
from remat.bench._rows import BenchRow
from remat.bench._setups import Setup, baselines, remat_plan, torch_compile
from remat.core._state import capture
from remat.core._step import training_step
from remat.core.measure import measure_peak
from remat.errors import RematError
from remat.planning.plan import Plan, no_saving_reason
from remat.zoo import ZooModel, build

__all__ = ["bench_model", "run_bench", "QUICK"]

_COMPILE_NOTE = (
    "torch.compile rows: peak from the CPU allocator's own reports (compiled kernels bypass the "
    "dispatcher that remat's tracker sits in), taken after the step that compiles; gradients are not "
    "bit-equal by design (inductor fuses and reorders float work and draws dropout from its own RNG). "
    "Compile time is not in the step time."
)

#: Small sizes for ``--quick`` (the smoke test in the suite).
QUICK: dict[str, dict[str, Any]] = {
    "seed-cifar": {"batch": 32},
    "gpt2": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 512, "seq": 64, "batch": 2},
    "llama": {
        "layers": 4,
        "hidden": 64,
        "intermediate": 172,
        "heads": 4,
        "kv_heads": 2,
        "vocab": 512,
        "seq": 64,
        "batch": 2,
    },
    "vit": {"layers": 4, "hidden": 64, "intermediate": 128, "heads": 4, "image": 32, "patch": 8, "classes": 10},
    "resnet50": {
        "image": 32,
        "batch": 2,
        "depths": (1, 1),
        "hidden_sizes": (32, 64),
        "embedding_size": 16,
        "classes": 10,
    },
}


def _same(ref: dict[str, torch.Tensor | None], got: dict[str, torch.Tensor | None]) -> bool:
    return ref.keys() == got.keys() and all(_equal(ref[k], got[k]) for k in ref)


def _equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


def _one_step_state(zoo: ZooModel, setup: Setup) -> tuple[dict, dict]:
    """Gradients and buffers after one step under ``setup`` (same seed every time); model restored."""
    state = capture(zoo.model)
    setup.on(zoo.model)
    try:
        torch.manual_seed(1234)
        zoo.model.zero_grad(set_to_none=True)
        training_step(zoo.model, zoo.inputs, zoo.loss_fn)
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in zoo.model.named_parameters()}
        buffers = {n: b.clone() for n, b in zoo.model.named_buffers()}
        return grads, buffers
    finally:
        setup.off(zoo.model)
        state.restore()


def _check(ref: tuple[dict, dict], zoo: ZooModel, setup: Setup) -> tuple[bool, bool]:
    grads, buffers = _one_step_state(zoo, setup)
    return _same(ref[0], grads), _same(ref[1], buffers)


def _peak(zoo: ZooModel, setup: Setup) -> int:
    setup.on(zoo.model)
    try:
        if setup.kind == "compile" and all(p.device.type == "cpu" for p in zoo.model.parameters()):
            return _compiled_peak(zoo)
        return remat.measure(zoo.model, zoo.inputs, zoo.loss_fn, warmup=0, repeat=1).peak_bytes
    finally:
        setup.off(zoo.model)


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _compiled_peak(zoo: ZooModel) -> int:
    """Peak of a compiled step on CPU, from the allocator (NOTE [Compiled steps])."""
    state = capture(zoo.model)
    try:
        training_step(zoo.model, zoo.inputs, zoo.loss_fn)  # compiles, outside the measured step
        return measure_peak(zoo.model, zoo.inputs, zoo.loss_fn, allocator=True)[0]
    finally:
        state.restore()


def _interleaved_times(
    zoo: ZooModel, setups: Sequence[Setup], *, warmup: int, repeat: int, progress: Progress | None
) -> list[list[float]]:
    """Per setup, its step time in each timed round (every setup once per round, shuffled order)."""
    steps = [
        timed_step(zoo.model, zoo.inputs, zoo.loss_fn, on=partial(s.on, zoo.model), off=partial(s.off, zoo.model))
        for s in setups
    ]
    state = capture(zoo.model)
    try:
        return interleaved_rounds(steps, warmup=warmup, repeat=repeat, label=f"{zoo.name}: timing", progress=progress)
    finally:
        state.restore()


def _remat_setups(
    zoo: ZooModel, prof: remat.Profile, budgets: Sequence[Any], baseline_peaks: dict[str, int], notes: list[str]
) -> list[Setup]:
    """One setup per distinct plan; budgets that give the same plan share its row (label ``a = b``)."""
    whole = remat.plan(prof, 1.0)
    minimum = whole.min_peak_bytes
    wanted = [(f"remat {b}", b if b != "min" else minimum) for b in budgets]
    wanted += [(f"remat @ peak of {name}", peak) for name, peak in baseline_peaks.items() if name != "none"]
    plans: dict[tuple, tuple[list[str], Plan]] = {}
    for label, budget in wanted:
        try:
            plan = remat.plan(prof, budget)
        except RematError:
            notes.append(f"{label}: budget below the minimum peak remat can reach ({minimum} bytes); not run.")
            continue
        key = (tuple(sorted(plan.assignment.items())), plan.segments)
        plans.setdefault(key, ([], plan))[0].append(label)
    if minimum >= 0.99 * prof.baseline_peak_bytes:
        notes.append(
            "No plan lowers the peak by more than 1%: "
            + no_saving_reason(whole.without_grad, len(prof.blocks))
            + " remat keeps every block instead of recomputing for nothing."
        )
    return [remat_plan(plan, " = ".join(labels)) for labels, plan in plans.values()]


def _check_compile_budgets(budgets: Sequence[float]) -> None:
    """A RematError unless every ``torch.compile`` activation memory budget is a fraction in [0, 1]."""
    bad = [b for b in budgets if not 0.0 <= b <= 1.0]
    if bad:
        raise RematError(
            f"remat.bench: torch.compile budgets {bad} are outside [0, 1]: give activation memory "
            "budgets between 0 and 1 (1: save what the default partitioner saves, 0: recompute all)."
        )


def bench_model(
    zoo: ZooModel,
    *,
    budgets: Sequence[Any] = (0.9, 0.75, 0.5, 0.35, "min"),
    warmup: int = 2,
    repeat: int = 7,
    compile_budgets: Sequence[float] = (),
    progress: Progress | None = None,
) -> tuple[list[BenchRow], list[str]]:
    """Rows for one model: baselines, remat at ``budgets`` and at each baseline's measured peak.

    ``compile_budgets``: also ``torch.compile`` at these activation memory
    budgets (each compiles once, minutes on a small CPU; NOTE [Compiled steps]).
    """
    _check_compile_budgets(compile_budgets)
    notes: list[str] = []
    prof = remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, blocks=list(zoo.blocks) or None, repeat=3, warmup=1)
    base = baselines(zoo.model, [b.name for b in prof.blocks]) + [torch_compile(b) for b in compile_budgets]
    if compile_budgets:
        notes.append(_COMPILE_NOTE)
    peaks = {s.name: _peak(zoo, s) for s in base}
    setups = base + _remat_setups(zoo, prof, budgets, peaks, notes)
    for s in setups[len(base) :]:
        peaks[s.name] = _peak(zoo, s)
    reference = _one_step_state(zoo, base[0])
    graphs = _compiled_graphs()
    times = _interleaved_times(zoo, setups, warmup=warmup, repeat=repeat, progress=progress)
    if _compiled_graphs() != graphs:
        notes.append(
            f"torch.compile compiled {_compiled_graphs() - graphs} graph(s) during the timed rounds "
            "(a guard failed), so some compile rows' times include compiling."
        )
    rows = []
    for setup, t in zip(setups, times):
        grads_ok, buffers_ok = _check(reference, zoo, setup)
        plan = setup.plan
        ratios = tuple(a / b for a, b in zip(t, times[0]))
        rows.append(
            BenchRow(
                model=zoo.name,
                setup=setup.name,
                kind=setup.kind,
                peak_bytes=peaks[setup.name],
                peak_ratio=peaks[setup.name] / peaks["none"],
                time_s=statistics.median(t),
                time_ratio=statistics.median(ratios),
                round_ratios=ratios,
                grads_equal=grads_ok,
                buffers_equal=buffers_ok,
                budget_bytes=plan.budget_bytes if plan else None,
                predicted_peak_bytes=plan.predicted_peak_bytes if plan else None,
                predicted_overhead=plan.predicted_overhead if plan else None,
            )
        )
    return rows, notes


def run_bench(
    models: Sequence[str],
    *,
    quick: bool = False,
    budgets: Sequence[Any] = (0.9, 0.75, 0.5, 0.35, "min"),
    options: dict[str, dict] | None = None,
    warmup: int = 2,
    repeat: int = 7,
    compile_budgets: Sequence[float] = (),
    progress: Progress | None = None,
    command: str = "",
) -> BenchReport:
    """Benchmark each zoo model in ``models`` (``quick``: small sizes, 2 timed rounds)."""
    _check_compile_budgets(compile_budgets)  # before building or profiling anything
    rows: list[BenchRow] = []
    notes: dict[str, list[str]] = {}
    for i, name in enumerate(models):
        sizes = {**(QUICK.get(name, {}) if quick else {}), **((options or {}).get(name, {}))}
        if progress:
            progress(f"{name}: profiling", i, len(models))
        zoo = build(name, **sizes)
        model_rows, notes[name] = bench_model(
            zoo,
            budgets=budgets,
            warmup=min(warmup, 1) if quick else warmup,
            repeat=2 if quick else repeat,
            compile_budgets=compile_budgets,
            progress=progress,
        )
        rows.extend(model_rows)
    meta = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "threads": str(torch.get_num_threads()),
        "sizes": "quick" if quick else "zoo defaults",
        "command": command,
    }
    return BenchReport(rows, meta, notes)
