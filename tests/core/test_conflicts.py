"""remat refuses to checkpoint blocks that the model already checkpoints itself."""

import warnings

import pytest
import torch
from conftest import SMALL
from torch import nn

import remat
from remat.zoo import build


def _plan(assignment):
    # model="": a hand-made plan that records no model class, so apply checks only its block names.
    return remat.Plan(
        assignment=assignment,
        predicted_peak_bytes=0,
        predicted_overhead=0.0,
        baseline_peak_bytes=0,
        min_peak_bytes=0,
        budget_bytes=None,
        strategy="none",
        model="",
    )


def _nothing_wrapped(model):
    return all(remat.is_wrapped(m) is None for m in model.modules())


def _hf_checkpointing(model, on):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renamed it activation_checkpointing_*
        model.gradient_checkpointing_enable() if on else model.gradient_checkpointing_disable()


def _attention_calls(model, inputs):
    calls = []
    hook = model.transformer.h[0].attn.register_forward_hook(lambda *_: calls.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        remat.core._step.training_step(model, inputs)
    hook.remove()
    return len(calls)


def test_double_checkpointing_recomputes_twice_when_one_is_reentrant():
    # Why remat refuses overlaps (NOTE in remat.core._conflicts): count the block's attention calls per step.
    zoo = build("gpt2", **SMALL["gpt2"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        zoo.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert _attention_calls(zoo.model, zoo.inputs) == 2  # forward + transformers' recompute
    remat.wrap(zoo.model.transformer.h[0])  # what apply would do, without its check
    assert _attention_calls(zoo.model, zoo.inputs) == 3  # recomputed twice


def test_hugging_face_gradient_checkpointing_is_detected_and_named():
    zoo = build("gpt2", **SMALL["gpt2"])
    _hf_checkpointing(zoo.model, True)
    with pytest.raises(
        remat.RematError,
        match=r"remat.apply: .*'transformer\.h\.0'.*Hugging Face.*recomputed "
        r"twice.*gradient_checkpointing_disable",
    ):
        remat.apply(zoo.model, _plan({"transformer.h.0": "full", "transformer.h.1": "keep"}))
    assert _nothing_wrapped(zoo.model)
    with pytest.raises(remat.RematError, match="remat.auto: .*Turn one of them off"):
        remat.auto(zoo.model, zoo.inputs, 0.5, repeat=1, warmup=0)
    assert _nothing_wrapped(zoo.model)
    _hf_checkpointing(zoo.model, False)
    remat.apply(zoo.model, _plan({"transformer.h.0": "full"}))
    assert _attention_calls(zoo.model, zoo.inputs) == 2  # remat's recompute only
    remat.remove(zoo.model)


def test_a_plan_that_keeps_the_self_checkpointed_blocks_is_fine():
    zoo = build("gpt2", **SMALL["gpt2"])
    _hf_checkpointing(zoo.model, True)
    remat.apply(zoo.model, _plan({"transformer.h.0": "keep"}))
    assert _nothing_wrapped(zoo.model)


def _mlps():
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(3)))


def test_torch_checkpoint_wrapper_overlapping_a_block_is_refused():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _mlps()
    model[1] = checkpoint_wrapper(model[1])
    with pytest.raises(remat.RematError, match=r"'1'.*torch checkpoint_wrapper.*Turn one of them off"):
        remat.apply(model, _plan({"0": "full", "1": "full"}))
    assert _nothing_wrapped(model)
    remat.apply(model, _plan({"0": "full", "2": "selective"}))  # no overlap: allowed
    assert remat.is_wrapped(model[0]) == "full" and remat.is_wrapped(model[2]) == "selective"


def test_composable_checkpoint_and_model_level_flags_are_refused():
    from torch.distributed._composable import checkpoint

    model = _mlps()
    checkpoint(model[2])
    with pytest.raises(remat.RematError, match="torch.distributed._composable.checkpoint"):
        remat.apply(model, _plan({"2": "full"}))
    model = _mlps()
    model.gradient_checkpointing = True  # a container that checkpoints what it calls: every block overlaps
    with pytest.raises(remat.RematError, match="sits in or contains 'Sequential'"):
        remat.apply(model, _plan({"1": "full"}))
    assert _nothing_wrapped(model)


def test_timms_own_gradient_checkpointing_is_refused_with_its_switch():
    # timm's set_grad_checkpointing(True) sets grad_checkpointing and runs the blocks through torch's checkpoint
    # in forward: auto, seeing no wrapper, profiled a checkpointed model and advertised a floor it then refused.
    model = _mlps()
    model.grad_checkpointing = True
    with pytest.raises(remat.RematError, match=r"timm gradient checkpointing.*set_grad_checkpointing\(False\)"):
        remat.apply(model, _plan({"1": "full"}))
    assert _nothing_wrapped(model)


def test_a_real_timm_model_with_its_checkpointing_on_is_refused_by_auto():
    timm = pytest.importorskip("timm", exc_type=ImportError)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3, img_size=32, patch_size=8)
    model.set_grad_checkpointing(True)
    with pytest.raises(remat.RematError, match="set_grad_checkpointing"):
        remat.auto(model.train(), torch.randn(2, 3, 32, 32), budget=0.8)
    assert _nothing_wrapped(model)
