"""Real values for small tensors of a fake run, so data-dependent branches go the real way."""

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from remat.profiling._shadow import ValueShadows, _inert


def _run(step):
    mode, shadows = FakeTensorMode(allow_non_fake_inputs=True), ValueShadows()
    ids = torch.tensor([[3, 1, 2], [5, 5, 0]])
    with mode:
        fake_ids = torch.empty_like(ids)
    shadows.seed(fake_ids, ids)
    with mode, shadows:
        return step(fake_ids)


def test_branches_on_inputs_and_factories_take_the_real_way():
    def step(ids):
        positions = torch.arange(ids.size(1)).unsqueeze(0).expand(ids.size(0), -1)
        packed = (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        return bool((packed[:, -1] == 0).all()), int(ids.max()), bool(torch.equal(ids, ids.clone()))

    assert _run(step) == (True, 5, True)


def test_values_from_fake_weights_stay_unknown():
    def step(ids):
        weight = torch.empty(8)  # a fake tensor with no real twin, as a swapped-in parameter
        return bool((weight[ids] > 0).all())

    with pytest.raises(DataDependentOutputException):
        _run(step)


def test_in_place_writes_keep_or_drop_the_twin():
    def step(ids):
        kept = ids.clone()
        kept.add_(1)  # computed on the twin too
        dropped = ids.clone()
        dropped.mul_(torch.empty(2, 3, dtype=torch.long))  # from a tensor without a twin
        out = int(kept.sum())
        try:
            bool(dropped.sum() > 0)
        except DataDependentOutputException:
            return out, "dropped"
        return out, "kept"

    assert _run(step) == (22, "dropped")


@pytest.mark.parametrize(
    "func, inert",
    [
        (torch.ops.prim.device.default, True),  # no tensor out, nothing written: passed through untouched
        (torch.ops.aten.sym_size.int, True),
        (torch.ops.aten._local_scalar_dense.default, False),  # no tensor out, but answered from the twins
        (torch.ops.aten.equal.default, False),
        (torch.ops.aten.add.Tensor, False),  # a tensor out, to shadow
        (torch.ops.aten.add_.Tensor, False),  # writes a tensor, whose twin may go
        (torch.ops.aten._foreach_add_.Scalar, False),  # writes, returns nothing
    ],
)
def test_only_ops_with_nothing_to_shadow_skip_the_shadows(func, inert):
    assert _inert(func) is inert
