"""The profile a plan is made on (remat.planning._within): what a fake profile for the GPU the model is on counts
beside the model (NOTE [Memory beside the model on the GPU])."""

import torch
from test_verify import Block
from torch import nn

import remat
from remat.planning import _within
from remat.planning._within import OVER_THE_BUDGET, profile_within, with_memory_beside
from remat.profiling.targets import get_target

MiB = 2**20
LIBRARIES = get_target("h100").cuda.persistent_bytes


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(4))), torch.randn(16, 32, 32)


def _fake():
    model, x = _model()
    return remat.profile(model, x, fake=True, target="h100")


def test_memory_held_beside_the_model_is_added_to_the_fake_profiles_resting_bytes():
    fake = _fake()
    names = [b.name for b in fake.blocks]
    own = fake.resting_bytes - LIBRARIES  # the model's tensors: what the fake profile saw itself
    more = with_memory_beside(fake, own + LIBRARIES + 100 * MiB, LIBRARIES)  # libraries allocated, 100 MiB more
    assert more.resting_bytes == fake.resting_bytes + 100 * MiB
    for assignment in ({}, dict.fromkeys(names, "full")):
        assert more.predict_peak(assignment) == fake.predict_peak(assignment) + 100 * MiB
    assert "100.0 MiB added to the fake profile's resting bytes" in more.notes[-1]


def test_libraries_not_yet_allocated_stay_counted_and_nothing_is_taken_away():
    fake = _fake()
    own = fake.resting_bytes - LIBRARIES
    assert with_memory_beside(fake, own, LIBRARIES) is fake  # before any step: the libraries hold nothing yet
    assert with_memory_beside(fake, own + LIBRARIES, LIBRARIES) is fake  # after one: they hold what was counted
    assert with_memory_beside(fake, own + 10 * MiB, LIBRARIES) is fake  # less beside than the libraries' bytes


def test_a_fake_profile_for_the_gpu_the_model_is_on_counts_what_the_gpu_holds_beside_it(monkeypatch):
    # the model's GPU is given (device_of and the allocator's count); the fake profile for it is made here
    model, x = _model()
    held = []
    monkeypatch.setattr(_within, "device_of", lambda model, inputs: torch.device("cuda", 0))
    monkeypatch.setattr(_within, "device_target", lambda model, inputs: "h100")
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: held[0])
    alone = remat.profile(model, x, fake=True, target="h100")
    held.append(alone.resting_bytes + 64 * MiB)  # the libraries' bytes and 64 MiB of someone else's tensors
    within = profile_within(model, x, None, 0.5, api="test", options={})
    assert within.fake_because == OVER_THE_BUDGET
    assert within.profile.resting_bytes == alone.resting_bytes + 64 * MiB
    assert within.profile.baseline_peak_bytes == alone.baseline_peak_bytes + 64 * MiB
