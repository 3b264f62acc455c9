"""remat.doctor puts the user's state back however its steps end (a Ctrl-C included)."""

import pytest
import torch
import torch.utils.checkpoint as tc

import remat
from remat.core import checkpoint as remat_checkpoint
from conftest import Interruptible, UntouchedByCtrlC, ctrl_c_while_restoring_rng

DOORS = (tc.CheckpointFunction, tc._checkpoint_without_reentrant_generator, remat_checkpoint._run_checkpointed)


def _doors_closed():
    assert (tc.CheckpointFunction, tc._checkpoint_without_reentrant_generator,
            remat_checkpoint._run_checkpointed) == DOORS


@pytest.mark.parametrize("at", [0, 1, 3])  # the step without checkpointing, as written, a measured step
def test_ctrl_c_in_a_doctor_step_leaves_everything_as_it_was(at):
    model, x = Interruptible(at), torch.randn(4, 8)
    UntouchedByCtrlC(model, python=True).check(lambda: remat.doctor(model, x, repeat=1))
    _doors_closed()


def test_ctrl_c_while_the_doctor_restores_waits_until_everything_is_back(monkeypatch):
    # From the second step on, each restore is hit by a Ctrl-C; the last one holds it until the Python values
    # are back too.
    model, x = Interruptible(), torch.randn(4, 8)
    untouched = UntouchedByCtrlC(model, python=True)
    ctrl_c_while_restoring_rng(monkeypatch, start=1)
    untouched.check(lambda: remat.doctor(model, x, measure_cost=False))
    _doors_closed()
