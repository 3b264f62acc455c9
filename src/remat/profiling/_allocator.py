"""The bytes the CUDA caching allocator counts for a storage, for fake profiles of a CUDA target.

NOTE [Blocks the caching allocator hands out]
``remat.measure`` on CUDA reads ``max_memory_allocated``, which counts the blocks the
caching allocator hands out, not the bytes asked for (``CUDACachingAllocator.cpp``,
default configuration). Every request is rounded up to a multiple of 512 bytes. One of
at most 1 MiB comes from the small pool, whose blocks split down to 512 bytes, so it
costs its rounded size. A larger one that finds no cached block gets a new segment
(20 MiB below 10 MiB, else its size rounded up to 2 MiB), and a large block is split
only when more than 1 MiB would remain: a request up to 1 MiB under its segment gets
the whole segment. An 11 MiB tensor (a bf16 MLP activation of Llama 4x1024, its fp32
up-projection weight) is counted as 12 MiB.

A fake profile for a CUDA target counts each storage as the block a new segment would
give it. Against ``benchmarks/gpu-truth/`` that took Llama 4x1024 from -1.31% (fp32)
and -4.31% (bf16) to within 0.2% and 2.7% and left the other configurations' errors as
they were, whose tensors are whole multiples of 2 MiB (BENCHMARKS.md, "GPU check").
The allocator reuses cached blocks, best fit; one up to 1 MiB larger than a request is
handed out whole, which this stateless count cannot know: it may count a block a
little over or under, and counts parameters as a process that moved its model to the
GPU first holds them. With ``expandable_segments:True`` in ``PYTORCH_CUDA_ALLOC_CONF``
large blocks split down to 512 bytes too, and only the rounding is counted.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

MiB = 1 << 20
_MIN_BLOCK = 512  # kMinBlockSize: the unit every request is rounded to
_SMALL = MiB  # kSmallSize: the small pool's largest request, and the most a large block keeps unsplit
_LARGE_BUFFER = 20 * MiB  # kLargeBuffer: the segment of a request under _MIN_LARGE_ALLOC
_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
_ROUND_LARGE = 2 * MiB  # kRoundLarge: larger segments are rounded to it


def _rounded(nbytes: int, unit: int) -> int:
    return -(-nbytes // unit) * unit


def cuda_block_bytes(nbytes: int, *, expandable: bool = False) -> int:
    """The bytes ``max_memory_allocated`` counts for a storage of ``nbytes`` (NOTE [Blocks the caching allocator
    hands out]); ``expandable``: the allocator runs with expandable segments."""
    if nbytes <= 0:
        return 0  # an empty storage allocates nothing
    size = max(_MIN_BLOCK, _rounded(nbytes, _MIN_BLOCK))
    if size <= _SMALL or expandable:
        return size
    segment = _LARGE_BUFFER if size < _MIN_LARGE_ALLOC else _rounded(size, _ROUND_LARGE)
    return segment if segment - size <= _SMALL else size


def expandable_segments() -> bool:
    """Whether this process asks the CUDA allocator for expandable segments, whose large blocks split finely."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        options = os.environ.get(name, "").replace(" ", "").lower()
        if "expandable_segments:true" in options:
            return True
    return False


def cuda_blocks() -> Callable[[int], int]:
    """:func:`cuda_block_bytes` under this process's allocator configuration, read once."""
    return functools.partial(cuda_block_bytes, expandable=expandable_segments())
