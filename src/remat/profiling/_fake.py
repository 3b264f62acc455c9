"""Profiling on fake tensors: shapes, dtypes and storage sizes, no data, no allocation.

The model's parameters and buffers are swapped for fake CPU tensors of the same
shapes (they may be real or on the meta device: a 7B-parameter model built under
``torch.device("meta")`` profiles on a laptop), the step runs under
``FakeTensorMode``, and the original tensor objects are put back afterwards. The
storage tracker counts fake storages exactly as real ones, so memory figures
match a real run; times come from a :class:`remat.profiling.targets.Target` roofline.
Fake tensors are CPU tensors, so kernel choices (and so memory) follow the CPU
paths: SDPA's flash kernel exists on CPU and CUDA alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from remat.core._hf import cache_disabled
from remat.core._step import LossFn
from remat.errors import RematError
from remat.profiling._profile_run import _assemble, _Policies, traced_step
from remat.profiling._types import Profile
from remat.profiling.targets import Target


def _fake_like(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


class _FakeWeights:
    """Swaps every parameter and buffer for a fake twin; puts the originals back on exit."""

    def __init__(self, model: nn.Module, mode: FakeTensorMode) -> None:
        self.model = model
        self.mode = mode
        self.saved: list[tuple[dict, str, Any]] = []

    def __enter__(self) -> None:
        for module in self.model.modules():
            for store in (module._parameters, module._buffers):
                for name, t in store.items():
                    if t is None:
                        continue
                    self.saved.append((store, name, t))
                    fake = _fake_like(self.mode, t)
                    store[name] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake

    def __exit__(self, *exc: Any) -> None:
        for store, name, t in reversed(self.saved):
            store[name] = t
        self.saved.clear()


def run_fake_profile(
    model: nn.Module,
    inputs: Any,
    loss_fn: LossFn | None,
    *,
    names: Sequence[str],
    policies: Sequence[str],
    target: Target,
) -> Profile:
    """Profile on fake tensors with times from ``target`` (see ``remat.profile``)."""
    # Real tensors the loss closes over (labels) are converted on use.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    training = {n: m.training for n, m in model.named_modules()}
    rng = torch.get_rng_state()
    switch = _Policies(model, names)
    fake_inputs = tree_map(lambda t: _fake_like(mode, t) if isinstance(t, torch.Tensor) else t, inputs)
    try:
        with _FakeWeights(model, mode), cache_disabled(model):
            traced, io_bytes, crossings = {}, {}, {}
            for policy in policies:
                switch.set(policy)
                with mode:
                    traced[policy], io, _, crossings[policy] = traced_step(
                        model, fake_inputs, loss_fn, names, op_cost=target.op_seconds
                    )
                io_bytes = io_bytes or io
            return _assemble(model, fake_inputs, names, policies, traced, io_bytes, {}, [],
                             fake=True, target=target.name, device=f"{target.name} (fake)", crossings=crossings)
    except torch._subclasses.fake_tensor.DataDependentOutputException as exc:
        raise RematError(
            f"remat.profile(fake=True): the model's forward depends on tensor values ({exc}), which fake "
            "tensors do not have; profile it on real tensors (with a smaller batch) instead."
        ) from None
    finally:
        switch.restore()
        for name, module in model.named_modules():
            module.training = training[name]
        torch.set_rng_state(rng)
