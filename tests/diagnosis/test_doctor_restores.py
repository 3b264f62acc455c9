"""remat.doctor puts the user's state back however its steps end (a Ctrl-C included), touches no object it
cannot put back safely (diffusers' frozen config), and tells a failure to restore as its own, not the model's."""

import collections

import pytest
import torch
import torch.utils.checkpoint as tc
from conftest import Interruptible, UntouchedByCtrlC, ctrl_c_while_restoring_rng
from torch import nn

import remat
from remat.core import checkpoint as remat_checkpoint
from remat.diagnosis._doors import doors

NAMES = doors()
DOORS = (*(getattr(tc, name) for name in NAMES), remat_checkpoint._run_checkpointed)


def _doors_closed():
    assert (*(getattr(tc, name) for name in NAMES), remat_checkpoint._run_checkpointed) == DOORS


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


class Frozen(collections.OrderedDict):
    """A mapping that refuses changes after it is made, as diffusers' FrozenDict (a model's config) does;
    ``clear`` still works, so clearing it then refilling it with ``update`` erased it."""

    def _refuse(self, *args, **kwargs):
        raise Exception(f"You cannot change a {type(self).__name__} instance.")

    __delitem__ = update = setdefault = pop = popitem = _refuse


class Configured(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = Frozen(width=8, layers=2)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return tc.checkpoint(self.blocks, x, use_reentrant=False)


def test_doctor_leaves_a_frozen_mapping_alone():
    model = Configured()
    config = model.config
    report = remat.doctor(model, torch.randn(2, 8), measure_cost=False)
    assert report.ok and [c.target for c in report.checkpoints] == ["blocks"]
    assert model.config is config and dict(config) == {"width": 8, "layers": 2}
    assert model.calls == 0


class LazyScale(nn.Module):
    """Registers a buffer in its first forward (lazy initialisation): remat cannot take that back."""

    def __init__(self):
        super().__init__()
        self.block = nn.Linear(4, 4)

    def forward(self, x):
        if not hasattr(self, "scale"):
            self.register_buffer("scale", torch.ones(4))
        return tc.checkpoint(self.block, x, use_reentrant=False) * self.scale


def test_a_failed_restore_is_remats_error_not_the_models():
    model = LazyScale()
    with pytest.raises(remat.RematError) as info:
        remat.doctor(model, torch.randn(2, 4), measure_cost=False)
    message = str(info.value)
    assert message.startswith("remat.doctor: failed to restore the model") and "buffer 'scale'" in message
    assert "the model raised" not in message and "run one training step yourself first" in message
    _doors_closed()


def _unet(conditional):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    if conditional:
        model = diffusers.UNet2DConditionModel(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            block_out_channels=(32, 64),
            layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=8,
        )
        inputs = {
            "sample": torch.randn(2, 4, 8, 8),
            "timestep": torch.tensor([1, 2]),
            "encoder_hidden_states": torch.randn(2, 5, 32),
        }
    else:
        model = diffusers.UNet2DModel(
            sample_size=16,
            block_out_channels=(32, 64),
            layers_per_block=1,
            norm_num_groups=8,
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        )
        inputs = (torch.randn(2, 3, 16, 16), torch.tensor([1, 2]))
    return model, inputs


@pytest.mark.parametrize("conditional, checkpointing", [(False, False), (False, True), (True, True)])
def test_doctor_diagnoses_diffusers_unets(conditional, checkpointing):
    model, inputs = _unet(conditional)
    if checkpointing:
        model.enable_gradient_checkpointing()
    config = dict(model.config)
    report = remat.doctor(model, inputs, lambda out: out.sample.float().sum(), measure_cost=False)
    assert dict(model.config) == config and len(config) > 20
    assert report.ok, report.codes()
    assert report.loss_reference == report.loss_checkpointed
    if checkpointing:
        assert report.checkpoints and {c.api for c in report.checkpoints} == {"diffusers gradient checkpointing"}
    else:
        assert report.checkpoints == ()
