"""Fake tensors laid out as the device's kernels lay out their outputs.

NOTE [Output layouts of the device's kernels]
Memory in a step follows layouts: a transpose of a contiguous tensor is a view, a
``reshape`` of a non-contiguous one (a ``Linear`` on it, an ``AccumulateGrad`` into a
contiguous ``.grad``) is a copy. Fake tensors take their strides from meta kernels,
and most meta kernels lay out their outputs as the CPU and CUDA kernels do (elementwise
ops, norms, softmax, convolutions, pooling, reductions, sorts: checked op by op in
``tests/profiling/test_kernel_layouts.py``). BatchNorm is the exception: its CPU, CUDA
and cuDNN kernels allocate the output (and the backward's input gradient) in the
memory format the input suggests (contiguous, or channels-last for a 4-d or 5-d
channels-last input), copying a non-contiguous input first, while its meta kernel keeps
the input's strides. On BatchNorm between transposes, the fake output transposed back
is contiguous where the real one is not, and the fake step skipped the copies the real
one makes after it (a full block predicted one activation low). So while a fake profile
runs, the ops of ``SUGGESTED_FORMAT`` return their first output in the format their
``input`` argument suggests, as the device's kernels do.

NOTE [A reduced loss on its unreduced storage]
``mse_loss``, ``smooth_l1_loss``, ``binary_cross_entropy`` and ``soft_margin_loss`` with a
reduction compute the loss of every element into their output and then shrink it to the
0-d result (ATen's structured kernels and ``resize_``, which never gives memory back): the
scalar loss keeps a storage of the prediction's size until it is dropped, after backward.
Their fake implementations (Python references) return a 4-byte scalar. PatchTST's MSE
loss made every fake prediction 188 bytes low, and a fake floor that a real step refused
(a 1000x1000 prediction: 4 MB). So in a fake run these ops return their result on a
storage of the unreduced size, as the kernels do (measured on CPU against a real step in
``tests/profiling/test_kernel_layouts.py``; read from ATen's code, shared with CUDA).

NOTE [Mixed-type norms keep float statistics]
LayerNorm, GroupNorm and BatchNorm on a bfloat16 or float16 input with a float32
parameter or running statistic (a low-precision activation through an fp32 norm, as CPU
autocast runs it) compute and return their mean and inverse deviation in float32: twice
the bytes of the input-dtype statistics their fake implementations return, and the
forward saves them for backward. A bf16 MLP under CPU autocast was predicted 256 bytes
low per LayerNorm, and auto's fake floor was refused by a real step. So in a fake run
these ops return those statistics in float32, and GroupNorm's fake backward, which
computes in its statistics' dtype, returns its input gradient in the input's dtype as the
kernel does (CPU measured in ``tests/profiling/test_kernel_layouts.py``). CUDA's LayerNorm
keeps them in its float accumulation type whatever the parameters
(``RowwiseMomentsCUDAKernel<T, T_ACC>`` writes ``T_ACC`` statistics): a fake profile for a
CUDA target gives a bf16 model's LayerNorms float32 statistics too (read from the kernel's
source, not yet measured on a GPU).

NOTE [Grouped matmuls in float32]
Mixture-of-experts layers in transformers 5 run their experts with ``torch._grouped_mm``
where the device has it. Its meta kernel checks what CUDA's kernel accepts (bfloat16
inputs up to torch 2.14; float32 and float16 too from 2.15); the CPU kernel runs float32 and
float16, so a float32 Mixtral or OLMoE failed in a fake profile on torch 2.13 and 2.14
("Expected inputs of BF16 type") while its real step ran. For a CPU target a fake
run gives ``_grouped_mm`` on those types the output the CPU kernel allocates: a new
contiguous tensor of the output shape, in ``out_dtype`` or the input's type. For a CUDA
target the meta kernel's check stands: it implements the CUDA kernel's checks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._prims_common import suggest_memory_format
from torch.utils._python_dispatch import TorchDispatchMode

from remat.profiling._rnn_workspace import RNN_LAYER, with_workspace

aten = torch.ops.aten


def _overloads(*names: str) -> frozenset:
    """The functional overloads (``out=`` variants write where they are told) of the ops that exist here."""
    out = []
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None:
            out += [getattr(packet, o) for o in packet.overloads() if "out" not in o]
    return frozenset(out)


#: Ops whose device kernels allocate their first output in the memory format ``input`` suggests.
SUGGESTED_FORMAT = _overloads(
    "native_batch_norm",
    "native_batch_norm_backward",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional",
    "_batch_norm_with_update",
    "_batch_norm_with_update_functional",
    "_batch_norm_no_update",
    "batch_norm_backward",
    "cudnn_batch_norm",
    "cudnn_batch_norm_backward",
    "miopen_batch_norm",
    "miopen_batch_norm_backward",
)


#: Ops whose device kernels leave a reduced loss on the storage of the unreduced one (NOTE [A reduced loss on its
#: unreduced storage]).
REDUCED_IN_PLACE = _overloads("mse_loss", "smooth_l1_loss", "binary_cross_entropy", "soft_margin_loss")

#: Norms whose kernels keep float32 statistics for a low-precision input beside float32 parameters (NOTE [Mixed-type
#: norms keep float statistics]); outputs 1 and 2 are the statistics.
MIXED_STATISTICS = _overloads(
    "native_layer_norm",
    "native_group_norm",
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "_batch_norm_with_update",
    "_batch_norm_no_update",
)
_LOW = (torch.bfloat16, torch.float16)
#: NOTE [Grouped matmuls in float32].
GROUPED_MM = _overloads("_grouped_mm")
#: The types the CPU kernel of ``_grouped_mm`` runs beside bfloat16, which its meta kernel refuses up to torch 2.14.
_GROUPED_MM_CPU_ONLY = (torch.float32, torch.float16)
_PARAMETERS = ("weight", "bias", "running_mean", "running_var")


def _argument(func: Any, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else kwargs.get(name, default)
    return default


def _on_unreduced_storage(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """``out``, a reduced loss, on a storage of the unreduced loss's size, as the device's kernel leaves it."""
    reduction, beta = _argument(func, args, kwargs, "reduction", 1), _argument(func, args, kwargs, "beta", 1.0)
    source, target = _argument(func, args, kwargs, "self"), _argument(func, args, kwargs, "target")
    if reduction == 0 or beta == 0 or not isinstance(out, torch.Tensor) or out.dim() != 0:
        return out  # unreduced, or smooth_l1_loss with beta 0 (the kernel runs l1_loss, which allocates anew)
    if not isinstance(source, torch.Tensor) or not isinstance(target, torch.Tensor):
        return out
    kept = torch.empty(torch.broadcast_shapes(source.shape, target.shape), dtype=out.dtype, device=out.device)
    return kept.resize_(())


_CUDA_FLOAT_STATISTICS = _overloads("native_layer_norm")
#: Backwards whose fake implementation computes in its statistics' dtype, where the kernel returns the input's.
_GRADIENT_IN_INPUT_DTYPE = _overloads("native_group_norm_backward")

#: The ops whose outputs ``laid_out`` may replace.
RELAID = SUGGESTED_FORMAT | REDUCED_IN_PLACE | MIXED_STATISTICS | _GRADIENT_IN_INPUT_DTYPE


def _float_statistics(func: Any, args: tuple, kwargs: dict, out: Any, cuda: bool) -> Any:
    """``out`` with its statistics in float32 where the op mixes a low-precision input with float32 parameters, or
    (``cuda``) where CUDA's kernel accumulates a low-precision input in float32 anyway."""
    source = _argument(func, args, kwargs, "input")
    if not isinstance(source, torch.Tensor) or source.dtype not in _LOW or not isinstance(out, tuple):
        return out
    mixed = any(
        isinstance(p, torch.Tensor) and p.dtype == torch.float32
        for p in (_argument(func, args, kwargs, name) for name in _PARAMETERS)
    )
    if not (mixed or (cuda and func in _CUDA_FLOAT_STATISTICS)):
        return out
    if len(out) < 3 or not all(isinstance(t, torch.Tensor) for t in out[1:3]):
        return out
    stats = tuple(t if t.dtype == torch.float32 else t.new_empty(t.shape, dtype=torch.float32) for t in out[1:3])
    return (out[0], *stats, *out[3:])


def _input_of(func: Any, args: tuple, kwargs: dict) -> Any:
    return _argument(func, args, kwargs, "input")


def _grouped_mm_output(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """What the CPU kernel of ``_grouped_mm`` allocates: 2-d by 3-d (tokens by experts' weights) gives
    tokens x out, 3-d by 2-d the same from the other side, 2-d by 2-d (offsets along the contraction,
    the weights' gradient) one matrix per group, 3-d by 3-d a batched product."""
    a, b = _argument(func, args, kwargs, "self"), _argument(func, args, kwargs, "mat2")
    offs = _argument(func, args, kwargs, "offs")
    shape: tuple[int, ...]
    if a.dim() == 2 and b.dim() == 2:
        shape = (offs.shape[0], a.shape[0], b.shape[1])
    elif a.dim() == 2:
        shape = (a.shape[0], b.shape[-1])
    elif b.dim() == 2:
        shape = (a.shape[1], b.shape[1])
    else:
        shape = (a.shape[0], a.shape[1], b.shape[-1])
    dtype = _argument(func, args, kwargs, "out_dtype") or a.dtype
    return torch.empty(shape, dtype=dtype, device=a.device)


def kernel_output(func: Any, args: tuple, kwargs: dict, *, cuda: bool = False) -> Any:
    """``func(*args, **kwargs)`` on fake tensors, or, where its meta kernel refuses what the target's kernel runs,
    the output that kernel allocates (NOTE [Grouped matmuls in float32]), or leaves out what it returns (NOTE [A
    recurrent layer's workspace on the CPU] in remat.profiling._rnn_workspace)."""
    if func in GROUPED_MM and not cuda:
        a = _argument(func, args, kwargs, "self")
        if isinstance(a, torch.Tensor) and a.dtype in _GROUPED_MM_CPU_ONLY:
            return _grouped_mm_output(func, args, kwargs)
    if func in RNN_LAYER and not cuda:
        return with_workspace(func(*args, **kwargs), lambda name: _argument(func, args, kwargs, name))
    return func(*args, **kwargs)


def laid_out(func: Any, args: tuple, kwargs: dict, out: Any, *, cuda: bool = False) -> Any:
    """``out`` of ``func`` with its outputs laid out as the device's kernels lay them out (``out`` itself when they
    already are, or ``func`` is not in ``RELAID``); ``cuda``: CUDA's kernels. Run with the modes below the caller's
    active."""
    if func in REDUCED_IN_PLACE:
        return _on_unreduced_storage(func, args, kwargs, out)
    if func in MIXED_STATISTICS:
        out = _float_statistics(func, args, kwargs, out, cuda)
    if func in _GRADIENT_IN_INPUT_DTYPE:
        source = _argument(func, args, kwargs, "input")
        first = out[0] if isinstance(out, tuple) else None
        if isinstance(source, torch.Tensor) and isinstance(first, torch.Tensor) and first.dtype != source.dtype:
            out = (first.to(source.dtype), *out[1:])
    if func not in SUGGESTED_FORMAT:
        return out
    source = _input_of(func, args, kwargs)
    first = out[0] if isinstance(out, tuple) else out
    if not isinstance(source, torch.Tensor) or not isinstance(first, torch.Tensor):
        return out
    laid = first.contiguous(memory_format=suggest_memory_format(source))
    if laid is first:
        return out
    return (laid, *out[1:]) if isinstance(out, tuple) else laid


class KernelLayouts(TorchDispatchMode):
    """Inside a fake run: the outputs of ``RELAID``'s ops laid out as the device's kernels lay them out (NOTE
    [Output layouts of the device's kernels], NOTE [A reduced loss on its unreduced storage]). A fake profile
    does the same inside its value shadows' layer (``ValueShadows(layouts=True)``): each dispatch layer costs
    every op of the step."""

    def __init__(self, *, cuda: bool = False) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        return laid_out(func, args, kwargs, kernel_output(func, args, kwargs, cuda=self.cuda), cuda=self.cuda)
