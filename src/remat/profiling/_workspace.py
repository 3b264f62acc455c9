"""Device memory an op uses while it runs and no tensor owns (workspace), for fake profiles.

NOTE [Workspace no tensor owns]
A tensor-level tracker counts what ops return; the CUDA caching allocator also
counts what kernels allocate for themselves and free before returning. Measured on
an H100 (``benchmarks/gpu-truth/``), per op: a reduction that splits its rows over
several thread blocks keeps partial results in global memory (GPT-2 12x768: 133
MiB in a bias gradient's ``sum``); the embedding gradient sorts its indices and
keeps one partial row per segment; the fused attention backwards keep a float32
dQ accumulator; ``_safe_softmax`` builds a boolean mask of its input's size;
``_softmax_backward_data`` a copy of its output's size. Each is modelled here as
a function of the op's shapes (and of the device's SM count where the kernel
sizes its grid by it), with the source or measurement it comes from; the
per-target table (``remat.profiling._target_data``) says which apply. The
recorder adds an op's workspace to the live bytes at that op only (it is freed
when the op returns), so it raises a segment's excess, never its delta.

Not modelled: the caching allocator rounds a request up to the size of the free
block it reuses (up to 1 MiB more for large blocks), which shows in the measured
table as 0.25-1 MiB on ops that have no workspace at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

aten = torch.ops.aten


@dataclass(frozen=True)
class Gpu:
    """What kernels size their grids by."""

    sm_count: int
    max_threads_per_sm: int


def _round(nbytes: int) -> int:
    return -(-nbytes // 512) * 512 if nbytes else 0  # the allocator's smallest unit


def _iterator(shape: Sequence[int], strides: Sequence[int], reduced: set[int]) -> tuple[list[int], list[int], int]:
    """Shape, input strides and number of reduced dims of a reduction's TensorIterator, fastest dim first.

    ``reorder_dimensions`` (reduced dims first, then ascending strides) and
    ``coalesce_dimensions`` of ``aten/src/ATen/TensorIterator.cpp``; the output is
    contiguous over the kept dims, with stride 0 on the reduced ones.
    """
    n = len(shape)
    out, step = [0] * n, 1
    for d in reversed(range(n)):
        if d not in reduced:
            out[d], step = step, step * shape[d]
    operands = (out, list(strides))

    def swap(d0: int, d1: int) -> int:
        for k, st in enumerate(operands):
            s0, s1 = st[d0], st[d1]
            if k == 0 and (s0 == 0) != (s1 == 0):
                return 1 if s1 == 0 else -1
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    perm = list(reversed(range(n)))
    for i in range(1, n):
        j = i
        for k in range(i - 1, -1, -1):
            c = swap(perm[k], perm[j])
            if c > 0:
                perm[k], perm[j] = perm[j], perm[k]
                j = k
            elif c < 0:
                break
    dims = [[shape[d], out[d], strides[d]] for d in perm]
    merged: list[list[int]] = []
    for dim in dims:
        if merged:
            last = merged[-1]
            if last[0] == 1 or dim[0] == 1 or all(last[0] * last[i] == dim[i] for i in (1, 2)):
                if last[0] == 1:
                    last[1], last[2] = dim[1], dim[2]
                last[0] *= dim[0]
                continue
        merged.append(list(dim))
    return [d[0] for d in merged], [d[2] for d in merged], sum(1 for d in merged if d[1] == 0)


def _last_pow2(n: int) -> int:
    return max(1, 1 << (max(n, 1).bit_length() - 1))


def reduce_buffer(gpu: Gpu, inp: torch.Tensor, reduced: set[int], acc_size: int) -> int:
    """Global-memory staging of a CUDA reduction (``setReduceConfig``, ``global_memory_size`` and
    ``semaphore_size`` of ``aten/src/ATen/native/cuda/Reduce.cuh``); 0 when one block reduces each output."""
    if inp.numel() == 0 or not reduced:
        return 0
    shape, strides, nred = _iterator(list(inp.shape), list(inp.stride()), reduced)
    num_outputs = math.prod(shape[nred:])
    per_output = inp.numel() // num_outputs
    on_fastest = nred == len(shape) or strides[0] < strides[nred]
    dim0, dim1 = (per_output, num_outputs) if on_fastest else (num_outputs, per_output)
    fastest = strides[0] if on_fastest else strides[nred]
    vec = 1
    if fastest == 1:
        if on_fastest and dim0 > 128 and nred == 1:
            dim0 //= 4  # vectorized loads along the reduced dim
        elif not on_fastest:
            vec = 4
            for n in [shape[nred], *(s for i, s in enumerate(strides) if i != nred)]:
                while n % vec:
                    vec //= 2
            dim0 //= vec
    max_threads = 512 // vec  # set_block_dimension
    p0 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    p1 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(p0, 32)
    height = min(p1, max_threads // width)
    width = min(p0, max_threads // height)
    step_in, step_out = (width, 1) if on_fastest else (1, width)
    values_per_thread = -(-per_output // step_in)
    split_y = values_per_thread >= height * 16 or values_per_thread >= 256
    if split_y:
        step_in *= height
    else:
        step_out *= height
    grid_x = -(-(num_outputs // vec) // step_out)
    target = gpu.sm_count * (gpu.max_threads_per_sm // (width * height))
    values_per_thread = -(-per_output // step_in)
    ctas = 1
    if split_y and values_per_thread >= 256 and grid_x <= target:
        ctas = max(min(-(-target // grid_x), -(-values_per_thread // 16)), -(-values_per_thread // 256))
    if ctas <= 1:
        return 0
    size = acc_size * num_outputs * ctas * (1 if on_fastest else width * vec)
    return _round(size) + _round(4 * grid_x)


def _dims(t: torch.Tensor, dim: Any) -> set[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return set(range(t.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return {d % max(t.dim(), 1) for d in dims}


def _acc_size(t: torch.Tensor) -> int:
    return 8 if t.dtype in (torch.float64, torch.int64, torch.complex64) else 4


def _sum(gpu: Gpu, args: tuple, kwargs: dict, out: Any) -> int:
    t = args[0]
    return reduce_buffer(gpu, t, _dims(t, args[1] if len(args) > 1 else kwargs.get("dim")), _acc_size(t))


def _safe_softmax(gpu: Gpu, args: tuple, kwargs: dict, out: Any) -> int:
    # CompositeExplicitAutograd: softmax, then eq(-inf) (one byte per element) and all() over the dim
    t = args[0]
    return _round(t.numel()) + _round(t.numel() // max(t.size(args[1]), 1)) + 2 * 512


def _softmax_backward(gpu: Gpu, args: tuple, kwargs: dict, out: Any) -> int:
    # measured equal to the output in both H100 Llama runs (the math SDPA path's backward)
    return _round(out.numel() * out.element_size())


def _embedding_backward(gpu: Gpu, args: tuple, kwargs: dict, out: Any) -> int:
    # embedding_dense_backward_cuda: sorted indices, then one partial gradient row per segment
    # of at most NROWS_PER_THREAD = 10 indices, allocated for the worst case (EmbeddingBackwardKernel.cu)
    grad, indices = args[0], args[1]
    scale_by_freq = bool(args[4]) if len(args) > 4 else bool(kwargs.get("scale_grad_by_freq", False))
    n = indices.numel()
    if n <= 3072 and not scale_by_freq:
        return 0  # the direct kernel
    rows = grad.size(-1)
    return _round((n + n // 10) * rows * 4) + 6 * _round(n * 8)


def _attention_backward(gpu: Gpu, args: tuple, kwargs: dict, out: Any) -> int:
    # float32 dQ accumulator and per-row statistics; with grouped query heads (cuDNN) float32
    # dK and dV accumulators too (fitted to the H100 runs: GPT-2 efficient and cuDNN, Llama cuDNN)
    q, k, v = args[1], args[2], args[3]
    b, h, m, d = q.shape
    hidden = 4 * b * h * m * (d + 2)
    if k.size(1) != h:
        hidden += 4 * k.size(0) * k.size(1) * k.size(2) * (k.size(3) + v.size(3))
    return _round(hidden)


_MODELS: dict[str, Callable[[Gpu, tuple, dict, Any], int]] = {
    "reduce": _sum,
    "safe_softmax": _safe_softmax,
    "softmax_backward": _softmax_backward,
    "embedding_backward": _embedding_backward,
    "attention_backward": _attention_backward,
}
_OPS = {
    "reduce": ("sum.dim_IntList", "sum.default", "mean.dim", "mean.default"),
    "safe_softmax": ("_safe_softmax.default",),
    "softmax_backward": ("_softmax_backward_data.default",),
    "embedding_backward": ("embedding_dense_backward.default",),
    "attention_backward": (
        "_scaled_dot_product_efficient_attention_backward.default",
        "_scaled_dot_product_cudnn_attention_backward.default",
    ),
}


def _op(name: str) -> Any:
    base, _, overload = name.partition(".")
    packet = getattr(aten, base, None)
    return getattr(packet, overload, None) if packet is not None else None


class Workspace:
    """Bytes of workspace of one op on ``gpu``, for the models named in ``models``."""

    def __init__(self, gpu: Gpu, models: Sequence[str]) -> None:
        self.gpu = gpu
        self.by_op = {op: _MODELS[m] for m in models for op in map(_op, _OPS[m]) if op is not None}

    def __call__(self, func: Any, args: tuple, kwargs: dict, out: Any) -> int:
        model = self.by_op.get(func)
        return model(self.gpu, args, kwargs, out) if model is not None else 0
