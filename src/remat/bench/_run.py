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
import gc
import platform
import statistics
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

import remat
from remat.bench._report import BenchReport
from remat.bench._rounds import Progress, interleaved_rounds, timed_step
from remat.bench._rows import BenchRow, MaxBatchResult
from remat.bench._setups import Setup, baselines, remat_plan, torch_compile
from remat.core._memtrack import empty_device_cache
from remat.core._policy_registry import FULL, KEEP, SELECTIVE
from remat.core._state import capture, restoring
from remat.core._step import training_step
from remat.core.measure import measure_peak
from remat.errors import RematError
from remat.planning.plan import Plan
from remat.profiling._blocks import find_blocks
from remat.profiling._types import Profile
from remat.zoo import ZooModel, build

__all__ = ["bench_model", "max_batch", "run_bench", "search_max", "QUICK"]

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
    minimum = remat.plan(prof, 1.0).min_peak_bytes
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
            "No plan lowers the peak by more than 1%: it is set where recomputation rebuilds the same "
            "tensors (inside the first block's backward), so remat keeps every block instead of "
            "recomputing for nothing."
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


def search_max(fits: Callable[[int], bool], *, start: int = 1, limit: int = 4096) -> tuple[int, list[int]]:
    """Largest ``n`` in ``[start, limit]`` with ``fits(n)`` (assumed monotone), and every ``n`` tried.

    Doubles until something does not fit, then bisects. Returns 0 when ``start`` does not fit.
    """
    tried: list[int] = []

    def check(n: int) -> bool:
        tried.append(n)
        return fits(n)

    if not check(start):
        return 0, tried
    lo, hi = start, None
    while hi is None:
        if lo >= limit:
            return limit, tried
        n = min(2 * lo, limit)
        if check(n):
            lo = n
        else:
            hi = n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if check(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried


# NOTE [max-batch runs no step predicted over the budget]
# The search for the largest batch tries batches that do not fit; on a GPU their steps
# would die of out-of-memory, or hold more than the budget allowed. So each batch is
# first profiled on fake tensors (nothing allocated; memory exact on the CPU, the GPU
# target's kernels and workspaces on CUDA), and a batch whose step is predicted over
# the budget is answered "does not fit" without running it: for ``none`` the step
# without checkpointing, for ``every-block`` every block ``full``, for ``remat`` the
# lowest peak any plan reaches. A batch predicted within the budget runs one real
# step (remat's with the plan for the budget), whose measured peak decides; a step
# that runs out of memory all the same does not fit.
def _predicted(zoo: ZooModel, blocks: list[str], strategy: str) -> tuple[Profile, int]:
    """(the fake profile of ``zoo``'s step, its predicted peak under ``strategy``; for remat the lowest)."""
    from remat.planning.apply import device_target

    prof = remat.profile(
        zoo.model,
        zoo.inputs,
        zoo.loss_fn,
        blocks=blocks,
        fake=True,
        target=device_target(zoo.model, zoo.inputs),
        policies=(KEEP, FULL) if strategy != "remat" else (KEEP, SELECTIVE, FULL),
    )
    if strategy == "none":
        return prof, prof.baseline_peak_bytes
    if strategy == "every-block":
        return prof, prof.predict_peak({b.name: FULL for b in prof.blocks})
    return prof, remat.plan(prof, strategy="none").min_peak_bytes


def _step_peak(zoo: ZooModel, setup: Setup) -> int:
    """The peak of one step with ``setup`` on, holding no copy of the parameters beside it (NOTE [Snapshots a
    step without an optimizer needs]): on the device the budget is for, the snapshot would count."""
    gc.collect()  # the models of batches tried before, in reference cycles, still hold their memory
    empty_device_cache()
    setup.on(zoo.model)
    try:
        state = capture(zoo.model, "remat.bench.max_batch", parameters=False)
        with restoring("remat.bench.max_batch", state.restore):
            return measure_peak(zoo.model, zoo.inputs, zoo.loss_fn)[0]
    finally:
        setup.off(zoo.model)


def _measured_within(zoo: ZooModel, setup: Setup, budget: int, batch: int, peaks: dict[int, int]) -> bool:
    try:
        peaks[batch] = _step_peak(zoo, setup)
    except torch.OutOfMemoryError:  # predicted within, measured over: the device said so
        gc.collect()
        empty_device_cache()
        return False
    return peaks[batch] <= budget


def _fits_batch(
    name: str, options: dict, strategy: str, budget: int, peaks: dict[int, int], predictions: dict[int, int], batch: int
) -> bool:
    return _fits(name, options, strategy, budget, batch, peaks, predictions)


def _fits(
    name: str, options: dict, strategy: str, budget: int, batch: int, peaks: dict[int, int], predictions: dict[int, int]
) -> bool:
    zoo = build(name, **{**options, "batch": batch})
    blocks = list(zoo.blocks) or find_blocks(zoo.model)
    prof, predictions[batch] = _predicted(zoo, blocks, strategy)  # NOTE [max-batch runs no step predicted ...]
    if predictions[batch] > budget:
        return False
    if strategy == "remat":
        return _measured_within(zoo, remat_plan(remat.plan(prof, budget), "remat"), budget, batch, peaks)
    none, every, *_ = baselines(zoo.model, blocks)
    return _measured_within(zoo, {"none": none, "every-block": every}[strategy], budget, batch, peaks)


def max_batch(
    name: str,
    budget_bytes: int,
    *,
    strategies: Sequence[str] = ("none", "every-block", "remat"),
    options: dict | None = None,
    limit: int = 1024,
    progress: Progress | None = None,
) -> MaxBatchResult:
    """Largest batch of zoo model ``name`` whose measured peak fits ``budget_bytes``, per strategy."""
    unknown = [s for s in strategies if s not in ("none", "every-block", "remat")]
    if unknown:
        raise RematError(f"remat.bench.max_batch: unknown strategies {unknown}; use none, every-block, remat.")
    options = {k: v for k, v in (options or {}).items() if k != "batch"}
    batches, peaks, tried = {}, {}, {}
    for i, strategy in enumerate(strategies):
        if progress:
            progress(f"{name}: max batch with {strategy}", i, len(strategies))
        seen: dict[int, int] = {}
        predicted: dict[int, int] = {}
        batches[strategy], tried[strategy] = search_max(
            partial(_fits_batch, name, options, strategy, budget_bytes, seen, predicted), limit=limit
        )
        peaks[strategy] = seen.get(batches[strategy], 0)
    return MaxBatchResult(name, budget_bytes, batches, peaks, tried)
