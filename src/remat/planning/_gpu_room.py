"""``budget=None`` on CUDA: the room this GPU has for the step, and what its caching allocator reserved.

NOTE [Fitting a device]
What runs out on a GPU is what the caching allocator *reserves*, not what tensors hold:
it rounds every block up (to 512 bytes) and carves blocks out of segments it reserves
whole (2 MiB for blocks under 1 MiB, 20 MiB for blocks of 1 to 10 MiB, larger ones rounded
to 2 MiB), and a freed block can only be reused by a request that fits it, so reserved runs
above allocated: by up to a 20 MiB segment at any moment, however small the step. With
``budget=None`` remat plans the allocated peak for

    budget = allocated now + (1 - FRAGMENTATION_MARGIN) * (capacity - allocated now)
    capacity = reserved now + free on the device (``torch.cuda.mem_get_info``),
               at most the process's share (``set_per_process_memory_fraction`` x total)

that is, the tensors already live, plus all the memory the step may take (the device's
free memory and the allocator's cache) less a tenth for the allocator's rounding and
fragmentation. Verification then measures both peaks of the real step
(``max_memory_allocated`` and ``max_memory_reserved`` after a reset) and holds the plan to
reserved fitting the capacity; a step whose reserved peak does not fit is over the
budget (re-planned with the excess as a margin), and the plan's notes give both peaks.
A budget the user gives is kept, but where it is above what ``budget=None`` would plan for,
auto says so (``over_the_room_note``, a warning and a note): a plan that close to the GPU's
capacity may run a later step out of memory, its blocks laid out otherwise than in the step
verified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from remat.profiling._format import human_bytes

__all__ = ["FRAGMENTATION_MARGIN", "Room", "over_the_room_note", "reserved_note", "room_on"]

#: Share of the memory free for the step that ``budget=None`` leaves unplanned, for the caching
#: allocator's rounding and fragmentation (NOTE [Fitting a device]).
FRAGMENTATION_MARGIN = 0.1


@dataclass(frozen=True)
class Room:
    """The memory of one GPU as the caching allocator sees it, in bytes (NOTE [Fitting a device])."""

    allocated: int
    """Held by live tensors now (``memory_allocated``)."""
    reserved: int
    """Held by the caching allocator now (``memory_reserved``): the tensors and its cache."""
    free: int
    """Free on the device (``mem_get_info``)."""
    allowed: int | None = None
    """The most this process may reserve (``set_per_process_memory_fraction`` of the total; None: no cap)."""
    margin: float = FRAGMENTATION_MARGIN

    @property
    def capacity(self) -> int:
        """The most the allocator can reserve: what it holds and the device's free memory, within ``allowed``."""
        held_and_free = self.reserved + self.free
        return held_and_free if self.allowed is None else min(held_and_free, self.allowed)

    @property
    def budget_bytes(self) -> int:
        """The allocated peak ``budget=None`` plans for."""
        return self.allocated + int((self.capacity - self.allocated) * (1 - self.margin))

    def note(self) -> str:
        return (
            f"budget=None: this GPU has {human_bytes(self.capacity - self.allocated)} for the step "
            f"({human_bytes(self.free)} free, {human_bytes(self.reserved - self.allocated)} in the allocator's "
            f"cache); less {self.margin:.0%} for its fragmentation, the budget is {human_bytes(self.budget_bytes)} "
            f"({self.budget_bytes} bytes) with the {human_bytes(self.allocated)} live now."
        )


def room_on(device: torch.device) -> Room:
    """The room on CUDA ``device`` now (``cuda`` alone: the current GPU)."""
    if device.index is None:  # torch's per-process fraction wants an index
        device = torch.device(device.type, torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    allowed = int(fraction * total) if fraction < 1 else None
    return Room(torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device), free, allowed)


def reserved_note(allocated_peak: int, reserved_peak: int) -> str:
    """What a verified step's two peaks say about fragmentation."""
    return (
        f"The caching allocator reserved {human_bytes(reserved_peak)} at most in the verified step, for an "
        f"allocated peak of {human_bytes(allocated_peak)} ({reserved_peak / max(allocated_peak, 1) - 1:+.1%})."
    )


def over_the_room_note(budget_bytes: int, room: Room) -> str | None:
    """What a budget given in bytes above ``room.budget_bytes`` risks (None: it leaves the allocator its margin).

    Such a budget is kept (it is the user's), but its plan's allocated peak may sit so close to the GPU's capacity
    that a later step, with the allocator's blocks laid out otherwise, runs out where the verified one did not."""
    if budget_bytes <= room.budget_bytes:
        return None
    return (
        f"The budget {human_bytes(budget_bytes)} leaves this GPU's caching allocator less than its "
        f"{room.margin:.0%} for rounding and fragmentation ({human_bytes(room.capacity)} it may reserve, "
        f"{human_bytes(room.allocated)} live before the step): a later step may run out of memory where the "
        f"verified one did not. budget=None plans for {human_bytes(room.budget_bytes)} ({room.budget_bytes} bytes)."
    )
