"""What a training step computed, in a few numbers per tensor: to tell two steps apart without keeping either.

NOTE [Comparing steps without keeping them]
``remat.auto`` checks that a plan trains the same function as the model without
checkpointing: the same loss, every gradient and every buffer after the step. Keeping
the reference step's gradients would cost a copy of the parameters (host memory on a
large model, and a device-to-host copy of all of them), so each tensor is summarised
on its own device instead: an integer digest of its bits (equal bits give equal
digests; a changed element changes it unless two changes cancel in both sums, which
no real difference does), and its float64 sum and sum of squares. Bit-equal steps have
equal digests. Where kernels are not deterministic (atomics in CUDA backward kernels
reorder sums), two correct steps differ in the last bits: there the sums are compared
within a tolerance of the tensor's magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from remat.core._costs import spent

__all__ = ["Fingerprint", "fingerprint"]

#: Elements summarised at a time: at most ``_CHUNK``, at least ``_MIN_CHUNK``, else a ``_PARTS``-th of the
#: tensor, so that the int64 and float64 copies stay small beside it (NOTE [A summary fits beside the step]).
_CHUNK = 1 << 20
_MIN_CHUNK = 4096
_PARTS = 16
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Relative tolerance of the sums where kernels are not deterministic, by element size.
_RTOL = {1: 1e-2, 2: 1e-2, 4: 1e-4, 8: 1e-8}


@dataclass(frozen=True)
class _Summary:
    digest: tuple[int, int]
    total: float
    squares: float
    magnitude: float
    element_size: int

    def close_to(self, other: _Summary) -> bool:
        rtol = _RTOL.get(self.element_size, 1e-4)
        return (
            abs(self.total - other.total) <= rtol * self.magnitude + 1e-12
            and abs(self.squares - other.squares) <= rtol * self.squares + 1e-12
        )


# NOTE [A summary fits beside the step]
# The gradients are summarised right after the step, while all of them are alive, on a
# device the step may fill to its budget (auto verifies plans on devices the step
# without checkpointing does not fit). Whole-tensor int64 and float64 copies would add
# four to eight times the largest gradient to the step's peak; a chunk of a sixteenth
# of the tensor (at most a million elements), with the arithmetic in place, adds at
# most its size. The digest weights each element by its index in the whole tensor, and
# the chunks depend on the tensor's size alone, so equal tensors get equal digests.
def _summarise(t: torch.Tensor) -> _Summary:
    t = t.detach()
    if t.is_complex():  # both parts, as floats: a cast to float64 would drop the imaginary one
        t = torch.view_as_real(t.resolve_conj())
    flat = t.reshape(-1)
    bits_dtype = _BITS.get(flat.element_size())
    first = second = 0
    total = squares = magnitude = 0.0
    size = min(_CHUNK, max(_MIN_CHUNK, flat.numel() // _PARTS))
    for start in range(0, flat.numel(), size):
        chunk = flat[start : start + size]
        if bits_dtype is not None:
            bits = chunk.contiguous().view(bits_dtype).to(torch.int64)
            first += int(bits.sum())
            weights = torch.arange(start, start + bits.numel(), device=bits.device, dtype=torch.int64)
            second += int(weights.remainder_(65521).add_(1).mul_(bits).sum())
            del bits, weights
        values = chunk.to(torch.float64) if chunk.is_floating_point() else chunk.double()
        total += float(values.sum())
        magnitude += float(values.abs().sum())
        squares += float(torch.dot(values, values))  # no copy: values may be the tensor itself (float64)
        del values
    return _Summary((first, second), total, squares, magnitude, flat.element_size())


@dataclass(frozen=True)
class Fingerprint:
    """A step's loss, gradients and buffers, summarised (NOTE [Comparing steps without keeping them])."""

    loss: float
    tensors: dict[str, _Summary | None]
    """Per parameter's gradient (``grad:name``, None: no gradient) and buffer (``buffer:name``)."""

    def differences(self, other: Fingerprint, *, exact: bool) -> list[str]:
        """Names whose summaries differ (``exact``: bit for bit; else within the tolerance); ``loss`` first."""
        out = []
        for name in self.tensors.keys() | other.tensors.keys():
            a, b = self.tensors.get(name), other.tensors.get(name)
            if (a is None) != (b is None):
                out.append(name)
            elif a is not None and b is not None and a.digest != b.digest and (exact or not a.close_to(b)):
                out.append(name)
        return ([] if _same_loss(self.loss, other.loss, exact) else ["loss"]) + sorted(out)


def _same_loss(a: float, b: float, exact: bool) -> bool:
    if exact or a != a or b != b:
        return a == b
    return abs(a - b) <= 1e-4 * max(abs(a), abs(b)) + 1e-12


def fingerprint(model: nn.Module, loss: float) -> Fingerprint:
    """Summarise what the step just run on ``model`` left: its loss, every gradient, every buffer."""
    tensors: dict[str, _Summary | None] = {}
    with spent("fingerprints"), torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                tensors[f"grad:{name}"] = None if p.grad is None else _summarise(p.grad)
        for name, b in model.named_buffers():
            if b is not None:
                tensors[f"buffer:{name}"] = _summarise(b)
    return Fingerprint(float(loss), tensors)
