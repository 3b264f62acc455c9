"""Attention and dropout as CUDA runs them, on fake tensors that live on the CPU.

NOTE [Fake tensors take the target's kernels]
A fake profile runs the step on fake CPU tensors (fake tensors on a ``cuda`` device
stop a CPU-only torch at the first op), so every composite op that chooses its
kernel by device chooses the CPU's, and memory follows the CPU's kernels:

* ``F.scaled_dot_product_attention`` on CPU runs the ``_for_cpu`` flash kernel, or
  with dropout the math path, which keeps every attention map; CUDA picks cuDNN,
  flash, memory-efficient or math by dtype, head size, mask, dropout and grouped
  query heads (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``), and the
  fused kernels keep a log-sum-exp and the RNG state instead of the maps.
* ``F.dropout`` on CPU draws a float mask with ``bernoulli_`` and multiplies;
  CUDA runs ``native_dropout``, whose mask is one byte per element.

For a CUDA target, :func:`cuda_kernels` registers, for as long as the fake run
lasts, Python kernels over the composite ``aten::scaled_dot_product_attention`` and
``aten::dropout`` that do what their CUDA versions do: SDPA chooses the backend with
CUDA's rules (:class:`SdpaRules`, from the target's table) and calls that backend's
aten op, whose meta kernel runs on fake CPU tensors; the math path is written out op
by op as the CUDA composite runs it (in-place mask add, ``_safe_softmax``,
``native_dropout``). They sit where the C++ composites sit, below autocast (which
casts SDPA's inputs first, as on CUDA) and above autograd, so recomputation in
backward takes them too (a torch-function mode would not reach it: its stack is not
carried into backward). Every other op runs unchanged.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from remat.profiling._cuda_autocast import aten_overrides

aten = torch.ops.aten
_LOW = (torch.float16, torch.bfloat16)
# torch < 2.5: the math path used softmax; its cuDNN op had another signature (no bias, no log-sum-exp flag)
_SAFE_SOFTMAX = getattr(aten, "_safe_softmax", None) or torch.softmax
_CUDNN = getattr(aten, "_scaled_dot_product_cudnn_attention", None)
_CUDNN_OK = _CUDNN is not None and "compute_log_sumexp" in str(_CUDNN.default._schema)


@dataclass(frozen=True)
class SdpaRules:
    """Which SDPA backends a CUDA device and torch version take (see ``_target_data``)."""

    prefer_cudnn: bool
    """cuDNN first in the priority order (torch 2.11 on sm90/sm100), else flash, efficient, math, cuDNN."""
    efficient_gqa: bool
    """The memory-efficient kernel accepts grouped query heads (``enable_gqa``)."""
    cudnn_max_head_dim: int
    """Largest head size cuDNN takes."""
    sm_major: int
    """Compute capability, for dtype and alignment rules (flash and cuDNN need sm80+)."""


def _dense_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, gqa_ok: bool) -> bool:
    # check_tensor_shapes, check_batch_size_and_num_heads_dense, check_nonzero_sequence_lengths_dense,
    # check_last_dim_stride_equals_1_dense
    if not (q.dim() == k.dim() == v.dim() == 4) or not (q.size(0) == k.size(0) == v.size(0)):
        return False
    if min(q.size(-2), k.size(-2)) == 0 or any(t.stride(-1) != 1 for t in (q, k, v)):
        return False
    hq, hk = q.size(1), k.size(1)
    if hq == hk == v.size(1):
        return True
    return enable_gqa and gqa_ok and k.size(1) == v.size(1) and hq % hk == 0


def choose_backend(
    rules: SdpaRules,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
) -> str:
    """``cudnn``, ``flash``, ``efficient`` or ``math``: what ``select_sdp_backend`` returns on the target."""
    low = q.dtype in _LOW and rules.sm_major >= 8
    dq, dk, dv = q.size(-1), k.size(-1), v.size(-1)

    def cudnn() -> bool:
        return (
            _CUDNN_OK
            and low
            and _dense_ok(q, k, v, enable_gqa, True)
            and max(dq, dv) <= rules.cudnn_max_head_dim
            and dq % 8 == 0
            and dv % 8 == 0
            and k.size(-2) != 1
            and not (dropout_p > 0 and q.size(-2) == 1)
        )

    def flash() -> bool:
        return (
            low
            and mask is None
            and dq == dk == dv <= 256
            and _dense_ok(q, k, v, enable_gqa, True)
            and not (is_causal and q.size(-2) != k.size(-2))
        )

    def efficient() -> bool:
        if q.dtype not in (torch.float32, *_LOW) or (q.dtype == torch.bfloat16 and rules.sm_major < 8):
            return False
        # minimum_gemm_alignment: 4 on sm80+, raised to 128 bits' worth with tensor cores
        align = max(4 if rules.sm_major >= 8 else 1, 8 if q.dtype in _LOW else 4)
        return dq == dk and dq % align == 0 and dv % align == 0 and _dense_ok(q, k, v, enable_gqa, rules.efficient_gqa)

    order = ("cudnn", "flash", "efficient") if rules.prefer_cudnn else ("flash", "efficient")
    checks = {"cudnn": cudnn, "flash": flash, "efficient": efficient}
    return next((name for name in order if checks[name]()), "math")


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """convert_boolean_attn_mask: True attends, False adds -inf."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    ninf = torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device)
    return torch.where(mask, zero, ninf)


def _math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """``_scaled_dot_product_attention_math`` as it runs on real CUDA tensors."""
    root = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.size(-1)))
    q = q * root
    if is_causal:
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    mask = _additive(mask, q.dtype)
    if enable_gqa and q.size(-3) != k.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    attn = torch.matmul(q, k.transpose(-2, -1) * root)
    if mask is not None:
        attn.add_(mask)  # in place on real tensors (the composite adds out of place only for subclasses)
    attn = _SAFE_SOFTMAX(attn, -1)
    if dropout_p > 0.0:
        attn = aten.native_dropout(attn, dropout_p, True)[0]
    return torch.matmul(attn, v)


def _efficient_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """preprocess_mask: expand to 4-D, pad the last dim to a multiple of 16, keep the view."""
    mask = mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))
    last = mask.size(-1)
    if last % 16:
        return F.pad(mask, (0, 16 - last % 16))[..., :last]
    if any(s % 16 for s in mask.stride()[:3]):
        return mask.contiguous()
    return mask


def cuda_sdpa(
    rules: SdpaRules,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` with the backend and saved tensors CUDA would use."""
    backend = choose_backend(rules, q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
    if backend == "math":
        return _math(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    mask = _additive(attn_mask, q.dtype)
    if backend == "cudnn":
        return aten._scaled_dot_product_cudnn_attention(q, k, v, mask, lse, dropout_p, is_causal, False, scale=scale)[0]
    if backend == "efficient":
        mask = _efficient_mask(mask, q, k) if mask is not None else None
        return aten._scaled_dot_product_efficient_attention(q, k, v, mask, lse, dropout_p, is_causal, scale=scale)[0]
    size = q.size(-1)  # flash pads the head size to a multiple of 8 and slices the output back
    scale = scale if scale is not None else 1.0 / math.sqrt(size)
    if size % 8:
        q, k, v = (F.pad(t, (0, 8 - size % 8)) for t in (q, k, v))
    out = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    return out[..., :size] if size % 8 else out


def cuda_dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``aten::dropout`` as on CUDA: ``native_dropout`` (a one-byte mask) when it draws at all."""
    if train and 0.0 < p < 1.0 and input.numel() > 0:
        return aten.native_dropout(input, p, True)[0]
    if not train or p == 0.0 or input.numel() == 0:
        return input
    return input * torch.zeros((), dtype=input.dtype, device=input.device)  # p == 1


def cuda_kernels(rules: SdpaRules) -> contextlib.AbstractContextManager:
    """SDPA and dropout as a CUDA target runs them (NOTE [Fake tensors take the target's kernels])."""

    def sdpa(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        return cuda_sdpa(rules, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    key = "CompositeImplicitAutograd"
    return aten_overrides([("scaled_dot_product_attention", sdpa, key), ("dropout", cuda_dropout, key)])
