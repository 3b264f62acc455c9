"""Per-target tables for fake profiles: the kernels a CUDA device takes and the memory they use
beyond the tensors they return. Data only; the models they name live in ``_workspace``.

NOTE [Where the H100 table comes from]
Source: ``benchmarks/gpu-truth/h100.json`` and ``h100-bf16.json``, measured on one
NVIDIA H100 80GB HBM3 with torch 2.11.0+cu130 and transformers 5.17 (fp32, and
bf16 autocast) for GPT-2 and Llama zoo configurations. From them:

* SDPA: fp32 GPT-2 (dropout 0.1, no mask) ran ``_scaled_dot_product_efficient_attention``;
  fp32 Llama (``enable_gqa``, no mask) ran the math path, so the memory-efficient
  kernel took no grouped query heads in 2.11; bf16 runs took cuDNN, first in the
  priority order on sm90, with dropout 0.1 too.
* Workspace (``hidden_workspace``, per op): the reduction staging buffer of
  ``Reduce.cuh`` reproduces every measured ``sum.dim_IntList`` maximum to the byte
  with 132 SMs and 2048 threads per SM; the other models are fitted to the
  maxima (see ``_workspace``).
* Persistent bytes: every measured ``resting`` exceeds parameters + buffers +
  inputs, counted as the allocator's blocks (NOTE [Blocks the caching allocator
  hands out]), by 65.1 to 69.1 MiB, allocated once and kept. One exceeds them by
  56.0 MiB: fp32 Llama 4x1024, whose 11 MiB parameters took no 12 MiB blocks there
  (likely blocks cached from the configurations measured before it in the same
  process). NOTE [Library memory kept across steps] models the 66 MiB.

The A100 entry uses the same kernel rules for sm80 (cuDNN last in the order, as
torch 2.11 orders it off sm90/sm100) and the same workspace models with A100's SM
count; it has no measurement behind it.

NOTE [Library memory kept across steps]
torch allocates a cuBLAS workspace through the caching allocator for each (cuBLAS
handle, stream) that runs a matmul, and keeps it: ``CUBLAS_WORKSPACE_CONFIG``'s
``:SIZE:COUNT`` pairs (KiB) sum to its size, by default 32 MiB on sm90 and later,
8 MiB + 128 KiB before (``parseChosenWorkspaceSize`` in torch's
``CublasHandlePool.cpp``). Handles are per thread, and a training step runs matmuls
on two, the caller's (forward) and the autograd engine's (backward), on one stream:
two workspaces, 64 MiB on an H100, and 2 MiB more were measured there (66 MiB, the
typical excess above). The 2 MiB are taken as they are for every device (cuBLASLt's
workspaces, likely; not verified), and the workspaces follow the variable, which
``torch.use_deterministic_algorithms`` asks users to set (``:4096:8`` or ``:16:8``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from remat.profiling._cuda_kernels import SdpaRules
from remat.profiling._workspace import Gpu

MiB = 1 << 20


@dataclass(frozen=True)
class CudaTable:
    """What a fake profile for one CUDA device adds to a CPU trace."""

    source: str
    """Where the numbers come from."""
    device: str
    torch: str
    """The torch version the kernel choices and workspaces were seen with."""
    gpu: Gpu
    sdpa: SdpaRules
    cublas_workspace_bytes: int
    """cuBLAS's workspace per handle and stream where ``CUBLAS_WORKSPACE_CONFIG`` is unset."""
    other_library_bytes: int
    """Kept across steps beside the cuBLAS workspaces (NOTE [Library memory kept across steps])."""
    workspace: tuple[str, ...]
    """Workspace models that apply (names in ``remat.profiling._workspace``)."""
    measured: bool

    @property
    def persistent_bytes(self) -> int:
        """Allocated once and kept across steps (library workspaces): part of resting memory."""
        return CUBLAS_HANDLES * cublas_workspace(self.cublas_workspace_bytes) + self.other_library_bytes


#: Threads that run a training step's matmuls, each with its own cuBLAS handle: the caller's and autograd's.
CUBLAS_HANDLES = 2


def cublas_workspace(default: int) -> int:
    """The cuBLAS workspace per handle and stream ``CUBLAS_WORKSPACE_CONFIG`` asks for (``default`` where it is
    unset or not understood, as torch takes it)."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if not pairs:
        return default
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


_MODELS = ("reduce", "safe_softmax", "softmax_backward", "embedding_backward", "attention_backward")

H100 = CudaTable(
    source="benchmarks/gpu-truth/h100.json, h100-bf16.json (measured 2026-11-23)",
    device="NVIDIA H100 80GB HBM3",
    torch="2.11.0+cu130",
    gpu=Gpu(sm_count=132, max_threads_per_sm=2048),
    sdpa=SdpaRules(prefer_cudnn=True, efficient_gqa=False, cudnn_max_head_dim=128, sm_major=9),
    cublas_workspace_bytes=32 * MiB,  # :4096:8
    other_library_bytes=2 * MiB,
    workspace=_MODELS,
    measured=True,
)

A100 = CudaTable(
    source="H100 rules and models with A100's SM count; not measured",
    device="NVIDIA A100 80GB",
    torch="2.11",
    gpu=Gpu(sm_count=108, max_threads_per_sm=2048),
    sdpa=SdpaRules(prefer_cudnn=False, efficient_gqa=False, cudnn_max_head_dim=128, sm_major=8),
    cublas_workspace_bytes=8 * MiB + 128 * 1024,  # :4096:2:16:8
    other_library_bytes=2 * MiB,
    workspace=_MODELS,
    measured=False,
)
