"""Restores of the user's state: every one runs whatever stops the step, a Ctrl-C waits for them, and what
cannot be put back is remat's error, naming it (NOTE [Restores run whatever stops the step])."""

import copy
import signal

import pytest
import torch
from torch import nn

import remat
from remat.core._state import capture, restore_all, uninterrupted


def test_every_restore_runs_when_one_fails_or_is_interrupted():
    done = []

    def fails():
        raise ValueError("no")

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as info:
        restore_all("remat.x", (fails, lambda: done.append(1), interrupted, lambda: done.append(2)))
    assert done == [1, 2]
    assert info.value.__notes__ == ["remat.x: failed to restore the model's state (ValueError: no)."]
    with pytest.raises(remat.RematError, match=r"^remat.x: failed to restore the model's state \(ValueError: no\)"):
        restore_all("remat.x", (fails, lambda: done.append(3)))
    assert done == [1, 2, 3]


def test_a_ctrl_c_pressed_while_restoring_waits_until_the_end():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with uninterrupted():
            signal.raise_signal(signal.SIGINT)
            done.append("after the signal")
    assert done == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


class GrowsABuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        self.register_buffer(f"seen{len(self._buffers)}", x.detach().clone())
        return self.norm(self.linear(x))


def test_what_cannot_be_restored_is_named_and_everything_else_is_restored():
    model, x = GrowsABuffer(), torch.randn(3, 4)
    before = capture(model)
    with pytest.raises(remat.RematError) as info:
        remat.measure(model, x, warmup=0, repeat=1)
    assert str(info.value).startswith(
        "remat.measure: failed to restore the model after running its step: buffer 'seen0' (the step registered it; "
        "it did not exist before); buffer 'seen1' (the step registered it; it did not exist before). Everything else "
        "was restored."
    )
    now = capture(model)
    assert all(torch.equal(before.params[n][0], now.params[n][0]) for n in before.params)
    assert all(torch.equal(before.buffers[n], now.buffers[n]) for n in before.buffers)
    assert torch.equal(before.cpu_rng, now.cpu_rng)


class _SpecAugment(nn.Module):
    """Masks drawn from NumPy's global generator outside every block, as Wav2Vec2's SpecAugment does."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)))

    def forward(self, x):
        import numpy as np

        keep = torch.from_numpy(np.random.rand(x.shape[0]) < 0.7).to(x.dtype)
        return self.layers(x * keep[:, None]).square().mean()


def test_a_snapshot_puts_pythons_and_numpys_rng_back():
    import random

    np = pytest.importorskip("numpy")
    state = capture(nn.Linear(2, 2))
    before = random.random(), np.random.rand()
    state.restore()
    assert (random.random(), np.random.rand()) == before


@pytest.mark.parametrize("fake", [False, True])
def test_auto_and_profile_leave_numpys_rng_as_it_was_and_verify_a_model_drawing_from_it(fake):
    # Before, each verification step drew other masks from NumPy: auto refused Wav2Vec2 with SpecAugment as
    # "another function", and left NumPy's stream moved.
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    np.random.seed(0)
    model, x = _SpecAugment().train(), torch.randn(256, 16)
    expected = np.random.get_state()[1].copy()
    if fake:
        remat.profile(model, x, fake=True)
    else:
        plan = remat.auto(model, x, budget=0.8)
        assert plan.checkpointed and plan.measured_peak_bytes <= plan.budget_bytes
        remat.remove(model)
    assert np.array_equal(np.random.get_state()[1], expected)


def test_a_buffer_a_step_wrote_into_its_graph_is_a_leaf_again_after_the_restore():
    # A step that writes a buffer in place from values that require grad (an EMA updated without no_grad, or a
    # trace that lost its no_grad region) leaves the buffer in that step's graph; restored, it is a plain tensor again.
    class Averages(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.register_buffer("ema", torch.zeros(8))

        def forward(self, x):
            y = self.fc(x)
            self.ema.mul_(0.9).add_(0.1 * y.mean(0))
            return y

    model = Averages()
    state = capture(model)
    model(torch.randn(4, 8)).sum().backward()
    assert model.ema.grad_fn is not None
    state.restore()
    assert model.ema.grad_fn is None and not model.ema.requires_grad
    assert torch.equal(model.ema, torch.zeros(8))
    copy.deepcopy(model)  # refused while the buffer was a graph's


def test_a_buffer_a_step_resized_is_put_back_at_its_size_in_place():
    # QAT's per-channel observers size their statistics on their first step: remat.auto left 44 of them resized
    # (0 or 1 elements before, 128 after) and the model was not as the user handed it.
    model = nn.Linear(4, 4)
    model.register_buffer("scale", torch.ones(1))
    model.register_buffer("min_val", torch.empty(0))
    scale, min_val = model.scale, model.min_val
    state = capture(model)
    model.scale.resize_(4).fill_(3.0)
    model.min_val.resize_(4).fill_(-1.0)
    state.restore()
    assert model.scale is scale and model.min_val is min_val  # the objects others hold (the observer's)
    assert torch.equal(model.scale, torch.ones(1)) and model.min_val.shape == (0,)
