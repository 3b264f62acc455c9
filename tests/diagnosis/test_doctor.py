"""remat.doctor: each seed reproduced as its user wrote it, each finding with the right modules named,
correct checkpointing reported ok, and the model (and torch) exactly as before afterwards."""

import dataclasses
import functools
import json
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
import torch.utils.checkpoint as tc
from conftest import assert_state_equal
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import remat
from remat.cli._demo import SeedCifarReentrant
from remat.core import checkpoint as remat_checkpoint
from remat.core._state import capture
from remat.diagnosis._doors import doors

# The private globals the doctor swaps on this torch (found from the public checkpoint).
FUNCTION, GENERATOR = doors()
ORIGINALS = {
    "checkpoint": tc.checkpoint,
    "CheckpointFunction": getattr(tc, FUNCTION),
    "generator": getattr(tc, GENERATOR),
    "remat": remat_checkpoint._run_checkpointed,
}


def _torch_untouched():
    now = {
        "checkpoint": tc.checkpoint,
        "CheckpointFunction": getattr(tc, FUNCTION),
        "generator": getattr(tc, GENERATOR),
        "remat": remat_checkpoint._run_checkpointed,
    }
    assert all(now[k] is ORIGINALS[k] for k in ORIGINALS), now
    # Nor does any module (torch imports some lazily, by value) keep one of the doctor's stand-ins.
    for name, module in list(sys.modules.items()):
        for attr in (FUNCTION, GENERATOR, "_run_checkpointed"):
            value = getattr(module, "__dict__", {}).get(attr)
            assert value is None or value in ORIGINALS.values(), (name, attr, value)


def diagnose(model, inputs, loss_fn=None, **options):
    """remat.doctor, checking that it leaves the model, RNG and torch as they were and warns nothing."""
    options.setdefault("measure_cost", False)
    before = capture(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = remat.doctor(model, inputs, loss_fn, **options)
    assert not caught, [str(w.message) for w in caught]
    assert_state_equal(before, capture(model))
    _torch_untouched()
    json.dumps(report.to_dict())
    return report


def only(report, code):
    found = [f for f in report.findings if f.code == code]
    assert len(found) == 1, report.codes()
    return found[0]


def line_of(marker):
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if marker in text and "line_of" not in text and "at(" not in text)


def at(sites, *markers):
    """True when ``sites`` are this file's lines marked with ``markers`` (paths are shown relative to the cwd)."""
    return len(sites) == len(markers) and all(
        s.replace("\\", "/").endswith(f"tests/diagnosis/test_doctor.py:{line_of(m)}") for s, m in zip(sites, markers)
    )


# --- seed 000: reentrant checkpoint on the first block, exactly as the user wrote it -----------------


class CIFAR10Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.cnn_block_1 = nn.Sequential(
            *[
                nn.Conv2d(3, 32, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(32, 64, 3, padding=1),
                nn.ReLU(),
                nn.MaxPool2d(kernel_size=2),
            ]
        )
        self.dropout_1 = nn.Dropout(0.25)
        self.cnn_block_2 = nn.Sequential(
            *[
                nn.Conv2d(64, 64, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(64, 64, 3, padding=1),
                nn.ReLU(),
                nn.MaxPool2d(kernel_size=2),
            ]
        )
        self.dropout_2 = nn.Dropout(0.25)
        self.flatten = lambda inp: torch.flatten(inp, 1)
        self.linearize = nn.Sequential(*[nn.Linear(64 * 8 * 8, 512), nn.ReLU()])
        self.dropout_3 = nn.Dropout(0.5)
        self.out = nn.Linear(512, 10)

    def forward(self, X):
        X = torch.utils.checkpoint.checkpoint(self.cnn_block_1, X)  # seed 000 block 1
        X = self.dropout_1(X)
        X = torch.utils.checkpoint.checkpoint(self.cnn_block_2, X)  # seed 000 block 2
        X = self.dropout_2(X)
        X = self.flatten(X)
        X = self.linearize(X)
        X = self.dropout_3(X)
        X = self.out(X)
        return X


def _cifar_batch(n=2):
    images, labels = torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))
    return images, lambda logits: F.cross_entropy(logits, labels)


CONV_PARAMS = {f"cnn_block_{b}.{i}.{p}" for b in (1, 2) for i in (0, 2) for p in ("weight", "bias")}


def test_seed_000_both_blocks_frozen_and_unset_use_reentrant_call_sites():
    images, loss_fn = _cifar_batch()
    report = diagnose(CIFAR10Model(), images, loss_fn)
    frozen = only(report, "frozen-by-checkpoint")
    # Block 1 runs on raw data; block 2's input comes from block 1's checkpoint, so it needs no grad either.
    assert frozen.modules == ("cnn_block_1", "cnn_block_2")
    assert set(frozen.params) == CONV_PARAMS and frozen.numbers["params"] == 8
    assert "reentrant" in frozen.message and "use_reentrant left unset" in frozen.message
    assert "remat.checkpoint" in frozen.fix and "use_reentrant=False" in frozen.fix
    risky = [f for f in report.findings if f.code == "risky-call"]
    assert [f.modules for f in risky] == [("cnn_block_1",), ("cnn_block_2",)]
    for f, marker in zip(risky, ("seed 000 block 1", "seed 000 block 2")):
        assert at(f.sites, marker), f.sites
        assert "leaves use_reentrant unset" in f.message
    assert frozen.sites == tuple(s for f in risky for s in f.sites)
    assert report.errors == (frozen,) and not report.ok


def test_seed_000_demo_model_with_explicit_use_reentrant_true():
    images, loss_fn = _cifar_batch()
    report = diagnose(SeedCifarReentrant(), images, loss_fn)
    frozen = only(report, "frozen-by-checkpoint")
    assert frozen.modules == ("cnn_block_1", "cnn_block_2")
    assert "use_reentrant=True" in frozen.message
    risky = [f for f in report.findings if f.code == "risky-call"]
    assert len(risky) == 2
    assert all("passes use_reentrant=True" in f.message and "remat/cli/_demo.py:" in f.sites[0] for f in risky)


# --- seed 001: a whole network checkpointed on raw input ---------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + x)


class TinyResNet(nn.Module):
    """ResNet's layout in miniature (torchvision is not available): stem, residual blocks with BatchNorm, fc."""

    def __init__(self, width=8, num_classes=16):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.layer1 = nn.Sequential(BasicBlock(width), BasicBlock(width))
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x):
        x = self.layer1(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


CHECKPOINT = True


class MODEL(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.LR = nn.Linear(16, 16)

    def forward(self, x):
        if CHECKPOINT == False:  # noqa: E712 (the user's code)
            o1 = self.model(x[:, 0])
            o2 = self.model(x[:, 1])
        else:
            o1 = torch.utils.checkpoint.checkpoint(self.model, x[:, 0])  # seed 001 o1
            o2 = torch.utils.checkpoint.checkpoint(self.model, x[:, 1])  # seed 001 o2
        return torch.mean((self.LR(o1) - o2) ** 2)


def test_seed_001_whole_resnet_on_raw_input_is_frozen_and_its_speedup_illusory():
    T = torch.from_numpy(__import__("numpy").random.default_rng(0).standard_normal((4, 2, 3, 16, 16)))
    report = diagnose(MODEL(TinyResNet()), T.float(), measure_cost=True, repeat=5)
    frozen = only(report, "frozen-by-checkpoint")
    assert frozen.modules == ("model",)
    assert len(frozen.params) == len(list(TinyResNet().parameters()))
    illusory = only(report, "illusory-speedup")
    assert illusory.modules == ("model",)
    n = illusory.numbers
    assert n["step_time_s_checkpointed"] < n["step_time_s_reference"]
    assert n["peak_bytes_checkpointed"] < n["peak_bytes_reference"]
    sites = [f.sites[0] for f in report.findings if f.code == "risky-call"]
    assert at(sites, "seed 001 o1", "seed 001 o2"), sites
    # Nothing else: LR's gradients are right and BatchNorm ran once (no recomputation at all).
    assert set(report.codes()) == {"frozen-by-checkpoint", "illusory-speedup", "risky-call"}


# --- BatchNorm inside torch's checkpoint, however it is reached ------------------------------------------


def _bn_block():
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))


class TorchCheckpointed(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.inp, self.block, self.how = nn.Linear(8, 8), _bn_block(), how
        if how == "checkpoint_wrapper":
            self.block = checkpoint_wrapper(self.block)
        if how == "composable":
            composable_checkpoint(self.block)

    def forward(self, x):
        h = self.inp(x)
        if self.how == "checkpoint":
            return tc.checkpoint(self.block, h, use_reentrant=False)  # bn call
        if self.how == "checkpoint_sequential":
            return tc.checkpoint_sequential(self.block, 2, h, use_reentrant=False)  # bn sequential
        return self.block(h)


@pytest.mark.parametrize("how", ["checkpoint", "checkpoint_sequential", "checkpoint_wrapper", "composable"])
def test_batchnorm_in_torch_checkpoint_updates_twice(how):
    model = TorchCheckpointed(how)
    x = torch.randn(6, 8)
    model(x).sum().backward()  # the user's own gradients must survive the doctor
    model.inp.eval()  # and so must a mixed training flag
    report = diagnose(model, x)
    bn = "block._checkpoint_wrapped_module.1" if how == "checkpoint_wrapper" else "block.1"
    found = only(report, "buffers-updated-twice")
    assert found.modules == (bn,)
    assert found.numbers["advance_reference"] == 1 and found.numbers["advance_checkpointed"] == 2
    assert "advances by 2 per step instead of 1" in found.message and "remat" in found.fix
    assert report.codes() == ["buffers-updated-twice"]  # gradients are right
    site = report.checkpoints[0]
    apis = {
        "checkpoint": "utils.checkpoint.checkpoint",
        "checkpoint_sequential": "checkpoint_sequential",
        "checkpoint_wrapper": "checkpoint_wrapper",
        "composable": "_composable.checkpoint",
    }
    assert site.api.endswith(apis[how])
    if how in ("checkpoint", "checkpoint_sequential"):
        marker = {"checkpoint": "bn call", "checkpoint_sequential": "bn sequential"}[how]
        assert at(found.sites, marker), found.sites


def test_batchnorm_inside_remat_checkpoint_is_fine():
    model = TorchCheckpointed("remat")
    remat.wrap(model.block)
    assert diagnose(model, torch.randn(6, 8)).ok


# --- dropout with preserve_rng_state=False ---------------------------------------------------------------


class DropoutBlock(nn.Module):
    def __init__(self, preserve):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.5), nn.Linear(32, 16))
        self.preserve = preserve

    def forward(self, x):
        return tc.checkpoint(self.block, self.inp(x), use_reentrant=False, preserve_rng_state=self.preserve)


def test_dropout_with_preserve_rng_state_false():
    report = diagnose(DropoutBlock(preserve=False), torch.randn(8, 16))
    rng = only(report, "rng-not-preserved")
    assert rng.modules == ("block.2", "block") and rng.numbers["random_ops"] == 1
    assert "preserve_rng_state=False" in rng.message and "dropout" in rng.fix.lower()
    wrong = only(report, "wrong-gradients")
    assert set(wrong.params) <= {n for n, _ in DropoutBlock(False).named_parameters()}
    assert "block.0.weight" in wrong.params and wrong.numbers["max_rel_error"] > 1e-3
    assert "rng-not-preserved" in wrong.message
    stream = only(report, "rng-stream-changed")  # recompute drew from the global generator: later steps differ
    assert "CPU" in stream.message and "preserve_rng_state=True" in stream.fix


def test_dropout_inside_a_checkpoint_with_rng_preserved_is_fine():
    # Seed 000's user moved Dropout out of the blocks, "incompatible with checkpointing": it is not.
    assert diagnose(DropoutBlock(preserve=True), torch.randn(8, 16)).codes() == []


class SavedDropout(nn.Module):
    """A selective checkpoint that keeps a random op's output, then draws again (rrelu)."""

    def __init__(self, use_remat):
        super().__init__()
        self.inp, self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)
        self.use_remat = use_remat

    def block(self, x):
        # native_dropout is what F.dropout runs on CUDA (on CPU: bernoulli_ and mul).
        return self.b(F.rrelu(self.a(torch.native_dropout(x, 0.5, True)[0]), training=True))

    def forward(self, x):
        save = [torch.ops.aten.native_dropout.default, torch.ops.aten.addmm.default]
        if self.use_remat:
            return remat.checkpoint(self.block, self.inp(x), policy=save)
        context = functools.partial(tc.create_selective_checkpoint_contexts, save)
        return tc.checkpoint(self.block, self.inp(x), use_reentrant=False, context_fn=context)


def test_selective_checkpoint_that_saves_a_random_op():
    report = diagnose(SavedDropout(use_remat=False), torch.randn(8, 16))
    saved = only(report, "saved-random-op")
    assert saved.severity == "error" and saved.numbers["saved_random_outputs"] == 1
    assert "aten.native_dropout.default" in saved.message and "remat.checkpoint" in saved.fix
    assert "wrong-gradients" in report.codes()


def test_remat_selective_checkpoint_that_saves_a_random_op_is_fine():
    assert diagnose(SavedDropout(use_remat=True), torch.randn(8, 16)).codes() == []


# --- side effects in forward and in hooks ---------------------------------------------------------------


class Counted(nn.Module):
    def __init__(self, guarded=False):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0
        self.guarded = guarded

    def forward(self, x):
        if not (self.guarded and remat.is_recomputing()):
            self.calls += 1
        return torch.tanh(self.lin(x))


class WithCounter(nn.Module):
    def __init__(self, guarded=False):
        super().__init__()
        self.inp, self.block = nn.Linear(8, 8), Counted(guarded)

    def forward(self, x):
        return remat.checkpoint(self.block, self.inp(x))


def test_forward_with_a_counter_runs_twice():
    model = WithCounter()
    model.block.calls = 5
    report = diagnose(model, torch.randn(4, 8))
    found = only(report, "side-effects-repeated")
    assert found.modules == ("block",)
    assert found.numbers == {"calls_reference": 1, "calls_checkpointed": 2}
    assert "block.calls is 7 after the step instead of 6" in found.message
    assert "remat.is_recomputing()" in found.fix
    assert model.block.calls == 5  # restored


def test_counter_guarded_with_is_recomputing_is_fine():
    assert diagnose(WithCounter(guarded=True), torch.randn(4, 8)).ok


def test_forward_pre_hook_that_collects_inputs_runs_twice():
    model = TorchCheckpointed("checkpoint")
    model.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    seen = []
    model.block.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    report = diagnose(model, torch.randn(4, 8))
    found = only(report, "side-effects-repeated")
    assert found.modules == ("block",)
    assert "seen is list of length 2 after the step instead of list of length 1" in found.message
    assert "forward hooks" in found.message and "<lambda> run again" in found.message
    assert seen == []  # restored in place


def test_forward_hook_skipped_by_early_stopping_recompute_is_fine():
    # torch's non-reentrant recompute stops once it has what backward needs, before the
    # module returns: its forward hooks do not run again, and the doctor sees that.
    model = TorchCheckpointed("checkpoint")
    model.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    features = []
    model.block.register_forward_hook(lambda module, args, out: features.append(out))
    assert diagnose(model, torch.randn(4, 8)).ok


# --- checkpoints that do not pay, and ones that do --------------------------------------------------------


class LoneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.mid, self.b = nn.Linear(32, 256), nn.Linear(256, 256), nn.Linear(256, 32)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = remat.checkpoint(self.mid, h)  # lone linear
        return self.b(torch.relu(h))


def test_checkpointed_lone_linear_does_not_pay():
    report = diagnose(LoneLinear(), torch.randn(256, 32), measure_cost=True, warmup=0, repeat=1)
    found = only(report, "checkpoint-does-not-pay")
    assert found.modules == ("mid",) and at(found.sites, "lone linear"), found.sites
    assert found.numbers["peak_bytes_with"] == found.numbers["peak_bytes_without"]
    assert "single layer" in found.message and found.severity == "warning"
    assert report.codes() == ["checkpoint-does-not-pay"]


def _mlp(depth=4):
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 32)) for _ in range(depth)])


class TorchBlocks(nn.Module):
    """Every block but the last checkpointed with torch's non-reentrant checkpoint, as checkpoint_sequential does."""

    def __init__(self):
        super().__init__()
        self.blocks = _mlp()

    def forward(self, x):
        for block in self.blocks[:-1]:
            x = tc.checkpoint(block, x, use_reentrant=False)
        return self.blocks[-1](x)


def _remat_blocks():
    model = _mlp()
    for block in model[:-1]:
        remat.wrap(block)
    return model


@pytest.mark.parametrize("build", [_remat_blocks, TorchBlocks], ids=["remat.wrap", "torch-non-reentrant"])
def test_correct_checkpointing_that_pays_is_ok(build):
    model = build()
    report = diagnose(model, torch.randn(256, 32), measure_cost=True, warmup=0, repeat=1)
    assert report.ok, [f.message for f in report.findings]
    assert len(report.checkpoints) == 3 and report.loss_checkpointed == report.loss_reference
    assert report.checkpointed.peak_bytes < report.reference.peak_bytes


def test_checkpointing_the_last_block_too_does_not_pay():
    model = _remat_blocks()
    remat.wrap(model[3])
    report = diagnose(model, torch.randn(256, 32), measure_cost=True, warmup=0, repeat=1)
    assert [f.modules for f in report.findings] == [("3",)]  # backward starts there: nothing to free


@pytest.mark.parametrize("held", [False, True], ids=["no-grad", "held-grad"])
def test_an_input_that_requires_grad_is_left_as_it_was(held):
    model = _remat_blocks()
    x = torch.randn(256, 32, requires_grad=True)
    if held:
        x.grad = torch.randn_like(x)
    grad = x.grad
    values = None if grad is None else grad.clone()
    report = diagnose(model, x, measure_cost=True, warmup=1, repeat=1)
    assert report.ok, [f.message for f in report.findings]
    assert x.grad is grad and (grad is None or torch.equal(grad, values) and grad._version == 0)
    assert x.requires_grad and x._version == 0


def test_model_without_checkpointing_has_nothing_to_diagnose():
    report = diagnose(_mlp(2), torch.randn(4, 32), measure_cost=True)
    assert report.ok and report.checkpoints == () and report.reference is None


# --- errors ----------------------------------------------------------------------------------------------


class Raises(nn.Module):
    def __init__(self, when):
        super().__init__()
        self.inp, self.bn, self.when = nn.Linear(4, 4), nn.BatchNorm1d(4), when

    def inner(self, h):
        if self.when == "always" or torch._C._current_graph_task_id() != -1:  # "recompute": during backward
            raise ValueError("boom")
        return self.bn(h)

    def forward(self, x):
        return tc.checkpoint(self.inner, self.inp(x), use_reentrant=False)


@pytest.mark.parametrize("when, stage", [("always", "without checkpointing"), ("recompute", "it ran fine without")])
def test_model_that_raises_is_restored_and_torch_unpatched(when, stage):
    model, x = Raises(when), torch.randn(3, 4)
    before = capture(model)
    with pytest.raises(remat.RematError, match=f"raised ValueError in the step .*{stage}.*boom"):
        remat.doctor(model, x)
    assert_state_equal(before, capture(model))
    _torch_untouched()


def test_bad_options_are_remat_errors():
    with pytest.raises(remat.RematError, match="remat.doctor: need warmup >= 0 and repeat >= 1"):
        remat.doctor(nn.Linear(2, 2), torch.randn(1, 2), repeat=0)
    with pytest.raises(remat.RematError, match="model must be an nn.Module"):
        remat.doctor(lambda x: x, torch.randn(1, 2))
    with pytest.raises(remat.RematError, match="does not require grad even without checkpointing"):
        remat.doctor(nn.Linear(2, 2).requires_grad_(False), torch.randn(1, 2))


def test_the_doors_are_what_the_public_checkpoint_calls_and_a_missed_door_is_an_error(monkeypatch):
    # torch renames its private checkpoint internals (2.14 calls ..._generator_impl, not ..._generator): the
    # doctor finds them from the public function, and a door the public checkpoint does not pass through
    # (a stale name) is an error, never a report that the model does no checkpointing.
    from remat.diagnosis import _doors

    assert issubclass(getattr(tc, FUNCTION), torch.autograd.Function)
    real = getattr(tc, GENERATOR)

    def stale(*args, **kwargs):
        return (yield from real(*args, **kwargs))

    monkeypatch.setattr(tc, "_a_stale_generator", stale, raising=False)
    with pytest.raises(remat.RematError, match=r"cannot see checkpointing in torch .*non-reentrant checkpoint"):
        _doors._canary(FUNCTION, "_a_stale_generator")
    _torch_untouched()


def test_modules_torch_imports_lazily_during_the_doctor_do_not_keep_its_stand_ins():
    # In a fresh process the first checkpoint call imports torch._dynamo, which imports the
    # composable checkpoint API, which imports the non-reentrant generator by value.
    script = (
        "import sys, torch, remat, torch.utils.checkpoint as tc\n"
        "assert 'torch.distributed._composable.checkpoint_activation' not in sys.modules\n"
        "lin, x = torch.nn.Linear(2, 2), torch.randn(3, 2)\n"
        "remat.doctor(torch.nn.Sequential(lin, remat.wrap(torch.nn.Linear(2, 2))), x, measure_cost=False)\n"
        "import torch.distributed._composable.checkpoint_activation as ca\n"
        f"assert ca.{GENERATOR} is tc.{GENERATOR}\n"
    )
    proc = __import__("subprocess").run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


# --- Hugging Face layers: their own gradient checkpointing vs remat on them ------------------------------


@pytest.mark.parametrize("how", ["hf", "remat"])
def test_hugging_face_layers_are_labelled_by_the_api_that_checkpoints_them(how):
    from remat.bench._setups import _hf_prefix
    from remat.zoo import build

    zoo = build("gpt2", layers=2, hidden=32, heads=2, vocab=128, seq=16, batch=2)
    if how == "hf":  # activation_* in transformers 5.2x, gradient_* in 4.x and 5.17 (bench._setups._hf_prefix)
        getattr(zoo.model, f"{_hf_prefix(zoo.model)}_checkpointing_enable")({"use_reentrant": False})
    else:
        remat.apply(
            zoo.model, remat.plan(remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, repeat=1, warmup=0), strategy="all")
        )
    report = diagnose(zoo.model, zoo.inputs, zoo.loss_fn)
    assert len(report.checkpoints) == 2
    want = "Hugging Face gradient checkpointing" if how == "hf" else "remat.wrap"
    assert {c.api for c in report.checkpoints} == {want}, [c.api for c in report.checkpoints]
    assert report.codes() == []


def _mixtral_with_remat_plan():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        max_position_embeddings=16,
        use_cache=False,
    )
    model = tf.MixtralForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, 8))
    inputs = {"input_ids": ids, "labels": ids}
    remat.apply(model, remat.plan(remat.profile(model, inputs, repeat=1, warmup=0), strategy="all"))
    return model, inputs


def test_transformers_output_capturing_hooks_are_not_repeated_side_effects():
    # Mixtral's router logits are recorded by transformers' hooks on each layer's gate: they
    # run again in recomputation but record nothing there (NOTE [Hooks that record outputs
    # only in the outer forward]); the router's auxiliary loss is part of the compared loss.
    model, inputs = _mixtral_with_remat_plan()
    report = remat.doctor(model, inputs, measure_cost=False)
    assert [f.code for f in report.findings if f.severity == "error"] == []
    assert report.checkpoints  # remat's wrapping was seen: the step was really checkpointed


def test_a_users_recording_hook_on_the_same_model_is_still_found():
    model, inputs = _mixtral_with_remat_plan()
    seen = []
    # The router is layers.0.mlp.gate in transformers 5, layers.0.block_sparse_moe.gate in 4.x.
    name, gate = next(
        (n, m) for n, m in model.named_modules() if n.startswith("model.layers.0.") and n.endswith(".gate")
    )
    gate.register_forward_hook(lambda module, args, out: seen.append(out))
    found = only(remat.doctor(model, inputs, measure_cost=False), "side-effects-repeated")
    assert name in found.modules and "seen is list of length 2" in found.message


def test_a_checkpoint_remats_plan_needs_for_its_budget_pays_however_little_it_saves():
    # 40 alike blocks, each freeing about 2% of the step's peak: auto's plan at 0.9 checkpoints the fewest that fit,
    # so the step without any one of them is over the budget. Before, the doctor told to remove each of them.
    torch.manual_seed(0)
    model, x = _mlp(depth=40), torch.randn(128, 32)
    plan = remat.auto(model, x, budget=0.9, policies=("full",))  # the doctor weighs each checkpointed call
    assert plan.checkpointed and set(plan.checkpointed.values()) == {"full"}
    report = diagnose(model, x, measure_cost=True, warmup=0, repeat=1, min_saving=0.05)
    assert "checkpoint-does-not-pay" not in report.codes(), report.codes()
    # The same checkpoints without a plan's budget to weigh them against: each frees under 5% of the peak.
    remat.remove(model)
    for name in plan.checkpointed:
        remat.wrap(model.get_submodule(name))
    unplanned = diagnose(model, x, measure_cost=True, warmup=0, repeat=1, min_saving=0.05)
    assert unplanned.codes().count("checkpoint-does-not-pay") == len(plan.checkpointed)


class SharedBlock(nn.Module):
    """One block called four times (ALBERT's shared layer group): its checkpoint is one, whichever call frees."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(32, 512), nn.GELU(), nn.Linear(512, 32))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        for _ in range(4):
            x = x + self.block(x)
        return self.head(x)


def test_a_checkpoint_on_a_shared_block_is_weighed_over_all_its_calls():
    # Before, each call was turned off alone: one call of four freed nothing the peak saw, and the doctor told to
    # remove the checkpoint, which (all four calls) puts the step back at its peak without checkpointing.
    torch.manual_seed(0)
    model, x = SharedBlock(), torch.randn(256, 32)
    plain = remat.measure(model, x, warmup=0, repeat=1).peak_bytes
    remat.wrap(model.block)
    wrapped = remat.measure(model, x, warmup=0, repeat=1).peak_bytes
    assert wrapped < 0.7 * plain  # the checkpoint pays
    report = diagnose(model, x, measure_cost=True, warmup=0, repeat=1)
    assert "checkpoint-does-not-pay" not in report.codes(), [f.message for f in report.findings]


def test_a_checkpoint_the_budget_does_not_need_is_still_told():
    torch.manual_seed(0)
    model, x = _mlp(depth=40), torch.randn(128, 32)
    plan = remat.plan(remat.profile(model, x, warmup=0, repeat=1, policies=("full",)), budget=0.9)
    remat.apply(model, dataclasses.replace(plan, budget_bytes=10**9))  # a budget the step fits without them
    found = [f for f in diagnose(model, x, measure_cost=True, warmup=0, repeat=1, min_saving=0.05).findings]
    told = [f for f in found if f.code == "checkpoint-does-not-pay"]
    assert told and all("still within" in f.message for f in told)
    remat.remove(model)
