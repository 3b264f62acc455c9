"""remat.zoo: every model builds, trains, is reproducible, and checkpointing its blocks changes no bit."""

import importlib.util
import subprocess
import sys

import pytest
import torch
from conftest import assert_buffers_equal, assert_grads_equal, twin

import remat
from remat import zoo

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

# Tiny sizes: the whole file must run in seconds on 2 CPU cores.
SMALL = {
    "seed-cifar": {"batch": 8},
    "gpt2": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "batch": 2, "seq": 32},
    "gpt2-eager": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "batch": 2, "seq": 32, "attention": "eager"},
    "llama": {
        "layers": 2,
        "hidden": 64,
        "intermediate": 128,
        "heads": 4,
        "kv_heads": 2,
        "vocab": 128,
        "batch": 2,
        "seq": 32,
    },
    "vit": {
        "layers": 2,
        "hidden": 64,
        "intermediate": 128,
        "heads": 4,
        "image": 32,
        "patch": 8,
        "classes": 10,
        "batch": 2,
        "dropout": 0.1,
    },
    "resnet50": {
        "depths": (1, 2),
        "hidden_sizes": (32, 64),
        "embedding_size": 16,
        "image": 32,
        "classes": 10,
        "batch": 2,
    },
}


def _case(key):
    needs_tf = key != "seed-cifar" and not HAS_TRANSFORMERS
    return pytest.param(key, marks=pytest.mark.skipif(needs_tf, reason="transformers not installed"))


ALL = [_case(name) for name in zoo.names()]
VARIANTS = [_case(key) for key in SMALL]


def small(key):
    return zoo.build(key.removesuffix("-eager"), **SMALL[key])


def call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def train_step(model, z, seed=1):
    """Forward + loss + backward under ``seed``; returns (loss, RNG state after)."""
    torch.manual_seed(seed)
    out = call(model, z.inputs)
    loss = out.loss if z.loss_fn is None else z.loss_fn(out)
    loss.backward()
    return loss.detach(), torch.get_rng_state()


def record_block_calls(model, blocks):
    """Per block, every (submodule, recomputing?) call inside it, in order."""
    calls = {b: [] for b in blocks}
    for block in blocks:
        for name, sub in model.get_submodule(block).named_modules():
            if name:  # the block's own hooks run outside the checkpoint; its children run inside
                sub.register_forward_pre_hook(
                    lambda _m, _a, block=block, name=name: calls[block].append((name, remat.is_recomputing()))
                )
    return calls


def assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"{k} differs"
    else:
        assert torch.equal(a, b)


# --- every model builds, trains and names its blocks ------------------------------------------------


@pytest.mark.parametrize("key", VARIANTS)
def test_builds_in_training_mode_and_a_measured_step_trains_every_parameter(key):
    z = small(key)
    assert z.name == key.removesuffix("-eager")
    assert all(m.training for m in z.model.modules())
    m = remat.measure(z.model, z.inputs, z.loss_fn, warmup=0, repeat=1)
    assert m.grads_ok, m.missing_grads
    assert torch.isfinite(torch.tensor(m.loss)) and m.peak_bytes > m.resting_bytes > 0


@pytest.mark.parametrize("key", VARIANTS)
def test_blocks_exist_and_are_listed_in_execution_order(key):
    z = small(key)
    modules = dict(z.model.named_modules())
    assert z.blocks and all(b in modules for b in z.blocks), [b for b in z.blocks if b not in modules]
    order = []
    for b in z.blocks:
        modules[b].register_forward_pre_hook(lambda _m, _a, b=b: order.append(b))
    with torch.no_grad():
        call(z.model, z.inputs)
    assert order == list(z.blocks)


def test_block_counts_follow_the_options():
    if not HAS_TRANSFORMERS:
        pytest.skip("transformers not installed")
    assert small("gpt2").blocks == ("transformer.h.0", "transformer.h.1")
    assert small("llama").blocks == ("model.layers.0", "model.layers.1")
    assert small("vit").blocks in (("vit.layers.0", "vit.layers.1"), ("vit.encoder.layer.0", "vit.encoder.layer.1"))
    assert small("resnet50").blocks == (
        "resnet.encoder.stages.0.layers.0",
        "resnet.encoder.stages.1.layers.0",
        "resnet.encoder.stages.1.layers.1",
    )


@pytest.mark.parametrize("key", ["gpt2", "llama"])
def test_language_models_train_without_a_kv_cache(key):
    """A cache would be appended to again by every recompute (see NOTE [Building for training])."""
    if not HAS_TRANSFORMERS:
        pytest.skip("transformers not installed")
    z = small(key)
    out = call(z.model, z.inputs)
    assert out.past_key_values is None and out.loss.requires_grad


# --- reproducible -----------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ALL)
def test_same_seed_same_weights_and_batch_and_callers_rng_untouched(key):
    rng = torch.get_rng_state()
    a = zoo.build(key, **SMALL[key], seed=3)
    b = zoo.build(key, **SMALL[key], seed=3)
    assert torch.equal(rng, torch.get_rng_state()), "build() advanced the caller's RNG stream"
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert list(sa) == list(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert_same(a.inputs, b.inputs)
    c = zoo.build(key, **SMALL[key], seed=4)
    assert any(not torch.equal(sa[k], v) for k, v in c.model.state_dict().items() if v.is_floating_point())


# --- checkpointing every block: same bits, recompute happened ----------------------------------------


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("key", VARIANTS)
def test_wrapping_every_block_gives_bit_equal_gradients_and_buffers(key, policy):
    z = small(key)
    ref, model = z.model, twin(z.model)
    for b in z.blocks:
        remat.wrap(model.get_submodule(b), policy=policy)
    ref_calls, calls = record_block_calls(ref, z.blocks), record_block_calls(model, z.blocks)
    loss_ref, rng_ref = train_step(ref, z)
    loss, rng = train_step(model, z)
    assert torch.equal(loss_ref, loss)
    assert torch.equal(rng_ref, rng), "global RNG stream after the step differs"
    assert_grads_equal(ref, model)
    assert_buffers_equal(ref, model)
    for b in z.blocks:
        forward = [name for name, again in calls[b] if not again]
        recompute = [name for name, again in calls[b] if again]
        assert forward == [name for name, _ in ref_calls[b]], f"{b}: forward ran differently"
        # Rerun from the block's start; torch stops once backward has every tensor it needs.
        assert recompute and recompute == forward[: len(recompute)], f"{b}: not recomputed"


# --- errors -----------------------------------------------------------------------------------------


def test_unknown_name_lists_the_known_names():
    with pytest.raises(
        remat.RematError, match="unknown model 'gpt3'; known models: gpt2, llama, resnet50, seed-cifar, vit"
    ):
        zoo.build("gpt3")


def test_options_list_each_models_defaults():
    assert zoo.options("gpt2")["layers"] == 6 and zoo.options("gpt2")["hidden"] == 512
    assert zoo.options("llama")["kv_heads"] == 4 and zoo.options("seed-cifar")["batch"] == 256
    assert all({"batch", "seed"} <= set(zoo.options(n)) for n in zoo.names())
    with pytest.raises(remat.RematError, match="unknown model 'bert'"):
        zoo.options("bert")


def test_unknown_option_lists_the_accepted_ones():
    with pytest.raises(remat.RematError, match=r"bad options for 'gpt2': width; 'gpt2' accepts layers, hidden"):
        zoo.build("gpt2", width=64)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("gpt2", {"hidden": 100, "heads": 8}, r"hidden=100 is not a multiple of heads=8; choose e.g. hidden=104"),
        ("llama", {"heads": 8, "kv_heads": 3}, r"heads=8 is not a multiple of kv_heads=3"),
        ("vit", {"image": 100, "patch": 16}, r"image=100 is not a multiple of patch=16"),
        ("gpt2", {"batch": 0}, r"batch=0 is not a positive integer"),
        ("llama", {"seq": 1}, r"seq=1 leaves no next token to predict"),
        ("gpt2", {"dropout": 1.0}, r"dropout=1.0 is outside \[0, 1\)"),
        ("llama", {"attention": "flash_attention_2"}, r"attention='flash_attention_2' is not supported"),
        ("resnet50", {"depths": (1, 1)}, r"depths has 2 stages and hidden_sizes 4"),
        ("vit", {"classes": 1}, r"classes=1 leaves nothing to classify"),
    ],
)
def test_bad_values_are_rejected_before_building(name, options, message):
    with pytest.raises(remat.RematError, match=rf"remat.zoo.build\('{name}'\): {message}"):
        zoo.build(name, **options)


def test_import_remat_does_not_import_transformers():
    code = "import sys, remat, remat.zoo; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_seed_cifars_loss_runs_on_the_device_its_model_and_images_were_moved_to():
    # its labels live in its loss function: moving the model and the images to the GPU left them behind
    built = zoo.build("seed-cifar", batch=2)
    logits = built.model(built.inputs).to("meta")
    assert built.loss_fn(logits).device.type == "meta"
