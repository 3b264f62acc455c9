"""``remat.bench.max_batch``: the largest batch of a zoo model whose measured step fits a memory budget.

The search doubles then bisects (``search_max``); see NOTE [max-batch runs no step predicted over the
budget] below for why no batch predicted over the budget is ever run.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from functools import partial

import torch

import remat
from remat.bench._rounds import Progress
from remat.bench._rows import MaxBatchResult
from remat.bench._setups import Setup, baselines, remat_plan
from remat.core._memtrack import empty_device_cache
from remat.core._policy_registry import FULL, KEEP, SELECTIVE
from remat.core._state import capture, restoring
from remat.core.measure import measure_peak
from remat.errors import RematError
from remat.profiling._blocks import find_blocks
from remat.profiling._types import Profile
from remat.zoo import ZooModel, build

__all__ = ["max_batch", "search_max"]


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
