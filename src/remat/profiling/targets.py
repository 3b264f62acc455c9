"""Devices to plan for, and the roofline cost model that times ops on fake tensors.

GPU figures are dense (no sparsity) peaks from NVIDIA's datasheets; this CPU's
are measured by a short micro-benchmark and cached. An op takes
``max(FLOPs / FLOP/s, bytes moved / bandwidth)`` seconds at the target's
achievable fraction of peak. A GPU target also carries its table
(``remat.profiling._target_data``): the kernels a fake run routes to and the
workspace and persistent memory it adds (NOTE [Fake tensors take the target's kernels]).
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from remat.core._memtrack import BlockBytes, op_tensors
from remat.errors import RematError
from remat.profiling._allocator import cuda_blocks
from remat.profiling._target_data import A100, H100, CudaTable

__all__ = ["Target", "get_target", "TARGETS"]


@dataclass(frozen=True)
class Target:
    """A device's peak rates, for timing ops that never run."""

    name: str
    """Short name (``h100``, ``a100``, ``cpu``)."""
    matmul_flops: dict[str, float]
    """Dense matmul/conv FLOP/s by dtype name (``float32``, ``bfloat16`` ...)."""
    bytes_per_s: float
    """Memory bandwidth."""
    memory_bytes: int
    """Device memory, the natural budget."""
    efficiency: float = 0.7
    """Fraction of peak rates real kernels reach."""
    cuda: CudaTable | None = None
    """For a CUDA device: kernel rules, workspace models and persistent bytes; None runs CPU kernels."""

    def block_bytes(self) -> BlockBytes | None:
        """What this device's allocator counts for a storage of so many bytes (None: exactly, as on a CPU)."""
        return cuda_blocks() if self.cuda is not None else None

    def op_seconds(self, func: Any, args: tuple, kwargs: dict, out: Any, flops: int) -> float:
        """Roofline time of one op; views move no data (NOTE [Metadata queries are timed as kernels])."""
        if getattr(func, "is_view", False):
            return 0.0
        tensors = op_tensors((args, kwargs, out))  # NOTE [Op arguments without pytree]
        moved = sum(t.numel() * t.element_size() for t in tensors)
        dtype = str(tensors[-1].dtype).removeprefix("torch.") if tensors else "float32"
        rate = self.matmul_flops.get(dtype, self.matmul_flops["float32"])
        return max(flops / rate, moved / self.bytes_per_s) / self.efficiency


# NOTE [Metadata queries are timed as kernels]
# ``prim.device`` (the autograd engine asks it of every gradient) and size or stride queries are timed here
# as moving the tensor they are asked of, though no kernel runs. Timed at zero, the predicted step-time
# ratios agreed less with the H100 truth files (docs/profiling.md, "Time on a target"): what they add stands
# in for the engine's per-gradient work, which the roofline does not see. They stay until the model has a
# term for that work.


TARGETS = {
    # H100 SXM5: FP32 67 TFLOPS, TF32 495, BF16/FP16 989 (dense); HBM3 3.35 TB/s; 80 GB.
    "h100": Target("h100", {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12}, 3.35e12, 80 * 10**9, cuda=H100),
    # A100 SXM 80GB: FP32 19.5 TFLOPS, BF16/FP16 312 (dense); HBM2e 2.039 TB/s; 80 GB.
    "a100": Target(
        "a100", {"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12}, 2.039e12, 80 * 10**9, cuda=A100
    ),
}


def _cache_path() -> pathlib.Path:
    root = os.environ.get("REMAT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "remat")
    return pathlib.Path(root) / f"cpu-torch{torch.__version__}-threads{torch.get_num_threads()}.json"


# NOTE [The CPU is calibrated on its fastest runs]
# The calibration is cached for good (per torch version and thread count), so a measurement disturbed by another
# process skews every later fake profile for ``cpu`` on that machine: medians taken while a test suite ran beside
# them put the bandwidth at a third of an idle run's, a recomputed bmm then weighed less than the copies around
# it, and a test of what selective recomputes failed. The fastest of several runs is the least disturbed: another
# process can slow a run, never speed it up.


def _fastest_seconds(fn: Any, repeat: int = 9) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def calibrate_cpu() -> Target:
    """Measure this CPU's matmul FLOP/s and copy bandwidth (about a second; NOTE above)."""
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops = 2 * n**3 / _fastest_seconds(lambda: a @ b)
    x = torch.randn(8 * 2**20)
    y = torch.empty_like(x)
    bandwidth = 2 * x.numel() * 4 / _fastest_seconds(lambda: torch.add(x, 1, out=y))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Target("cpu", {"float32": flops, "bfloat16": flops / 2, "float16": flops / 2}, bandwidth, memory, 1.0)


def block_bytes_of(name: str | None) -> BlockBytes | None:
    """What target ``name``'s allocator counts for a storage (None: exactly, as on a CPU or a real profile)."""
    target = TARGETS.get(name.lower()) if name is not None else None
    return target.block_bytes() if target is not None else None


def get_target(name: str) -> Target:
    """``h100``, ``a100``, or ``cpu`` (calibrated once, cached under ~/.cache/remat)."""
    key = name.lower()
    if key in TARGETS:
        return TARGETS[key]
    if key != "cpu":
        raise RematError(f"remat: unknown target {name!r}; known targets: {', '.join([*TARGETS, 'cpu'])}.")
    path = _cache_path()
    try:
        return Target(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        target = calibrate_cpu()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(asdict(target)))
        except OSError:
            pass  # a read-only home only costs a recalibration next time
        return target
