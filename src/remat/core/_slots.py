"""A module's parameters and buffers as a checkpointed call of it saw them, put back for its recomputation.

NOTE [A module's tensors as its forward saw them]
``torch.func.functional_call`` (and ``torch.nn.utils.stateless``) puts other tensors in a
module's parameter and buffer slots for one call and the module's own back after it; a forward
that assigns a buffer anew (``self.ema = 0.9 * self.ema + ...``) leaves another tensor in its
slot. A recomputation runs in backward, after the call, and read the slots as they were then:
the module's own weights instead of functional_call's (a parent calling each block with its
weights scaled got other gradients, NaN in some, under every policy; torch's checkpoint alike),
and the buffer the forward assigned instead of the one it read (a running mean subtracted
before a ReLU: other masks, other gradients, and the mean updated twice). So a checkpointed
call of a module records which tensor each slot of its modules held when the call began, and a
recomputation puts back, while it runs, each one that a slot no longer holds, and after it what
the slot held. A tensor whose storage was let go since (FSDP frees an unsharded weight after
the forward and gathers it again for the backward, into the slot it then holds) is not put
back. In-place writes to buffers are another matter (NOTE [What recomputation must not repeat]
in ``remat.core._region``): the recorded tensor is the written one, whose value before the
write that region's copy restores on top.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["Slots"]


def _held(t: torch.Tensor) -> bool:
    """Whether ``t`` still has the bytes it was made with (a storage resized to nothing: let go)."""
    try:
        return t.numel() == 0 or t.untyped_storage().nbytes() > 0
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage of its own (DTensor)
        return False


class Slots:
    """The tensors a module and its submodules held in their parameter and buffer slots when a call began."""

    __slots__ = ("_held",)

    def __init__(self, module: nn.Module) -> None:
        # a copy of each slot dict (at C speed, not a walk over every tensor): host time on every call of a block
        self._held: list[tuple[dict[str, Any], dict[str, Any]]] = [
            (slots, slots.copy()) for m in module.modules() for slots in (m._parameters, m._buffers) if slots
        ]

    def held_still(self) -> bool:
        """Whether every slot holds what it held when recorded (no other tensor put in for a call since)."""
        return all(
            slots.keys() == then.keys() and all(slots[n] is t for n, t in then.items()) for slots, then in self._held
        )

    @contextlib.contextmanager
    def as_called(self) -> Iterator[None]:
        """The slots as the call began while the block runs (NOTE [A module's tensors as its forward saw them])."""
        moved = []
        for slots, then in self._held:
            for name, t in then.items():
                now = slots.get(name)
                if now is not t and t is not None and _held(t):
                    moved.append((slots, name, now))
                    slots[name] = t
        try:
            yield
        finally:
            for slots, name, now in reversed(moved):
                slots[name] = now
