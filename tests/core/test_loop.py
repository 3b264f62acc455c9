"""The training loop around a step (remat.core._loop): measured as the loop runs it, and the options checked."""

import pytest
import torch
from conftest import Untouched
from torch import nn

import remat
from remat.core._loop import OptimizerSnapshot, make_loop
from remat.core._memtrack import StorageTracker, storage_bytes
from remat.core._step import training_step
from remat.zoo import build

SIZES = {"layers": 2, "hidden": 64, "heads": 2, "vocab": 256, "seq": 32, "batch": 2}
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adamw-for-loop": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=False),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2),
}


def _loop_peak(model, inputs, optimizer, accumulation_steps, iterations=3):
    """The loop itself, by hand: the most bytes alive in any iteration after the first (their peaks repeat)."""
    peaks = []
    for _ in range(iterations):
        model.zero_grad(set_to_none=True)
        known = [
            *model.parameters(),
            *model.buffers(),
            *inputs.values(),
            *(v for s in (optimizer.state.values() if optimizer else ()) for v in s.values() if torch.is_tensor(v)),
        ]
        tracker = StorageTracker(known=known)
        with tracker:
            for k in range(accumulation_steps):
                training_step(model, inputs, optimizer=optimizer if k == accumulation_steps - 1 else None)
        peaks.append(storage_bytes(known) + tracker.peak)
    assert peaks[1] == peaks[-1]  # steady from the second iteration on
    return max(peaks)


@pytest.mark.parametrize("accumulation_steps", [1, 2, 3])
@pytest.mark.parametrize("name", list(OPTIMIZERS) + [None])
def test_measure_reports_the_peak_the_loop_reaches(name, accumulation_steps):
    zoo = build("gpt2", **SIZES)
    optimizer = OPTIMIZERS[name](zoo.model.parameters()) if name else None
    guard = Untouched(zoo.model)
    measured = remat.measure(
        zoo.model, zoo.inputs, optimizer=optimizer, accumulation_steps=accumulation_steps, warmup=0, repeat=1
    )
    guard.check()
    assert optimizer is None or not optimizer.state  # its state restored: empty, as before
    assert measured.peak_bytes == _loop_peak(zoo.model, zoo.inputs, optimizer, accumulation_steps)
    bare = remat.measure(zoo.model, zoo.inputs, warmup=0, repeat=1).peak_bytes
    if name not in (None, "sgd") or accumulation_steps > 1:
        assert measured.peak_bytes > bare  # what the loop keeps alive shows
    else:
        assert measured.peak_bytes == bare


def test_a_running_optimizers_state_is_restored_exactly():
    zoo = build("gpt2", **SIZES)
    optimizer = torch.optim.AdamW(zoo.model.parameters(), lr=1e-3)
    for _ in range(2):  # mid-training: state and gradients exist
        training_step(zoo.model, zoo.inputs, optimizer=optimizer)
    before = {k: v.clone() for k, v in _flat_state(optimizer).items()}
    snapshot = OptimizerSnapshot(optimizer)
    training_step(zoo.model, zoo.inputs, optimizer=optimizer)
    snapshot.restore()
    after = _flat_state(optimizer)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    guard = Untouched(zoo.model)
    remat.profile(zoo.model, zoo.inputs, optimizer=optimizer, accumulation_steps=2, warmup=0, repeat=1)
    guard.check()
    after = _flat_state(optimizer)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def _flat_state(optimizer):
    return {(i, k): v for i, s in optimizer.state_dict()["state"].items() for k, v in s.items() if torch.is_tensor(v)}


class _Wrapper(torch.optim.Optimizer):
    """Stands for Accelerate's AcceleratedOptimizer: a step that may skip, the real optimizer inside."""

    def __init__(self, inner):  # noqa: D107 -- deliberately not calling super().__init__
        self.optimizer = inner

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        pass  # an accumulation step: the wrapper does not step


def test_wrapped_optimizers_are_unwrapped():
    model = nn.Linear(4, 4)
    inner = torch.optim.AdamW(model.parameters())
    assert make_loop(model, _Wrapper(inner), 2, "api").optimizer is inner


@pytest.mark.parametrize(
    ("optimizer", "steps", "match"),
    [
        (None, 0, "accumulation_steps must be an integer >= 1"),
        (None, 1.5, "accumulation_steps must be an integer >= 1"),
        (None, True, "accumulation_steps must be an integer >= 1"),
        ("not an optimizer", 1, "optimizer must be a torch.optim.Optimizer"),
        ("foreign", 1, "are not parameters of the model"),
    ],
)
@pytest.mark.parametrize("api", ["measure", "profile", "auto"])
def test_bad_loop_options_fail_clearly_and_leave_the_model_as_it_was(api, optimizer, steps, match):
    zoo = build("gpt2", **SIZES)
    if optimizer == "foreign":
        optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    guard = Untouched(zoo.model)
    call = {
        "measure": lambda: remat.measure(zoo.model, zoo.inputs, optimizer=optimizer, accumulation_steps=steps),
        "profile": lambda: remat.profile(zoo.model, zoo.inputs, optimizer=optimizer, accumulation_steps=steps),
        "auto": lambda: remat.auto(zoo.model, zoo.inputs, 0.5, optimizer=optimizer, accumulation_steps=steps),
    }
    with pytest.raises(remat.RematError, match=match):
        call[api]()
    guard.check()
    assert not any(remat.is_wrapped(m) for m in zoo.model.modules())
