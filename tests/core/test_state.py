"""Restores of the user's state: every one runs whatever stops the step, a Ctrl-C waits for them, and what
cannot be put back is remat's error, naming it (NOTE [Restores run whatever stops the step])."""

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
