"""``budget=None`` on CUDA: the room a GPU has for the step (NOTE [Fitting a device] in remat.planning._gpu_room).

The arithmetic is checked here from given numbers, on any machine; the CUDA tests in
tests/planning/test_fit.py run it on a GPU, skipped without one.
"""

import pytest
import torch

from remat.planning._gpu_room import FRAGMENTATION_MARGIN, Room, over_the_room_note, reserved_note

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


def test_a_budget_above_the_room_is_kept_and_said_to_risk_later_steps():
    room = Room(allocated=100 * MiB, reserved=100 * MiB, free=1000 * MiB)  # budget=None: 100 + 900 MiB
    assert over_the_room_note(room.budget_bytes, room) is None
    note = over_the_room_note(room.budget_bytes + 1, room)
    assert "less than its 10%" in note and "a later step may run out of memory" in note
    assert f"budget=None plans for 1000.0 MiB ({room.budget_bytes} bytes)" in note


def test_auto_on_a_gpu_says_when_a_given_budget_leaves_the_allocator_too_little(monkeypatch, caplog):
    # the GPU's room is given (remat.planning.apply reads it with room_on on CUDA); the plan is made on the CPU
    from test_verify import Block
    from torch import nn

    import remat
    from remat.planning import apply as apply_module

    torch.manual_seed(0)
    model, x = nn.Sequential(*(Block() for _ in range(4))), torch.randn(16, 32, 32)
    keep = remat.measure(model, x, warmup=0, repeat=1).peak_bytes
    budget = int(0.8 * keep)
    tight = Room(allocated=0, reserved=0, free=int(budget * (1 + FRAGMENTATION_MARGIN / 2)))
    roomy = Room(allocated=0, reserved=0, free=4 * keep)
    for room, said in ((tight, True), (roomy, False)):
        monkeypatch.setattr(apply_module, "_gpu_room", lambda model, inputs, room=room: room)
        with caplog.at_level("WARNING", logger="remat"):
            plan = remat.auto(model, x, budget, repeat=1, warmup=0)
        remat.remove(model)
        assert plan.budget_bytes == budget  # the user's budget is kept either way
        assert any("leaves this GPU's caching allocator" in n for n in plan.notes) is said
        assert any("leaves this GPU's caching allocator" in r.getMessage() for r in caplog.records) is said
        caplog.clear()
