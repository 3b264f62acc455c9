"""remat.auto on a device its un-checkpointed step does not fit: it never holds more than the budget.

NOTE [Within the budget] in remat.planning._within, NOTE [Out of memory is an answer] and
NOTE [The step verified plans are compared with] in remat.planning._verify; the simulated
device in tests/_device.py.
"""

import pytest
import torch
from _device import SimulatedDevice, resting
from _fit_zoo import ZOO
from conftest import gpu_for
from test_verify import Block
from torch import nn

import remat
from remat.core._step import input_tensors
from remat.planning import _verify_step as step_module
from remat.planning._sub_batch import batch_size
from remat.zoo import build


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(6))), torch.randn(32, 32, 32), None


def _zoo(name):
    zoo = build(name, **ZOO[name])
    return zoo.model, zoo.inputs, zoo.loss_fn


def _gpt2():
    return _zoo("gpt2")


def _loss(model, inputs, loss_fn):
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    if loss_fn is not None:
        return loss_fn(out)
    return out.loss if hasattr(out, "loss") else out.square().mean()


def _grads(model, inputs, loss_fn):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    _loss(model, inputs, loss_fn).backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("fraction", [0.8, 0.6])
@pytest.mark.parametrize("name", ["mlp-chain", *ZOO])
def test_auto_fits_a_device_the_step_without_checkpointing_does_not(name, fraction):
    model, inputs, loss_fn = _mlp() if name == "mlp-chain" else _zoo(name)
    keep = remat.measure(model, inputs, loss_fn, warmup=0, repeat=1).peak_bytes
    reference = _grads(model, inputs, loss_fn)
    budget = int(fraction * keep)
    device = SimulatedDevice(budget, resting(model, *input_tensors(inputs)))
    with device:
        plan = remat.auto(model, inputs, budget, loss_fn=loss_fn, repeat=1, warmup=0)
    try:
        assert plan.checkpointed and device.peak <= budget, (device.peak, budget)
        assert plan.measured_peak_bytes <= budget
        assert remat.measure(model, inputs, loss_fn, warmup=0, repeat=1).peak_bytes <= budget
        # the step without checkpointing on a slice; where not even one sample is predicted within the budget
        # (parameters and gradients are most of it), the notes say what comparing with the lowest plan misses
        said = " ".join(plan.notes)
        if "compared with the step without checkpointing, on the first" not in said:
            assert "would not be seen" in said, said
            assert batch_size(inputs) == 1 or "even 1 sample is predicted over" in said, said
        got = _grads(model, inputs, loss_fn)
        assert all(torch.equal(reference[n], got[n]) for n in reference)
    finally:
        remat.remove(model)


def test_fake_and_real_profiles_agree_to_the_byte_on_the_cpu():
    for model, inputs, loss_fn in (_mlp(), _gpt2()):
        real = remat.profile(model, inputs, loss_fn, repeat=1, warmup=0)
        fake = remat.profile(model, inputs, loss_fn, fake=True, target="cpu")
        names = [b.name for b in real.blocks]
        for policy in ("keep", "selective", "full"):
            assignment = {n: policy for n in names}
            assert real.predict_peak(assignment) == fake.predict_peak(assignment), policy


def test_auto_goes_lower_when_a_verification_step_runs_out_of_memory(monkeypatch):
    model, x, _ = _mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    measure_peak = step_module.measure_peak
    calls, failed = [], []

    def out_of_memory_once(model, inputs, loss_fn, loop):
        calls.append(1)
        if len(calls) == 2:  # the first step is the reference's, the second the fastest plan's
            failed.append({n: remat.is_wrapped(m) or "keep" for n, m in model.named_children()})
            model(inputs).square().mean().backward()  # gradients and activations made, then the device is full
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return measure_peak(model, inputs, loss_fn, loop)

    monkeypatch.setattr(step_module, "measure_peak", out_of_memory_once)
    keep = remat.measure(model, x, warmup=0, repeat=1).peak_bytes
    plan = remat.auto(model, x, int(0.8 * keep), repeat=1, warmup=0)
    try:
        assert failed and any("ran out of device memory" in n for n in plan.notes)
        assert plan.assignment != failed[0] and plan.measured_peak_bytes <= int(0.8 * keep)
        assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())
        assert torch.equal(rng, torch.get_rng_state())
    finally:
        remat.remove(model)


def test_auto_raises_with_the_numbers_when_no_plan_fits_the_device():
    model, x, _ = _mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    prof = remat.profile(model, x, fake=True, target="cpu")
    floor = remat.plan(prof, strategy="none").min_peak_bytes
    device = SimulatedDevice(floor - 1, resting(model, x))
    with device, pytest.raises(remat.RematError, match="cannot be met") as err:
        remat.auto(model, x, floor - 1, repeat=1, warmup=0)
    assert str(floor) in str(err.value) and device.peak <= floor - 1
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_plan_the_device_refuses_in_its_step_leaves_the_model_restored():
    model, x, _ = _mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    keep = remat.measure(model, x, warmup=0, repeat=1).peak_bytes
    prof = remat.profile(model, x, fake=True, target="cpu")
    floor = remat.plan(prof, strategy="none", nested=False).min_peak_bytes
    # the device is smaller than the budget: the plans predicted within the budget run out of memory
    device = SimulatedDevice((floor + 3 * keep) // 4 - 1, resting(model, x))
    with device:
        plan = remat.auto(model, x, int(0.9 * keep), repeat=1, warmup=0)
    try:
        assert device.refused and any("ran out of device memory" in n for n in plan.notes)
        assert device.peak <= device.capacity
    finally:
        remat.remove(model)
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())


#: Zoo models on a GPU: activations of tens of MiB, so that the caching allocator's rounding (512-byte blocks, 2 MiB
#: segments for small tensors) is small beside the budget.
CUDA_ZOO = {
    "gpt2": {"layers": 4, "hidden": 256, "heads": 4, "vocab": 2048, "seq": 256, "batch": 8},
    "llama": {
        "layers": 4,
        "hidden": 256,
        "intermediate": 688,
        "heads": 4,
        "kv_heads": 2,
        "vocab": 2048,
        "seq": 256,
        "batch": 8,
    },
    "vit": {
        "layers": 4,
        "hidden": 192,
        "intermediate": 768,
        "heads": 4,
        "image": 128,
        "patch": 8,
        "classes": 10,
        "batch": 8,
        "dropout": 0.1,
    },
    "resnet50": {
        "depths": (3, 3),
        "hidden_sizes": (64, 64),
        "embedding_size": 8,
        "image": 128,
        "classes": 10,
        "batch": 16,
    },
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fraction", [0.8, 0.6])
@pytest.mark.parametrize("name", list(CUDA_ZOO))
def test_auto_fits_a_gpu_the_step_without_checkpointing_does_not(name, fraction, on_a_smaller_gpu):
    zoo = build(name, **CUDA_ZOO[name])
    model = zoo.model.cuda()
    inputs = {k: v.cuda() for k, v in zoo.inputs.items()} if isinstance(zoo.inputs, dict) else zoo.inputs.cuda()
    keep = remat.measure(model, inputs, zoo.loss_fn, warmup=0, repeat=1).peak_bytes
    reference = _grads(model, inputs, zoo.loss_fn)
    budget = int(fraction * keep)
    # the device: the budget and the allocator's segments beside it; the step without checkpointing does not fit
    on_a_smaller_gpu(gpu_for(budget))
    with pytest.raises(torch.OutOfMemoryError):
        remat.measure(model, inputs, zoo.loss_fn, warmup=0, repeat=1)
    on_a_smaller_gpu(gpu_for(budget))
    plan = remat.auto(model, inputs, budget, loss_fn=zoo.loss_fn, repeat=1, warmup=0)
    try:
        assert torch.cuda.max_memory_allocated() <= budget + (budget >> 5)
        assert plan.checkpointed and plan.measured_peak_bytes <= budget
        got = _grads(model, inputs, zoo.loss_fn)
        assert all(torch.equal(reference[n], got[n]) for n in reference)
    finally:
        remat.remove(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_profile_that_runs_out_of_gpu_memory_says_how_much_it_needs(on_a_smaller_gpu):
    zoo = build("gpt2", **CUDA_ZOO["gpt2"])
    model = zoo.model.cuda()
    inputs = {k: v.cuda() for k, v in zoo.inputs.items()}
    keep = remat.measure(model, inputs, warmup=0, repeat=1).peak_bytes
    on_a_smaller_gpu(int(0.7 * keep))
    with pytest.raises(remat.RematError, match="ran out of device memory") as err:
        remat.profile(model, inputs, repeat=1, warmup=0)
    assert isinstance(err.value, torch.cuda.OutOfMemoryError) and "remat.auto(model, inputs, budget)" in str(err.value)
    assert all(p.grad is None for p in model.parameters())


def test_no_budget_off_cuda_is_refused_with_the_fix():
    model, x, _ = _mlp()
    with pytest.raises(remat.RematError, match="budget=None fits the plan to the GPU.*pass a budget: a fraction"):
        remat.auto(model, x, None, repeat=1, warmup=0)
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_budget_on_cuda_fits_the_free_memory():
    from remat.planning._gpu_room import room_on

    model, x, _ = _mlp()
    model, x = model.cuda(), x.cuda()
    room = room_on(x.device)
    free, _ = torch.cuda.mem_get_info()
    assert torch.cuda.memory_allocated() < room.budget_bytes < torch.cuda.memory_reserved() + free
    plan = remat.auto(model, x, None, repeat=1, warmup=0)
    remat.remove(model)
    assert plan.budget_bytes <= room.budget_bytes and not plan.checkpointed  # this small model fits any GPU
    assert plan.notes[0].startswith("budget=None") and any("caching allocator reserved" in n for n in plan.notes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_budget_fits_the_share_of_the_gpu_the_step_without_checkpointing_does_not(on_a_smaller_gpu):
    from remat.planning._gpu_room import room_on

    zoo = build("gpt2", **CUDA_ZOO["gpt2"])
    model = zoo.model.cuda()
    inputs = {k: v.cuda() for k, v in zoo.inputs.items()}
    keep = remat.measure(model, inputs, warmup=0, repeat=1).peak_bytes
    reference = _grads(model, inputs, None)
    torch.cuda.empty_cache()
    live = torch.cuda.memory_allocated()
    allowed = live + int(0.75 * (keep - live))  # what the process may reserve: 3/4 of the step's room
    on_a_smaller_gpu(allowed)
    with pytest.raises(torch.OutOfMemoryError):
        remat.measure(model, inputs, warmup=0, repeat=1)
    on_a_smaller_gpu(allowed)
    room = room_on(torch.device("cuda"))
    assert room.capacity <= allowed + (allowed >> 10)  # the share of the total, rounded by the allocator
    plan = remat.auto(model, inputs, None, repeat=1, warmup=0)  # every step remat runs is within the share
    try:
        assert plan.checkpointed and plan.measured_peak_bytes <= plan.budget_bytes <= room.budget_bytes
        assert torch.cuda.max_memory_reserved() <= room.capacity
        assert any("caching allocator reserved" in n for n in plan.notes)
        got = _grads(model, inputs, None)
        assert all(torch.equal(reference[n], got[n]) for n in reference)
    finally:
        remat.remove(model)


def test_a_real_profile_that_runs_out_of_memory_leaves_auto_on_the_fake_one(monkeypatch):
    from remat.planning import _within as within_module

    model, x, _ = _mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    profile = within_module.make_profile

    def real_out_of_memory(*args, **kwargs):
        if not kwargs.get("fake"):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return profile(*args, **kwargs)

    monkeypatch.setattr(within_module, "make_profile", real_out_of_memory)
    plan = remat.auto(model, x, 1.0, repeat=1, warmup=0)  # the step without checkpointing fits the budget
    assert not plan.checkpointed and plan.measured_peak_bytes <= plan.budget_bytes
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())


def test_a_profile_that_runs_out_of_memory_says_how_much_it_needs():
    model, x, _ = _mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    keep = remat.measure(model, x, warmup=0, repeat=1).peak_bytes
    device = SimulatedDevice(int(0.7 * keep), resting(model, x))
    with device, pytest.raises(remat.RematError, match="ran out of device memory") as err:
        remat.profile(model, x, repeat=1, warmup=0)
    assert isinstance(err.value, torch.OutOfMemoryError)  # code that catches out-of-memory still does
    assert f"predicted at {keep} bytes" in str(err.value) and "remat.auto(model, inputs, budget)" in str(err.value)
    assert device.peak <= device.capacity
    with device, pytest.raises(remat.RematError, match="remat.measure: a measured step ran out of device memory"):
        remat.measure(model, x, warmup=0, repeat=1)
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())
    assert {m.training for m in model.modules()} == {True}


def _cli_plan(monkeypatch, capsys, fraction):
    """``remat plan gpt2 --budget`` at ``fraction`` of the step on a simulated device of that budget: the plan it
    prints, the device, and whether each profile it ran was on fake tensors."""
    from remat.cli._main import main
    from remat.profiling import profile as profile_module

    kinds, profile = [], profile_module.profile
    monkeypatch.setattr(remat, "profile", lambda *a, **k: kinds.append(bool(k.get("fake"))) or profile(*a, **k))
    zoo = build("gpt2", layers=2, hidden=64, heads=4, seq=32, batch=2, vocab=256)
    budget = int(fraction * remat.measure(zoo.model, zoo.inputs, warmup=0, repeat=1).peak_bytes)
    args = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--vocab", "256"]
    device = SimulatedDevice(budget)
    with device:
        assert main(["plan", "gpt2", *args, "--repeat", "1", "--budget", str(budget), "--json"]) == 0
    return remat.Plan.from_json(capsys.readouterr().out), device, kinds


def test_cli_plan_runs_no_step_over_the_budget(monkeypatch, capsys):
    plan, device, kinds = _cli_plan(monkeypatch, capsys, 0.85)
    assert kinds == [True] and plan.checkpointed and plan.predicted_peak_bytes <= plan.budget_bytes
    assert device.peak <= device.capacity
    _, _, kinds = _cli_plan(monkeypatch, capsys, 1.2)  # the step without checkpointing fits: measured as before
    assert kinds == [True, False]


def test_max_batch_tries_no_batch_predicted_over_the_budget(monkeypatch):
    from remat.bench import _max_batch

    options = {"layers": 4, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 128, "seq": 64}
    zoo = build("llama", **options, batch=2)
    budget = remat.measure(zoo.model, zoo.inputs, zoo.loss_fn, warmup=0, repeat=1).peak_bytes
    measured, peak = [], _max_batch._step_peak

    def counted_peak(zoo, setup):
        measured.append(zoo.inputs["input_ids"].shape[0])
        return peak(zoo, setup)

    monkeypatch.setattr(_max_batch, "_step_peak", counted_peak)
    # the budget is the step's peak at batch 2 to the byte; the device has room for the few bytes (a scalar) that
    # remat's step holds outside the step it tracks
    device = SimulatedDevice(budget + 1024)
    with device:
        result = _max_batch.max_batch("llama", budget, strategies=("none", "remat"), options=options, limit=4)
    assert result.batches["none"] == 2 and result.batches["remat"] > 2 and result.peaks["remat"] <= budget
    assert device.peak <= device.capacity and not device.refused
    tried = [b for s in ("none", "remat") for b in result.tried[s]]
    assert len(measured) < len(tried)  # the batches predicted over were answered without a step


def test_distributed_auto_profiles_within_the_budget():
    model, x, _ = _mlp()
    reference = _grads(model, x, None)
    keep = remat.measure(model, x, warmup=0, repeat=1).peak_bytes
    device = SimulatedDevice(int(0.7 * keep), resting(model, x))
    with device:
        plan = remat.distributed.auto(model, x, int(0.7 * keep), repeat=1, warmup=0)  # no process group: rank 0
    try:
        assert plan.checkpointed and device.peak <= device.capacity
        assert remat.measure(model, x, warmup=0, repeat=1).peak_bytes <= int(0.7 * keep)
        got = _grads(model, x, None)
        assert all(torch.equal(reference[n], got[n]) for n in reference)
    finally:
        remat.remove(model)


def test_a_step_within_the_budget_that_runs_out_beside_the_snapshot_says_what_sat_beside_it():
    # On the CPU with an optimizer, verification's copy of the parameters and of AdamW's state sits in the same
    # memory as the step: a device with room for the lowest-peak step but not for that copy refuses the step.
    # The message must not tell the user to raise the budget to a figure below the one they gave.
    model, x, _ = _mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    prof = remat.profile(model, x, fake=True, target="cpu", optimizer=optimizer)
    floor = remat.plan(prof, strategy="none").min_peak_bytes
    snapshot = prof.param_bytes + prof.optimizer_bytes
    budget = floor + snapshot // 4
    assert budget < prof.baseline_peak_bytes  # planned on fake tensors, verified from the lowest-peak plan
    device = SimulatedDevice(budget, resting(model, x))
    with device, pytest.raises(remat.RematError, match="cannot be met on this device") as err:
        remat.auto(model, x, budget, repeat=1, warmup=0, optimizer=optimizer)
    message = str(err.value)
    assert "copy of the parameters and the optimizer's state" in message and "within the budget" in message
    assert "Raise the budget to at least" not in message
    assert device.peak <= budget
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())
    assert not optimizer.state and not any("forward" in m.__dict__ for m in model.modules())


class _ChecksItsVariance(nn.Module):
    """A Gaussian likelihood head: ``gaussian_nll_loss`` checks the variance's values, which fake tensors lack."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)) for _ in range(4))
        self.head = nn.Linear(64, 2)

    def forward(self, x, y):
        for block in self.blocks:
            x = x + block(x)
        mean, log_var = self.head(x).unbind(-1)
        return nn.functional.gaussian_nll_loss(mean, y, log_var.exp())


def test_a_model_fake_tensors_cannot_run_on_a_device_it_does_not_fit_is_told_why():
    torch.manual_seed(0)
    model, inputs = _ChecksItsVariance(), (torch.randn(256, 64), torch.randn(256))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    keep = remat.measure(model, inputs, lambda loss: loss, warmup=0, repeat=1).peak_bytes
    device = SimulatedDevice(int(0.8 * keep), resting(model, inputs))
    with device, pytest.raises(remat.errors.OutOfMemory) as err:
        remat.auto(model, inputs, int(0.7 * keep), loss_fn=lambda loss: loss, repeat=1, warmup=0)
    message = str(err.value)
    assert "fake tensors cannot run this model" in message and "reads a tensor's value at" in message
    assert "call remat.auto" not in message  # not the advice that sent the user here
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not any(remat.is_wrapped(m) for m in model.modules())
