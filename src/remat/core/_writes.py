"""Which tensors an op writes in place, and a storage's identity: what regions, the profiler and the storage
tracker watch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage, shared by every view of it."""
    return t.untyped_storage()._cdata


def _unannotated_writes() -> dict:
    # Legacy batch-norm kernels update running_mean/var (args 3 and 4) in place
    # although their schemas do not say so (``Tensor? running_mean``, no ``(a!)``).
    aten = torch.ops.aten
    ops = {}
    for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"):
        packet = getattr(aten, name, None)
        if packet is not None:
            ops[packet.default] = (3, 4)
    return ops


UNANNOTATED_WRITES = _unannotated_writes()


_WRITES: dict[Any, bool] = {}


def writes_in_place(func: Any) -> bool:
    """Whether ``func`` may write one of its arguments (:func:`written_tensors` yields something), asked once per op."""
    writes = _WRITES.get(func)
    if writes is None:
        schema = getattr(func, "_schema", None)
        writes = _WRITES[func] = bool(getattr(schema, "is_mutable", False)) or func in UNANNOTATED_WRITES
    return writes


def written_tensors(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors ``func`` writes in place among ``args`` and ``kwargs``: those its schema marks written, and
    the running statistics of the batch-norm kernels whose schemas do not say so."""
    for i in UNANNOTATED_WRITES.get(func, ()):
        if i < len(args) and isinstance(args[i], torch.Tensor):
            yield args[i]
    schema = func._schema
    if not schema.is_mutable:
        return
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))
