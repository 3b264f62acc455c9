"""``budget=None`` on CUDA: the room a GPU has for the step (NOTE [Fitting a device] in remat.planning._gpu_room).

The arithmetic is checked here from given numbers, on any machine; the CUDA tests in
tests/planning/test_fit.py run it on a GPU, skipped without one.
"""

import pytest

from remat.planning._gpu_room import FRAGMENTATION_MARGIN, Room, reserved_note

MiB = 2**20


def test_the_budget_is_what_is_live_and_the_room_less_the_margin():
    room = Room(allocated=300 * MiB, reserved=500 * MiB, free=1200 * MiB)
    # the step may take the device's free memory and the allocator's cache (200 MiB reserved, not allocated)
    assert room.capacity == 500 * MiB + 1200 * MiB
    step_room = room.capacity - 300 * MiB
    assert room.budget_bytes == 300 * MiB + int(step_room * (1 - FRAGMENTATION_MARGIN))
    assert room.capacity - room.budget_bytes == pytest.approx(FRAGMENTATION_MARGIN * step_room, abs=1)


def test_the_margin_is_stated_and_used():
    room = Room(allocated=0, reserved=0, free=1000 * MiB, margin=0.25)
    assert room.budget_bytes == 750 * MiB
    assert "25% for its fragmentation" in room.note() and str(room.budget_bytes) in room.note()


def test_a_share_of_the_gpu_set_for_the_process_caps_the_room():
    free = Room(allocated=100 * MiB, reserved=100 * MiB, free=8000 * MiB)
    capped = Room(allocated=100 * MiB, reserved=100 * MiB, free=8000 * MiB, allowed=1100 * MiB)
    assert capped.capacity == 1100 * MiB < free.capacity
    assert capped.budget_bytes == 100 * MiB + int(1000 * MiB * (1 - FRAGMENTATION_MARGIN)) < free.budget_bytes
    # a share larger than what the device has free does not add memory
    assert Room(0, 0, 500 * MiB, allowed=900 * MiB).capacity == 500 * MiB


def test_nothing_free_leaves_what_is_live():
    room = Room(allocated=700 * MiB, reserved=700 * MiB, free=0)
    assert room.budget_bytes == room.capacity == 700 * MiB


def test_the_reserved_note_gives_both_peaks_and_their_ratio():
    note = reserved_note(allocated_peak=800 * MiB, reserved_peak=880 * MiB)
    assert "880.0 MiB" in note and "800.0 MiB" in note and "+10.0%" in note
