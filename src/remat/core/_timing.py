"""What checkpointing a block adds to the step time, on real tensors.

NOTE [The time model]
A block's extra time under a policy has two parts, both measured in the
profile's own interleaved timed steps.

* Recomputation. The profiler times every recomputation directly (an observer
  in ``remat.core._region`` reports the seconds between entering and leaving it), so
  the cost of rerunning a block, with selective checkpointing's cache lookups and
  torch's early stop, is a measured median, not a model.
* A slower forward. Under a policy the forward itself costs more: the
  checkpoint call, and for op-level selective checkpointing torch's caching
  dispatch mode, which sees every op (tens of microseconds per op on CPU, more on
  large convolutions than on tiny ops, so it is not calibrated on tiny ops); a
  module's "selective" runs op-level only on its first call, later ones pay their
  regions' saved-tensor hooks (NOTE [Selective by module]). The
  forward times of all blocks are pooled into one slowdown per policy
  (sum of per-block medians under the policy over the sum without
  checkpointing), and each block is charged that fraction of its own forward.
  Pooling keeps per-block noise out; remat's copy-on-write mode runs only on a
  callable's first call (NOTE [Watching only when needed]), so it is not in it.

Differences of whole-step times are not used: on a shared CPU two steps differ
by 10-15% run to run, more than most of the costs being measured.

NOTE [Clocks]
On CPU an op has finished when it returns, so ``perf_counter`` marks time it. On
CUDA an op returns once its kernel is queued: host time between two points is
launch time, which under-measures recomputation badly when kernels are long
(Llama 1B fp32 on an H100: +5% predicted for full recompute, +30% measured). A
:class:`CudaClock` records events on the current stream instead and reads them
after one synchronisation per step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from remat.core._policy_registry import KEEP


class WallClock:
    """Host time: right where ops finish when they return (CPU)."""

    def mark(self) -> float:
        return time.perf_counter()

    def settle(self) -> None:
        """Make the marks readable (nothing to wait for on the host)."""

    def seconds(self, start: Any, end: Any) -> float:
        return end - start


class CudaClock:
    """Stream time from CUDA events (NOTE [Clocks]); read after :meth:`settle`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def settle(self) -> None:
        torch.cuda.synchronize(self.device)

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3


def clock_for(device: torch.device) -> WallClock | CudaClock:
    """The clock that times work on ``device``."""
    return CudaClock(device) if device.type == "cuda" else WallClock()


def forward_slowdown(fwd_s: Mapping[str, float]) -> dict[str, float]:
    """Per policy: fractional extra forward time, from the summed block forward times per policy."""
    base = fwd_s.get(KEEP, 0.0)
    if base <= 0:
        return {p: 0.0 for p in fwd_s}
    return {p: 0.0 if p == KEEP else max(0.0, t / base - 1.0) for p, t in fwd_s.items()}


def extra_time(policy: str, *, recompute_s: float, fwd_s: float, slowdown: float) -> float:
    """Extra step time of one block under ``policy``: its measured recompute plus its slower forward."""
    if policy == KEEP:
        return 0.0
    return recompute_s + slowdown * fwd_s
