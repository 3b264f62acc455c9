"""Fake twins for FSDP2's sharded parameters, so that a sharded model profiles on fake tensors.

NOTE [A sharded model on fake tensors]
FSDP2 (``fully_shard``) keeps each parameter's local shard in its own records (an
``FSDPParam``: the sharded DTensor, the padded flat shard, the all-gather buffers, the
unsharded parameter), not only in the module: swapping the module's parameter for a
plain fake tensor leaves FSDP all-gathering the real shard, or, before FSDP's lazy
initialisation, makes FSDP adopt the plain fake as its sharded parameter for good.
So for a sharded model the root's lazy initialisation runs first (what its first real
step would do), then each ``FSDPParam`` is pointed at a fake twin of its padded shard
(a DTensor of the same spec, registered on the module too), with its all-gather
buffers and unsharded parameter dropped so that FSDP makes fake ones. Collectives on
fake tensors communicate nothing (their fake kernels only give the output's shape),
so the fake step needs no other rank and every rank can profile on its own. On exit
every record FSDP keeps (each ``FSDPParam``, parameter group and shared context) gets
back the attributes it had, so the next real step finds the model as it was.
The fake step runs on the CPU: FSDP's records of the device are set to the CPU for it.
A torch whose FSDP keeps other records fails the fake step; the records are put back
all the same, and remat profiles for real (NOTE [Within the budget] in remat.planning._within).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["dtensor_twin", "fake_shards", "fsdp_states"]


def dtensor_twin(mode: Any, t: torch.Tensor) -> torch.Tensor | None:
    """A DTensor of ``t``'s mesh, placements and global shape over a fake local shard; None when ``t`` is no
    DTensor. A tensor-parallel layer's parameters are DTensors, and its ops refuse to mix them with plain
    tensors; a plain fake of the global shape would also count every rank's shards."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    if not isinstance(t, DTensor):
        return None
    local = t._local_tensor
    with mode:
        fake = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device="cpu")
    return DTensor.from_local(fake, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def fsdp_states(model: nn.Module) -> list[Any]:
    """The FSDP2 states of ``model``'s sharded modules, outermost first (empty when nothing is sharded)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]


def _roots(model: nn.Module) -> list[Any]:
    """The states of the sharded modules no other sharded module contains: FSDP's roots."""
    from torch.distributed.fsdp import FSDPModule

    inner: set[int] = set()
    roots = []
    for module in model.modules():
        if isinstance(module, FSDPModule) and id(module) not in inner:
            roots.append(module._get_fsdp_state())
            inner.update(id(m) for m in module.modules())
    return roots


def _records(states: list[Any]) -> list[Any]:
    """Every object of FSDP's whose attributes a step changes: states, their contexts, groups and params."""
    seen: dict[int, Any] = {}
    for state in states:
        group = state._fsdp_param_group
        for obj in (state, getattr(state, "_state_ctx", None), getattr(state, "_comm_ctx", None), group):
            if obj is not None:
                seen.setdefault(id(obj), obj)
        for fsdp_param in group.fsdp_params if group is not None else ():
            seen.setdefault(id(fsdp_param), fsdp_param)
    return list(seen.values())


def _twin(mode: Any, fsdp_param: Any) -> nn.Parameter:
    """A fake DTensor of ``fsdp_param``'s sharded parameter, over a fake padded shard of its own."""
    real = fsdp_param.sharded_param
    local = real._local_tensor
    with mode:
        flat = torch.empty(fsdp_param._sharded_param_data.numel(), dtype=local.dtype, device="cpu")
        fake_local = flat.as_strided(local.size(), local.stride(), local.storage_offset())
    twin = nn.Parameter(fsdp_param.to_sharded_dtensor(fake_local), requires_grad=real.requires_grad)
    fsdp_param._sharded_param_data = flat
    fsdp_param.sharded_param = twin
    fsdp_param.all_gather_outputs = []
    fsdp_param._unsharded_inner_tensors = []
    fsdp_param.__dict__.pop("_unsharded_param", None)
    fsdp_param.device = torch.device("cpu")
    return twin


@contextlib.contextmanager
def fake_shards(model: nn.Module, mode: Any, twins: dict[int, torch.Tensor]) -> Iterator[None]:
    """Point every FSDP2 parameter of ``model`` at a fake twin (NOTE [A sharded model on fake tensors]).

    ``twins`` gains, for each real sharded parameter's id, its twin, for the caller to register on the
    module (and in the optimizer) as it does for plain parameters.
    """
    states = fsdp_states(model)
    if not states:
        yield
        return
    for root in _roots(model):
        root._lazy_init()
    records = _records(states)
    saved = [(obj, dict(obj.__dict__), _contents(obj.__dict__)) for obj in records]
    try:
        for state in states:
            group = state._fsdp_param_group
            if group is None:
                continue
            group.device = torch.device("cpu")
            for fsdp_param in group.fsdp_params:
                real = fsdp_param.sharded_param
                twins[id(real)] = _twin(mode, fsdp_param)
        yield
    finally:
        for obj, attrs, contents in saved:
            obj.__dict__.clear()
            obj.__dict__.update(attrs)
            for name, items in contents.items():  # a list FSDP appends to in place, shared between records
                attrs[name].clear()
                attrs[name].extend(items) if isinstance(items, list) else attrs[name].update(items)


def _contents(attrs: dict[str, Any]) -> dict[str, Any]:
    """A copy of the contents of each list, dict and set among ``attrs``, to put back in the same objects."""
    return {name: type(v)(v) for name, v in attrs.items() if type(v) in (list, dict, set)}
