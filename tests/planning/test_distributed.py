"""remat under torch.distributed: 2 gloo ranks on CPU, DDP and FSDP2, against the un-checkpointed runs.

One pair of processes runs every distributed scenario (starting processes and
importing transformers costs more than the steps); each rank saves what it saw
and the tests below compare the ranks' results in this process.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import socket
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _device import SimulatedDevice, resting
from conftest import TensorParallelBlock, tensor_parallel
from torch import nn

import remat
from remat.core._memtrack import storage_bytes
from remat.core._step import training_step
from remat.planning._synthetic import synthetic_profile
from remat.zoo import build

WORLD = 2
SIZES = {"layers": 4, "hidden": 64, "heads": 4, "vocab": 512, "seq": 64, "batch": 2, "dropout": 0.1}
BUDGET = 0.6

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available"
)


# -- what every rank runs -------------------------------------------------------------
def _model_and_batch(rank: int) -> tuple[nn.Module, dict, list[str]]:
    zoo = build("gpt2", **SIZES)  # seed 0: identical weights on every rank
    gen = torch.Generator().manual_seed(100 + rank)  # a different batch per rank, so reductions matter
    ids = torch.randint(0, SIZES["vocab"], (SIZES["batch"], SIZES["seq"]), generator=gen)
    return zoo.model, {"input_ids": ids, "labels": ids.clone()}, list(zoo.blocks)


def _shard(model: nn.Module, blocks: list[str]) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # a CPU mesh named: FSDP's default mesh is on the GPU wherever there is one, and these models are on the CPU
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    modules = dict(model.named_modules())
    for name in blocks:
        fully_shard(modules[name], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _step(model: nn.Module, inputs: dict) -> dict:
    """One training step and an AdamW step; the local gradients and parameters after it."""
    torch.manual_seed(7)  # the same dropout masks in every run
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    optimizer = torch.optim.AdamW(inner.parameters(), lr=1e-3)
    model.zero_grad(set_to_none=True)
    loss = training_step(model, inputs)
    grads = {n: _local(p.grad).clone() for n, p in inner.named_parameters()}
    optimizer.step()
    params = {n: _local(p).detach().clone() for n, p in inner.named_parameters()}
    return {"loss": float(loss), "grads": grads, "params": params}


def _memtracker_peak(model: nn.Module, inputs: dict) -> int | None:
    """torch's own tracker (handles DTensors and resized storages), as an independent check."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError:
        return None
    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model, *inputs.values())
    with tracker:
        training_step(model, inputs)
    model.zero_grad(set_to_none=True)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def _budget_bytes(model: nn.Module, inputs: dict) -> int:
    """BUDGET of rank 0's step without checkpointing, in bytes, the same on every rank (from a fake profile, so
    that no real step runs before remat's)."""
    shared = [int(BUDGET * remat.profile(model, inputs, fake=True).baseline_peak_bytes)]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _fsdp(rank: int) -> dict:
    model, inputs, blocks = _model_and_batch(rank)
    reference = _step(_shard(model, blocks), inputs)
    model, _, _ = _model_and_batch(rank)
    _shard(model, blocks)  # profiled sharded: per-rank bytes
    budget = _budget_bytes(model, inputs)
    device = SimulatedDevice(budget, resting(model, *inputs.values()))
    with device:  # a device the step without checkpointing does not fit, on every rank
        plan = remat.distributed.auto(model, inputs, budget, repeat=1, warmup=0)
    measured = remat.measure(model, inputs, warmup=1, repeat=1)
    out = {
        "device": (device.peak, device.refused, device.capacity),
        "plan": plan.to_json(),
        "peak": measured.peak_bytes,
        "torch_peak": _memtracker_peak(model, inputs),
        "reference": reference,
        "remat": _step(model, inputs),
    }
    model, _, _ = _model_and_batch(rank)
    remat.apply(model, plan)  # the other order: checkpoint the blocks, then shard them
    out["apply_then_shard"] = _step(_shard(model, blocks), inputs)
    return out


def _fsdp_adamw(rank: int) -> dict:
    """FSDP2 with the optimizer the loop steps: its sharded state is part of the plan's step. Which plan auto picks
    depends on the timings, so every plan it could pick is measured too (``candidates``)."""
    model, inputs, blocks = _model_and_batch(rank)
    _shard(model, blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = remat.distributed.auto(model, inputs, BUDGET, optimizer=optimizer, repeat=1, warmup=0)
    measured = remat.measure(model, inputs, optimizer=optimizer, warmup=1, repeat=1)
    bare = remat.measure(model, inputs, warmup=1, repeat=1)
    remat.remove(model)
    return {
        "plan": plan.to_json(),
        "peak": measured.peak_bytes,
        "bare_peak": bare.peak_bytes,
        "state_left": len(optimizer.state),
        **_candidates(model, inputs, optimizer),
    }


def _candidates(model: nn.Module, inputs: dict, optimizer: torch.optim.Optimizer) -> dict:
    """Every plan the planner could pick at BUDGET, whatever the timings: above the one-level floor it picks the
    fastest assignment whose predicted peak fits, and under some timings that is any of them. Each is measured."""
    shared = [remat.profile(model, inputs, optimizer=optimizer, repeat=1, warmup=0)]
    dist.broadcast_object_list(shared, src=0)  # the same candidates, in the same order, on every rank
    prof = shared[0]
    budget = remat.plan(prof, BUDGET).budget_bytes
    names = [b.name for b in prof.blocks]
    out = []
    for pick in itertools.product(prof.policies, repeat=len(names)):
        assignment = dict(zip(names, pick))
        if prof.predict_peak(assignment) > budget:
            continue
        for name, policy in assignment.items():
            remat.wrap(model.get_submodule(name), policy=policy)
        peak = remat.measure(model, inputs, optimizer=optimizer, warmup=0, repeat=1).peak_bytes
        remat.remove(model)
        out.append((pick, prof.predict_peak(assignment), peak))
    return {
        "candidates": out,
        "one_level_floor": remat.plan(prof, strategy="none", nested=False).min_peak_bytes,
        "candidate_budget": budget,
    }


def _ddp(rank: int) -> dict:
    ddp = nn.parallel.DistributedDataParallel
    model, inputs, _ = _model_and_batch(rank)
    reference = _step(ddp(model), inputs)
    model, _, _ = _model_and_batch(rank)
    plan = remat.distributed.plan_on_rank0(lambda: remat.profile(model, inputs, repeat=1, warmup=0), BUDGET, ddp=True)
    remat.apply(model, plan)  # then wrapped
    wrapped = ddp(model)
    measured = remat.measure(wrapped, inputs, warmup=2, repeat=1)  # after DDP rebuilt its buckets
    buckets = str(wrapped._get_ddp_logging_data()["bucket_sizes"])
    listed = storage_bytes([*model.parameters(), *model.buffers(), *inputs.values()])
    out = {
        "plan": plan.to_json(),
        "peak": measured.peak_bytes,
        "reference": reference,
        "remat": _step(wrapped, inputs),
        "buckets": sum(int(b) for b in buckets.split(",")),
        "unlisted": measured.resting_bytes - listed,
    }
    model, _, _ = _model_and_batch(rank)
    wrapped = ddp(model, find_unused_parameters=True)  # wrapped first, then remat.distributed.auto
    out["auto_plan"] = remat.distributed.auto(wrapped, inputs, BUDGET, repeat=1, warmup=0).to_json()
    out["find_unused"] = _step(wrapped, inputs)
    return out


def _tensor_parallel(rank: int) -> dict:
    """Fake and real profiles' resting bytes of blocks split over both ranks in Megatron's sequence-parallel
    layout: each rank's input is its share of the sequence, the norm runs on it, the MLP's weights are split."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model, mesh = nn.Sequential(*[TensorParallelBlock() for _ in range(3)]), init_device_mesh("cpu", (WORLD,))
    layout = {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model:
        parallelize_module(block, mesh, layout)
    x = torch.randn(8, 64, 32, generator=torch.Generator().manual_seed(rank))
    fake = remat.profile(model, x, loss_fn=torch.sum, fake=True, target="cpu")
    real = remat.profile(model, x, loss_fn=torch.sum, warmup=0, repeat=1)
    return {"resting": (fake.resting_bytes, real.resting_bytes)}


def _rank0_error() -> tuple[str, str]:
    try:
        remat.distributed.plan_on_rank0(lambda: synthetic_profile(4), budget="1B")
    except remat.RematError as exc:
        return type(exc).__name__, str(exc)
    return "", "no error"


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on a shared 2-core machine
    torch.use_deterministic_algorithms(True)
    warnings.filterwarnings("ignore", message=".*find_unused_parameters=True.*")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        results = {
            "fsdp": _fsdp(rank),
            "fsdp_adamw": _fsdp_adamw(rank),
            "ddp": _ddp(rank),
            "tensor_parallel": _tensor_parallel(rank),
            "rank0_error": _rank0_error(),
        }
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("distributed")
    mp.spawn(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


# -- the checks ---------------------------------------------------------------------------
def _assert_same_step(reference: dict, got: dict) -> None:
    # Bit-equal on CPU: recompute replays the same kernels on the same inputs with the same
    # RNG state, so each rank's unreduced gradients are bit-equal; the collectives then reduce
    # equal numbers. DDP may group them into buckets differently (it rebuilds buckets in the
    # order gradients become ready), but with 2 ranks each element is one sum a + b either way.
    assert got["loss"] == reference["loss"]
    for kind in ("grads", "params"):
        assert reference[kind].keys() == got[kind].keys()
        for name, value in reference[kind].items():
            assert torch.equal(value, got[kind][name]), f"{kind} {name} differ"


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_gradients_and_parameters_equal_the_uncheckpointed_run(ranks, mode):
    for result in ranks:
        out = result[mode]
        assert remat.Plan.from_json(out["plan"]).checkpointed, "the budget should make remat checkpoint something"
        _assert_same_step(out["reference"], out["remat"])
    if mode == "fsdp":
        for result in ranks:
            _assert_same_step(result["fsdp"]["reference"], result["fsdp"]["apply_then_shard"])
        sizes = [sum(g.numel() for g in r["fsdp"]["remat"]["grads"].values()) for r in ranks]
        full = sum(g.numel() for g in ranks[0]["ddp"]["remat"]["grads"].values())
        assert sum(sizes) >= full and max(sizes) < full  # sharded: each rank holds part of every gradient
    else:
        for result in ranks:  # find_unused_parameters=True: no "mark a variable ready only once"
            _assert_same_step(result["ddp"]["reference"], result["ddp"]["find_unused"])


@pytest.mark.parametrize("key", [("fsdp", "plan"), ("ddp", "plan"), ("ddp", "auto_plan")])
def test_plan_is_identical_on_every_rank(ranks, key):
    mode, field = key
    assert ranks[0][mode][field] == ranks[1][mode][field]


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_measured_peak_per_rank_is_within_budget(ranks, mode):
    for result in ranks:
        out = result[mode]
        plan = remat.Plan.from_json(out["plan"])
        assert out["peak"] <= 1.02 * plan.budget_bytes, (out["peak"], plan.budget_bytes)
        assert out["peak"] == pytest.approx(plan.predicted_peak_bytes, rel=0.02)
    if mode == "fsdp" and ranks[0]["fsdp"]["torch_peak"] is not None:
        assert [r["fsdp"]["peak"] for r in ranks] == [r["fsdp"]["torch_peak"] for r in ranks]
    if mode == "ddp":  # the resting storages remat found beyond the model's are exactly DDP's buckets
        assert [r["ddp"]["buckets"] for r in ranks] == [r["ddp"]["unlisted"] for r in ranks]


def test_fsdp_auto_never_holds_more_than_the_budget(ranks):
    # the budget is 0.6 of the step without checkpointing: auto planned on each rank's fake profile and ran no
    # real step over the budget (an op over it would have raised OutOfMemoryError: refused counts them)
    for r in ranks:
        peak, refused, capacity = r["fsdp"]["device"]
        plan = remat.Plan.from_json(r["fsdp"]["plan"])
        assert refused == 0 and peak <= capacity == plan.budget_bytes < plan.baseline_peak_bytes


def test_fsdp_plans_hold_with_the_sharded_optimizer_state(ranks):
    for r in ranks:
        plan = remat.Plan.from_json(r["fsdp_adamw"]["plan"])
        assert "AdamW's state and step" in plan.loop and r["fsdp_adamw"]["state_left"] == 0
        assert r["fsdp_adamw"]["peak"] == plan.predicted_peak_bytes <= plan.budget_bytes
        assert r["fsdp_adamw"]["peak"] > r["fsdp_adamw"]["bare_peak"]


def test_every_plan_the_timings_could_pick_holds_under_fsdp(ranks):
    # auto's pick depends on this machine's timings (once, on a loaded machine, it measured over its budget):
    # every assignment it could pick at the budget is measured, on both ranks, against its prediction. Exact on a
    # loaded machine too: see NOTE [A collective's buffers die on the step's thread].
    for r in ranks:
        out = r["fsdp_adamw"]
        assert out["candidate_budget"] >= out["one_level_floor"]  # so never a nested plan: these are all
        assert len(out["candidates"]) >= 10
        wrong = [c for c in out["candidates"] if c[1] != c[2]]
        assert not wrong, f"{len(wrong)} of {len(out['candidates'])} (assignment, predicted, measured): {wrong[:4]}"


def test_a_tensor_parallel_fake_profile_counts_each_ranks_shards(ranks):
    # DTensor twins over fake local shards: a plain fake of the global shape would count both ranks' weights.
    # The peaks are not compared: the real profile's own vary between runs of this sequence-parallel model on 2
    # gloo ranks (all-full: 1.33 to 1.51 MB), the fake one's (1.38 MB) do not.
    for r in ranks:
        fake_resting, real_resting = r["tensor_parallel"]["resting"]
        assert fake_resting == real_resting


def test_rank0_planning_error_reaches_every_rank(ranks):
    (kind0, error0), (kind1, error1) = ranks[0]["rank0_error"], ranks[1]["rank0_error"]
    assert "below the lowest peak" in error0
    assert "planning failed on rank 0" in error1 and "below the lowest peak" in error1
    assert kind0 == kind1 == "Unreachable"  # every rank may then profile again with full-fine, together


def test_auto_profiles_again_with_full_fine_where_no_coarser_plan_reaches_the_budget():
    # As remat.auto does (NOTE [Finer only when needed] in remat.planning.apply); planned locally without a process
    # group, through the same path as on rank 0.
    from remat.planning.apply import FINEST

    model, inputs, _ = _model_and_batch(0)
    coarse = remat.plan(remat.profile(model, inputs, repeat=1, warmup=0), strategy="none").min_peak_bytes
    fine = remat.plan(remat.profile(model, inputs, repeat=1, warmup=0, policies=FINEST), strategy="none")
    assert fine.min_peak_bytes < coarse
    budget = (fine.min_peak_bytes + coarse) // 2
    plan = remat.distributed.auto(model, inputs, budget, repeat=1, warmup=0)
    try:
        assert "full-fine" in plan.checkpointed.values()
        assert any("profiled again with full-fine" in note for note in plan.notes)
        assert remat.measure(model, inputs, warmup=1, repeat=1).peak_bytes <= plan.predicted_peak_bytes <= budget
    finally:
        remat.remove(model)


def test_plan_on_rank0_without_a_process_group_plans_locally():
    prof = synthetic_profile(4)
    budget = (remat.plan(prof, 1.0).min_peak_bytes + prof.baseline_peak_bytes) // 2
    assert remat.distributed.plan_on_rank0(prof, budget) == remat.plan(prof, budget)
    with_buckets = remat.distributed.plan_on_rank0(lambda: prof, budget + prof.grad_bytes, ddp=True)
    assert with_buckets.baseline_peak_bytes == prof.baseline_peak_bytes + prof.grad_bytes
    assert with_buckets.assignment == remat.plan(prof, budget).assignment


def test_tensor_parallel_plans_hold_with_dtensor_activations(one_rank_group):
    """Tensor parallelism (one rank): DTensor activations profiled, planned, applied and measured exactly."""
    torch.manual_seed(0)
    model = tensor_parallel(nn.Sequential(*[TensorParallelBlock() for _ in range(6)]), one_rank_group)
    x = torch.randn(8, 64, 32)
    prof = remat.profile(model, x, loss_fn=torch.sum, warmup=0, repeat=1)
    # selective learns no regions beside DTensors and runs op-level, as selective-ops does
    for block in prof.blocks:
        assert block.saved_bytes["selective"] == block.saved_bytes["selective-ops"] < block.saved_bytes["keep"]
    for budget in (0.8, 0.5):
        plan = remat.plan(prof, budget)
        remat.apply(model, plan)
        measured = remat.measure(model, x, loss_fn=torch.sum, warmup=0, repeat=1)
        remat.remove(model)
        assert measured.grads_ok and measured.peak_bytes == plan.predicted_peak_bytes <= plan.budget_bytes


def _run_example() -> subprocess.CompletedProcess:
    root = pathlib.Path(__file__).resolve().parents[2]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={WORLD}",
        str(root / "examples" / "distributed_train.py"),
        "--fsdp",
        "--layers",
        "2",
        "--hidden",
        "64",
        "--seq",
        "32",
        "--batch",
        "2",
        "--steps",
        "2",
        "--budget",
        "0.9",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


EXPECTED_LINES = ("FSDP2 on 2 ranks. optimal plan", "rank 0: peak", "rank 1: peak", "step 0: loss", "step 1: loss")


def _aborted_after_finishing(done: subprocess.CompletedProcess) -> bool:
    """Everything printed, then a rank aborted while its interpreter was shutting down.

    Seen about once in 50 runs on a 2-core machine (torch 2.13, gloo) and twice in a row on a CI
    machine (torch 2.14.1): "terminate called without an active exception" in a thread of the
    exiting process, with no Python frame left, after the last step was printed and the process
    group destroyed. Nothing of remat runs by then (it starts no threads); the example frees
    FSDP2's cycles before destroying the group, which should stop gloo's threads in time.
    """
    return (
        done.returncode != 0
        and all(line in done.stdout for line in EXPECTED_LINES)
        and "terminate called without an active exception" in done.stderr
        and "<no Python frame>" in done.stderr
    )


def _fatal_part(stderr: str) -> str:
    """The fatal error and the threads faulthandler dumped, else the end of ``stderr``."""
    at = stderr.find("terminate called")
    return stderr[at : at + 3000] if at >= 0 else stderr[-3000:]


def test_example_trains_under_torchrun():
    done = _run_example()
    for _ in range(2):  # up to three runs in all: the abort is torch's, the test checks what remat promises
        if not _aborted_after_finishing(done):
            break
        warnings.warn(
            "gloo aborted at interpreter exit after the example finished; running it again:\n"
            + _fatal_part(done.stderr),
            stacklevel=1,
        )
        done = _run_example()
    assert done.returncode == 0, f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{_fatal_part(done.stderr)}"
    for line in EXPECTED_LINES:
        assert line in done.stdout, done.stdout
