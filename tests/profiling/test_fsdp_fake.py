"""Sharded (FSDP2) and tensor-parallel models on fake tensors, one gloo rank: the real bytes, the model untouched."""

import pytest
import torch
from conftest import TensorParallelBlock, residual_chain, tensor_parallel
from torch import nn

import remat
from remat.profiling._fsdp_fake import fsdp_states


def _sharded(mesh=None, device: str = "cpu") -> nn.Module:
    """The chain sharded over ``mesh`` (None: FSDP's default, a mesh on the GPU where there is one)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = residual_chain(depth=4, width=24, hidden=96, stem=True).to(device)
    for block in model[1:]:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _step(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return {n: p.grad.to_local().clone() for n, p in model.named_parameters()}


def _records(model: nn.Module) -> list:
    """Each FSDPParam's sharded parameter and padded shard, and each group's count of them."""
    return [
        (id(p.sharded_param), id(p._sharded_param_data), len(s._fsdp_param_group.fsdp_params))
        for s in fsdp_states(model)
        if s._fsdp_param_group is not None
        for p in s._fsdp_param_group.fsdp_params
    ]


@pytest.mark.parametrize("stepped", [False, True], ids=["before-its-first-step", "after-a-step"])
def test_a_sharded_models_fake_profile_has_the_real_ones_bytes_and_leaves_it_as_it_was(one_rank_group, stepped):
    model, x = _sharded(one_rank_group), torch.randn(16, 24)
    if stepped:  # FSDP's lazy initialisation done, its all-gather buffers made
        _step(model, x)
    optimizer = torch.optim.AdamW(model.parameters())
    params = {n: (p, p.to_local().clone()) for n, p in model.named_parameters()}
    records = _records(model)
    fake = remat.profile(model, x, loss_fn=lambda y: y.square().mean(), optimizer=optimizer, fake=True, target="cpu")
    assert _records(model) == records and not optimizer.state
    for n, p in model.named_parameters():
        assert p is params[n][0] and torch.equal(p.to_local(), params[n][1])
    real = remat.profile(model, x, loss_fn=lambda y: y.square().mean(), optimizer=optimizer, warmup=0, repeat=1)
    names = [b.name for b in real.blocks]
    assert fake.fake and fake.resting_bytes == real.resting_bytes
    for assignment in ({}, dict.fromkeys(names, "full"), {names[0]: "selective", names[-1]: "full"}):
        assert fake.predict_peak(assignment) == real.predict_peak(assignment), assignment
    # the next real step is the step of a model nobody profiled
    assert all(torch.equal(a, b) for a, b in zip(_step(model, x).values(), _step(_sharded(one_rank_group), x).values()))


def test_a_tensor_parallel_models_fake_profile_has_the_real_ones_bytes(one_rank_group):
    # its parameters are DTensors, and its ops refuse plain tensors beside them: the twins are DTensors too
    torch.manual_seed(0)
    model = tensor_parallel(nn.Sequential(*[TensorParallelBlock() for _ in range(4)]), one_rank_group)
    x = torch.randn(8, 64, 32)
    params = {n: p for n, p in model.named_parameters()}
    fake = remat.profile(model, x, loss_fn=torch.sum, fake=True, target="cpu")
    assert all(p is params[n] for n, p in model.named_parameters())
    real = remat.profile(model, x, loss_fn=torch.sum, warmup=0, repeat=1)
    names = [b.name for b in real.blocks]
    for assignment in ({}, dict.fromkeys(names, "full"), {names[0]: "selective", names[-1]: "full"}):
        assert fake.predict_peak(assignment) == real.predict_peak(assignment), assignment


class _FailsOnFakeTensors(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch._subclasses.FakeTensor):
            raise RuntimeError("this block refuses fake tensors")
        return x


def test_a_failed_fake_profile_leaves_a_sharded_model_that_trains_as_before(one_rank_group):
    # before FSDP's lazy initialisation, a plain fake swapped in for a parameter became FSDP's own for good
    model, x = _sharded(one_rank_group), torch.randn(16, 24)
    model.append(_FailsOnFakeTensors())
    with pytest.raises(remat.RematError, match="refuses fake tensors"):
        remat.profile(model, x, fake=True, target="cpu")
    reference = _sharded(one_rank_group)
    reference.append(_FailsOnFakeTensors())
    assert all(torch.equal(a, b) for a, b in zip(_step(model, x).values(), _step(reference, x).values()))


@pytest.fixture
def one_cuda_rank():
    """A one-process NCCL group on the first GPU."""
    import torch.distributed as dist

    if not torch.cuda.is_available() or not dist.is_nccl_available() or dist.is_initialized():
        pytest.skip("needs CUDA with NCCL and no process group yet")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")  # marks it gpu (tests/conftest.py)
def test_a_sharded_model_on_a_gpu_profiles_on_fake_tensors_within_its_real_bytes(one_cuda_rank):
    # the fake step runs on fake CPU tensors with the GPU's kernels; FSDP's records say CUDA, and are put back
    model, x = _sharded(device="cuda"), torch.randn(16, 24, device="cuda")
    records = _records(model)
    fake = remat.profile(model, x, loss_fn=lambda y: y.square().mean(), fake=True, target="h100")
    assert _records(model) == records
    real = remat.profile(model, x, loss_fn=lambda y: y.square().mean(), warmup=0, repeat=1)
    names = [b.name for b in real.blocks]
    for assignment in ({}, dict.fromkeys(names, "full")):
        assert fake.predict_peak(assignment) == pytest.approx(real.predict_peak(assignment), rel=0.02), assignment
    assert all(torch.equal(a, b) for a, b in zip(_step(model, x).values(), _step(_sharded(device="cuda"), x).values()))
