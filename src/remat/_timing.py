"""What checkpointing a block adds to the step time, on real tensors.

NOTE [The time model]
A block's extra time under a policy has two parts.

* Recomputation. The profiler times every recomputation directly (an observer
  in ``remat._region`` reports the seconds between entering and leaving it), so
  the cost of rerunning a block, with selective checkpointing's cache lookups and
  torch's early stop, is a measured median, not a model.
* Bookkeeping outside recomputation: torch's checkpoint per call (frames, RNG
  stash, pack/unpack hooks) and the dispatch modes that see every forward op
  (remat's copy-on-write watcher, torch's selective-checkpoint cache). These are
  host-side costs of a few microseconds per op; they are calibrated once per
  process on tiny tensors, where they are all there is to time, and charged per
  call and per forward op.

Differences of whole-step times are not used: on a shared CPU two steps differ
by 10-15% run to run, more than most of the costs being measured.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable

import torch

_OPS = 200
_CALLS = 50
_REPEAT = 7


def _best(run: Callable[[], None]) -> float:
    """Fastest of a few runs: the run least disturbed by other processes."""
    run()
    best = float("inf")
    for _ in range(_REPEAT):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _op_chain(context: Callable[[], contextlib.AbstractContextManager]) -> Callable[[], None]:
    def run() -> None:
        x = torch.zeros(4)
        with context():
            for _ in range(_OPS):
                x = x + 1.0

    return run


def _call_loop(policy: str | None) -> Callable[[], None]:
    from remat.checkpoint import checkpoint

    def run() -> None:
        x = torch.zeros(4, requires_grad=True)
        for _ in range(_CALLS):
            y = x * 2.0 if policy is None else checkpoint(torch.mul, x, 2.0, policy=policy)
            y.sum().backward()

    return run


@functools.cache
def bookkeeping() -> dict[str, tuple[float, float]]:
    """Per policy: (seconds per checkpointed call, seconds per forward op), measured once."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from remat._region import Region, _CopyOnWrite
    from remat.checkpoint import _save_compute_intensive

    def watcher() -> contextlib.AbstractContextManager:
        return _CopyOnWrite(Region((), {}))

    @contextlib.contextmanager
    def watcher_and_cache():  # noqa: ANN202
        with watcher(), create_selective_checkpoint_contexts(_save_compute_intensive)[0]:
            yield

    plain_ops = _best(_op_chain(contextlib.nullcontext))
    plain_calls = _best(_call_loop(None))
    out = {"keep": (0.0, 0.0)}
    for policy, context in (("full", watcher), ("selective", watcher_and_cache)):
        per_op = max(0.0, _best(_op_chain(context)) - plain_ops) / _OPS
        per_call = max(0.0, _best(_call_loop(policy)) - plain_calls) / _CALLS
        out[policy] = (per_call, per_op)
    return out


def extra_time(policy: str, *, recompute_s: float, calls: int, fwd_ops: int) -> float:
    """Extra step time of one block under ``policy``: measured recompute plus bookkeeping."""
    if policy == "keep":
        return 0.0
    per_call, per_op = bookkeeping()[policy]
    return recompute_s + calls * per_call + fwd_ops * per_op
