"""The storage tracker (``remat.core._memtrack``): which storages are live, and which are new."""

from __future__ import annotations

import gc
from contextlib import contextmanager

import torch

import remat
from remat.core._memtrack import StorageTracker, collections_paused


def test_storages_made_since_a_clock_reading_are_new_even_at_a_reused_address():
    with StorageTracker() as tracker:
        kept = torch.ones(256)
        made = tracker.made
        for _ in range(8):  # freed and made again: the allocator hands the same addresses back
            gone = torch.ones(256) * 2
            del gone
        fresh = torch.ones(256) * 3
        new = tracker.made_since(made)
        assert new == [fresh.untyped_storage()._cdata]
        assert kept.untyped_storage()._cdata in tracker.live
    del kept, fresh


class _Cycle:
    """What ``torch.distributions``' transforms make: a tensor only a reference cycle holds."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.me = self


class _LeavesCycles(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64)) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            _Cycle(x.detach() * 2)  # garbage at once, freed only by a collection
            x = block(x)
        return x


@contextmanager
def _collections_every(objects: int):
    old = gc.get_threshold()
    gc.set_threshold(objects, 1, 1)
    try:
        yield
    finally:
        gc.set_threshold(*old)


def test_a_counted_step_holds_cyclic_garbage_to_its_end_whenever_collections_would_run():
    # NOTE [Cyclic garbage during a counted step]: without the pause a collection after every few objects
    # freed the cycles' tensors before the backward's peak, and the default thresholds did not.
    torch.manual_seed(0)
    model, x = _LeavesCycles(), torch.randn(32, 64)
    with _collections_every(700):
        usual = remat.measure(model, x, warmup=0, repeat=1).peak_bytes
    with _collections_every(1):
        eager = remat.measure(model, x, warmup=0, repeat=1).peak_bytes
    prof = remat.profile(model, x, blocks=["blocks.0", "blocks.1", "blocks.2", "blocks.3"], policies=("full",))
    assert usual == eager == prof.baseline_peak_bytes
    assert gc.isenabled()


def test_collections_paused_restores_what_the_caller_had():
    gc.disable()
    try:
        with collections_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with StorageTracker():
        assert not gc.isenabled()
    assert gc.isenabled()


_FIRST_STEP = """
import torch, remat
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4)])
x = torch.randn(64, 32)
print(*(remat.measure(model, x, warmup=0, repeat=1).peak_bytes for _ in range(3)))
"""


def test_the_first_counted_step_of_a_process_counts_what_every_later_one_does():
    # NOTE [The first op under a dispatch mode]: it needs a process that has run no op under a dispatch mode
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FIRST_STEP], capture_output=True, text=True, check=True, timeout=300)
    first, *later = map(int, out.stdout.split())
    assert later == [first, first], (first, later)  # was first = later + 8192: the forward's output, held
