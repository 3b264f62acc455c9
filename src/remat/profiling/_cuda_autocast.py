"""CUDA's autocast cast lists, applied to the fake CPU tensors of a fake profile.

NOTE [CUDA autocast on fake CPU tensors]
Autocast is a dispatch key per device: CUDA tensors meet the ``AutocastCUDA``
kernels, CPU tensors the ``AutocastCPU`` ones, and the two lists differ. CUDA runs
``pow``, ``exp``, ``rsqrt``, ``layer_norm`` ... in float32 and ``softmax``,
``cumsum``, ``sum`` ... with a float32 result; CPU leaves them in bfloat16. On
GPT-2's tanh GELU (``pow(x, 3.0)``) that is the difference between float32 and
bfloat16 intermediates saved for backward in every layer. A fake profile runs on CPU
tensors, so for a CUDA target it registers, for as long as it runs, CUDA's
policies as the ``AutocastCPU`` kernels of the ops on CUDA's lists, and a
fallthrough for the ops only CPU lists (whose parts then meet CUDA's policies, as
on CUDA). A region the model opens with ``torch.autocast(x.device.type, ...)``
then behaves as on the GPU.

The lists are CUDA's from ``aten/src/ATen/autocast_mode.h`` (``AT_FORALL_*``), as
of torch 2.11-2.13. Ops that both devices run in lower precision keep the CPU
kernel, which shares the C++ cache of weight casts; the few that only CUDA casts
down (``addmv``, ``einsum`` ...) are cast without that cache.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

_LOWER = (
    "_convolution",
    "convolution",
    "addmv",
    "addr",
    "einsum",
    "mv",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
)
"""CUDA's lower-precision ops that CPU's list lacks (the shared ones keep CPU's kernel)."""
_LOWER_SHARED = (
    "_convolution.deprecated",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d.input",
    "conv_transpose3d.input",
    "prelu",
    "addmm",
    "matmul",
    "mm",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "scaled_dot_product_attention",
)
_FP32 = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "group_norm",
    "frobenius_norm.dim",
    "nuclear_norm",
    "nuclear_norm.dim",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)
_FP32_SET_OPT_DTYPE = (
    "prod",
    "prod.dim_int",
    "softmax.int",
    "log_softmax.int",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "linalg_matrix_norm.str_ord",
    "sum",
    "sum.dim_IntList",
)
_PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
)

_KEY = "AutocastCPU"


def autocast_dtype(device: str) -> torch.dtype:
    """``torch.get_autocast_dtype(device)``, also on torch versions without it."""
    getter = getattr(torch, "get_autocast_dtype", None)
    if getter is not None:
        return getter(device)
    return torch.get_autocast_cpu_dtype() if device == "cpu" else torch.get_autocast_gpu_dtype()


def _eligible(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if _eligible(value) and value.dtype != dtype:
        return value.to(dtype)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _below_autocast(op: Any, args: tuple, kwargs: dict) -> Any:
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
        return op(*args, **kwargs)


def _kernel(op: Any, policy: str) -> Any:
    names = [a.name for a in op._schema.arguments]
    position = names.index("dtype") if "dtype" in names else len(names)

    def run(*args: Any, **kwargs: Any) -> Any:
        if policy == "fp32_set_opt_dtype":
            if args and _eligible(args[0]):
                if len(args) > position and args[position] is None:
                    args = (*args[:position], torch.float32, *args[position + 1 :])
                elif len(args) <= position and kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return _below_autocast(op, args, kwargs)
        if policy == "lower":
            dtype = autocast_dtype("cpu")
        elif policy == "fp32":
            dtype = torch.float32
        else:  # promote: the widest floating dtype among the arguments
            leaves = [t for t in torch.utils._pytree.tree_flatten((args, kwargs))[0] if _eligible(t)]
            dtype = torch.float32 if any(t.dtype == torch.float32 for t in leaves) else autocast_dtype("cpu")
        return _below_autocast(op, _cast(args, dtype), {k: _cast(v, dtype) for k, v in kwargs.items()})

    return run


def _overload(name: str) -> Any:
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    return getattr(packet, overload or "default", None) if packet is not None else None


@contextlib.contextmanager
def aten_overrides(entries: list[tuple[str, Any, str]]) -> Iterator[None]:
    """Register ``(op name, kernel, dispatch key)`` over aten's own kernels while active; restored on exit.

    Process-wide while it lasts (the dispatcher has no thread-local kernels), so a fake
    profile holds it only for its own traced steps.
    """
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel", by design
            for name, kernel, key in entries:
                lib.impl(name, kernel, key)
        yield
    finally:
        lib._destroy()


def cuda_autocast_lists() -> contextlib.AbstractContextManager:
    """CPU autocast with CUDA's cast policies (NOTE [CUDA autocast on fake CPU tensors])."""
    policies = {
        **{n: "lower" for n in _LOWER},
        **{n: "fp32" for n in _FP32},
        **{n: "fp32_set_opt_dtype" for n in _FP32_SET_OPT_DTYPE},
        **{n: "promote" for n in _PROMOTE},
    }
    entries = [
        (name, _kernel(op, policy), _KEY) for name, policy in policies.items() if (op := _overload(name)) is not None
    ]
    keep = {f"aten::{n}" for n in _LOWER_SHARED}
    for qualified in torch._C._dispatch_get_registrations_for_dispatch_key(_KEY):
        name = qualified.removeprefix("aten::")
        if qualified not in keep and name not in policies and _overload(name) is not None:
            entries.append((name, torch.library.fallthrough_kernel, _KEY))
    return aten_overrides(entries)
