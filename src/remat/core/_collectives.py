"""Collectives settled where a tracked step issues them, so that their buffers die on the step's thread.

NOTE [A collective's buffers die on the step's thread]
A c10d collective on CPU (gloo) runs on one of the backend's worker threads, and that thread holds
the op's Work, and through it the op's tensors, for a moment after the Work has completed. When the
step drops its last reference to such a buffer in that moment (FSDP2 drops a block's all-gathered
parameters right after copying them out), the storage is freed later, on the worker thread,
whenever the scheduler runs it: when other processes hold the cores, the step has allocated more by
then, and the tracked peak counts a buffer the step had already let go (a block's all-gather output: a
plan measured over its prediction, now and then). Inside a tracked step every CPU collective is therefore settled
where it is issued: its Work is waited on, the caller gets a completed Work with the same result,
and the step goes on once the backend has let go of the op's tensors. A buffer then lives exactly as
long as the step's own references to it (the completed Work holds the results, as the backend's
did), the same on every run, however busy the cores. The values are the same; only an asynchronous
collective's overlap with the ops after it is lost, in remat's tracked steps (profile, measure) and
never in the user's training. CUDA collectives are left alone: there the allocator's counts are read,
and stream order decides when a buffer can be reused.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

# Waiting for the backend to let go is a moment on an idle machine; a backend that keeps completed
# Works for longer (none in torch does on CPU) costs this much per collective, not a hang.
_LET_GO_SECONDS = 10.0
_WORK = "__torch__.torch.classes.c10d.Work"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def is_cpu_collective(func: Any, args: tuple, kwargs: dict) -> bool:
    """A c10d op (which returns a Work) on CPU tensors only."""
    if getattr(func, "namespace", None) != "c10d":
        return False
    tensors = _tensors((args, kwargs))
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


def run_settled(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` completed, with a completed Work in place of the backend's and the backend
    no longer holding the op's tensors; see NOTE [A collective's buffers die on the step's thread]."""
    # the backend gets aliases, fresh tensors that only it and this function hold: their counts tell when
    # it has let go, whatever else holds the caller's tensors
    originals: dict[int, torch.Tensor] = {}
    aliased = _aliased((args, kwargs), originals)
    out = _settled(func(*aliased[0], **aliased[1]), originals)
    aliases = [a for a in _tensors(aliased) if id(a) in originals]
    del aliased
    _wait_until_let_go(aliases)
    return out


def _aliased(value: Any, originals: dict[int, torch.Tensor]) -> Any:
    # module-level, not a closure: a recursive closure is a reference cycle, which would keep the
    # tensors alive until the garbage collector runs
    if isinstance(value, torch.Tensor):
        a = value.detach()
        originals[id(a)] = value
        return a
    if isinstance(value, (list, tuple)):
        return type(value)(_aliased(v, originals) for v in value)
    return value


def _settled(value: Any, originals: dict[int, torch.Tensor]) -> Any:
    """``value`` with the caller's tensors in place of their aliases and completed Works in place of the
    backend's."""
    if isinstance(value, torch.Tensor):
        return originals.get(id(value), value)
    if isinstance(value, torch.ScriptObject) and value._type().qualified_name() == _WORK:
        return _completed(value, originals)
    if isinstance(value, (list, tuple)):
        return type(value)(_settled(v, originals) for v in value)
    return value


def _completed(boxed: torch.ScriptObject, originals: dict[int, torch.Tensor]) -> torch.ScriptObject:
    """A completed Work with the result of ``boxed``'s, once it has completed."""
    work = torch.distributed.distributed_c10d.Work.unbox(boxed)
    work.wait()
    try:
        result = _settled(work.get_future().value(), originals)
    except RuntimeError:  # some backend Works have no future (gloo's reduce-scatter), so no result to keep
        result = None
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    work_from = torch._C._distributed_c10d._create_work_from_future  # type: ignore[attr-defined]  # not in the stubs
    return work_from(future).boxed()


def _wait_until_let_go(aliases: list[torch.Tensor]) -> None:
    # an alias is held once in C++ (its Python object), and in Python by the list, the loop's name and
    # getrefcount's argument; a backend still holding it holds either the tensor (C++) or its Python object
    start = time.perf_counter()
    while any(a._use_count() > 1 or sys.getrefcount(a) > 3 for a in aliases):  # type: ignore[attr-defined]
        if time.perf_counter() - start > _LET_GO_SECONDS:
            return
        time.sleep(1e-5)  # lets the worker thread run and take the GIL
