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
  hands out]), by 65.1 to 69.1 MiB, allocated once and kept (cuBLAS/cuBLASLt
  workspaces are the likely owners; not verified). One exceeds them by 56.0 MiB:
  fp32 Llama 4x1024, whose 11 MiB parameters took no 12 MiB blocks there (likely
  blocks cached from the configurations measured before it in the same process).
  66 MiB, the typical value, is added to a fake profile's resting bytes.

The A100 entry uses the same kernel rules for sm80 (cuDNN last in the order, as
torch 2.11 orders it off sm90/sm100) and the same workspace models with A100's SM
count; it has no measurement behind it and no persistent bytes.
"""

from __future__ import annotations

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
    persistent_bytes: int
    """Allocated once and kept across steps (library workspaces): part of resting memory."""
    workspace: tuple[str, ...]
    """Workspace models that apply (names in ``remat.profiling._workspace``)."""
    measured: bool


_MODELS = ("reduce", "safe_softmax", "softmax_backward", "embedding_backward", "attention_backward")

H100 = CudaTable(
    source="benchmarks/gpu-truth/h100.json, h100-bf16.json (measured 2026-11-23)",
    device="NVIDIA H100 80GB HBM3",
    torch="2.11.0+cu130",
    gpu=Gpu(sm_count=132, max_threads_per_sm=2048),
    sdpa=SdpaRules(prefer_cudnn=True, efficient_gqa=False, cudnn_max_head_dim=128, sm_major=9),
    persistent_bytes=66 * MiB,
    workspace=_MODELS,
    measured=True,
)

A100 = CudaTable(
    source="H100 rules and models with A100's SM count; not measured",
    device="NVIDIA A100 80GB",
    torch="2.11",
    gpu=Gpu(sm_count=108, max_threads_per_sm=2048),
    sdpa=SdpaRules(prefer_cudnn=False, efficient_gqa=False, cudnn_max_head_dim=128, sm_major=8),
    persistent_bytes=0,
    workspace=_MODELS,
    measured=False,
)
