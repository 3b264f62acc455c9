"""The segment recorder: where its bytes and seconds come from (tracker or allocator; host or CUDA clock)."""

import torch
from torch import nn

import remat
from remat.core._memtrack import StorageTracker
from remat.profiling._profile_run import _run_step
from remat.profiling._trace import SegmentRecorder


class _Allocator:
    """Stands in for CudaAllocator: the tracker's live bytes, and a peak 4096 bytes above what it saw."""

    def __init__(self, tracker):
        self.tracker, self.top = tracker, 0

    def live(self):
        return self.tracker.current

    def reset_peak(self):
        self.top = self.tracker.current

    def peak(self):
        return self.top + 4096


class _Clock:
    """Counts marks; reads them only after settle(), as CUDA events."""

    def __init__(self):
        self.ticks, self.settled = 0, False

    def mark(self):
        self.ticks += 1
        return self.ticks

    def settle(self):
        self.settled = True

    def seconds(self, start, end):
        assert self.settled
        return float(end - start)


def _record(allocator=False, clock=None):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)))
    remat.wrap(model[1], policy="full")
    tracker = StorageTracker(known=list(model.parameters()))
    recorder = SegmentRecorder(
        model, ["0", "1", "2"], tracker=tracker, clock=clock, allocator=_Allocator(tracker) if allocator else None
    )
    with recorder, tracker:
        _run_step(model, torch.randn(8, 16), lambda out: out.sum(), recorder)
    return recorder.segments


def test_allocator_gives_live_bytes_and_segment_peaks():
    by_tracker, by_allocator = _record(), _record(allocator=True)
    for a, b in zip(by_allocator, by_tracker, strict=True):
        assert a.key == b.key and a.delta == b.delta
        # the allocator's peak is taken whole: the tracker's per-op peaks are not consulted
        assert a.max_live == max(a.end_live, a.start_live + 4096)


def test_clock_marks_are_read_once_the_step_is_over():
    clock = _Clock()
    segments = _record(clock=clock)
    assert clock.settled and all(s.seconds >= 1 for s in segments)
    recomputed = [s for s in segments if s.recompute_s]
    assert [s.key for s in recomputed] == [("bwd", "1", 0)]  # the full block's recomputation, in its backward
