"""The workspace a CPU recurrent layer keeps for its backward, which a fake run does not see.

NOTE [A recurrent layer's workspace on the CPU]
``nn.LSTM`` in training runs each layer and direction through ``aten.mkldnn_rnn_layer`` on the
CPU (``nn.GRU`` and ``nn.RNN`` do not), whose oneDNN kernel returns a workspace (the gates and
states of every time step) that autograd keeps for the backward. Its meta kernel returns an
empty one, so a fake step missed about four times the layer's output per layer: a stack of six
LSTM blocks (batch 8, 128 steps, 64 features) was profiled at a 6.4 MiB peak without
checkpointing where the real step holds 29.4 MiB, and ``remat.auto(model, x, 0.6)`` aimed at 0.6
of the wrong figure. The workspace's size is oneDNN's to choose (its parts padded to good
leading dimensions and page-aligned), so it is not computed from a formula here but measured:
the real kernel runs on zeros of the layer's shapes, off every dispatch mode, where that
allocates at most ``MEASURED`` bytes; beyond them, it runs at three smaller shapes of about that
size and the size is extrapolated as oneDNN lays it out, a constant (the bias) plus parts per
sample (the initial states) plus parts per sample and step (the gates and the states of each
step). Each part is page-aligned: measured on small shapes, the pages rounded up made the slope
wrong (64 KiB under at 300 steps), so the shapes measured are as large as ``MEASURED`` allows
(``tests/profiling/test_rnn_workspace.py`` compares with the kernel). CUDA's cuDNN reserve space
has no such query off a GPU (torch's meta kernel says as much): a fake profile for a CUDA target
still leaves it out, and the verification step on the device measures it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["RNN_LAYER", "with_workspace"]

#: The op whose CPU kernel returns the workspace its meta kernel leaves empty.
RNN_LAYER = frozenset(
    getattr(torch.ops.aten.mkldnn_rnn_layer, o) for o in torch.ops.aten.mkldnn_rnn_layer.overloads() if "out" not in o
)
#: The most bytes a measurement of the workspace allocates (NOTE [A recurrent layer's workspace on the CPU]).
MEASURED = 32 << 20


def with_workspace(out: Any, argument: Callable[[str], Any]) -> Any:
    """``out`` of a fake ``mkldnn_rnn_layer`` with the workspace the CPU kernel returns in place of the empty one;
    ``argument(name)``: the op's argument of that name in its schema."""
    source, workspace = argument("input"), out[3]
    if not (argument("train") and torch.is_grad_enabled()) or workspace.numel() or argument("batch_sizes"):
        return out  # the kernel returns none in inference, or without grad mode
    steps, samples = source.shape[:2]  # time-major whatever ``batch_first`` says: nn.LSTM transposes first
    key = (
        source.shape[2],
        argument("hidden_size"),
        argument("weight1").shape[1],
        source.dtype,
        argument("mode"),
        argument("has_biases"),
        argument("batch_first"),
        argument("cx_") is not None,
    )
    size = _extrapolated(key, steps, samples)
    return (*out[:3], workspace.new_empty(size), *out[4:])


def _extrapolated(key: tuple, steps: int, samples: int) -> int:
    """The workspace's bytes at ``steps`` x ``samples``: measured there if that costs at most ``MEASURED``
    bytes, else extrapolated from three measurements that each cost about that much."""
    t, n = steps, samples
    while _cost(key, t, n) > MEASURED and (t > 1 or n > 1):
        t, n = (t, (n + 1) // 2) if n >= t else ((t + 1) // 2, n)  # halve the longer side
    if (t, n) == (steps, samples):
        return _measured(key, steps, samples)
    t2, n2 = max(1, t // 2), max(1, n // 2)
    base = _measured(key, t, n)
    per_step = (base - _measured(key, t2, n)) / ((t - t2) * n) if t > t2 else 0.0  # per sample and step
    per_sample = (base - _measured(key, t, n2)) / (n - n2) - per_step * t if n > n2 else 0.0
    constant = base - per_sample * n - per_step * t * n
    return max(0, round(constant + per_sample * samples + per_step * steps * samples))


def _cost(key: tuple, steps: int, samples: int) -> int:
    """About the bytes the kernel allocates at ``steps`` x ``samples``: its input, output and workspace (the gates
    and three states of every step)."""
    features, hidden, _, dtype = key[:4]
    return steps * samples * (features + 8 * hidden + 3 * max(features, hidden)) * dtype.itemsize


@functools.lru_cache(maxsize=256)
def _measured(key: tuple, steps: int, samples: int) -> int:
    """The workspace's bytes the CPU kernel returns for a layer of ``key`` at ``steps`` x ``samples``."""
    features, hidden, state, dtype, mode, has_biases, batch_first, cell = key
    gates = 4 * hidden  # LSTM's (the only mode torch runs through oneDNN)
    with _disable_current_modes():
        x = torch.zeros(steps, samples, features, dtype=dtype)
        w_ih, w_hh = torch.zeros(gates, features, dtype=dtype), torch.zeros(gates, state, dtype=dtype)
        b = torch.zeros(gates, dtype=dtype)
        hx = torch.zeros(samples, state, dtype=dtype)
        cx = torch.zeros(samples, hidden, dtype=dtype) if cell else None
        out = torch.ops.aten.mkldnn_rnn_layer(
            x, w_ih, w_hh, b, b, hx, cx, False, [], mode, hidden, 1, has_biases, False, batch_first, True
        )
        return int(out[3].untyped_storage().nbytes())
