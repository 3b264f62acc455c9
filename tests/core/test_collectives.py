"""CPU collectives inside a tracked step: completed where issued, their buffers freed at the step's own drop."""

from __future__ import annotations

import threading
import warnings

import torch

from remat.core._collectives import run_settled
from remat.core._memtrack import StorageTracker


def _lagging_collective(tensor: torch.Tensor, held: list, released: threading.Event) -> tuple:
    """Completes at once, but its worker thread holds the tensor a while longer, as gloo's worker holds a Work
    (and its tensors) for a moment after completing it."""
    held.append(tensor)

    def let_go() -> None:
        released.wait(timeout=30)
        held.clear()

    threading.Thread(target=let_go, daemon=True).start()
    future: torch.futures.Future = torch.futures.Future()
    future.set_result([tensor])
    return [tensor], torch._C._distributed_c10d._create_work_from_future(future).boxed()


def test_a_buffer_is_freed_at_the_steps_drop_not_when_the_worker_lets_go():
    held: list = []
    released = threading.Event()
    threading.Timer(0.2, released.set).start()  # the worker lets go later than the step's next op
    with StorageTracker() as tracker:
        buf = torch.ones(1000)
        tensors, boxed = run_settled(_lagging_collective, (buf,), {"held": held, "released": released})
        assert tensors[0] is buf  # the caller's tensor back, not the alias the worker got
        assert not held  # run_settled waited for the worker to let go
        assert torch.distributed.distributed_c10d.Work.unbox(boxed).is_completed()
        del buf, tensors, boxed
        assert tracker.current == 0  # without the wait, the worker's alias still holds 4000 bytes here


def test_gloo_collectives_in_a_tracked_step_complete_where_issued(one_rank_group):
    dist = torch.distributed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor's new name varies by torch
        with StorageTracker() as tracker:
            x = torch.arange(8, dtype=torch.float32)
            work = dist.all_reduce(x, async_op=True)
            assert work.is_completed() and work.get_future().value()[0] is x
            gathered = torch.empty(8)
            work = dist.all_gather_into_tensor(gathered, x, async_op=True)
            assert work.is_completed()
            work.wait()
            reduced = torch.empty(8)
            dist.reduce_scatter_tensor(reduced, gathered)
            assert torch.equal(gathered, x) and torch.equal(reduced, x)  # one rank: the values pass through
            assert x._use_count() == gathered._use_count() == 1  # no backend Work holds them
            assert tracker.current == 3 * 32
            del work, x, gathered
            assert tracker.current == 32  # freed at the step's drop
            del reduced
            assert tracker.current == 0
