"""The storage tracker (``remat.core._memtrack``): which storages are live, and which are new."""

from __future__ import annotations

import torch

from remat.core._memtrack import StorageTracker


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
