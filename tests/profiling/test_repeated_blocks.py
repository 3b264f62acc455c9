"""Alike blocks profiled once on fake tensors (``remat.profiling._repeated_blocks``): the widened profile equals
the whole model's, and anything that is not a stack of alike blocks gets the whole model's profile."""

import contextlib
import random

import pytest
import torch
from torch import nn

import remat
from remat.profiling import _repeated_blocks
from remat.zoo import build

NOTE = "NOTE [Identical blocks are profiled once]"


class _Block(nn.Module):
    def __init__(self, d, layer_idx, kind="same"):
        super().__init__()
        self.layer_idx, self.kind = layer_idx, kind
        self.norm, self.qkv, self.out = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, 2, d // 2).transpose(1, 3).unbind(2)
        x = x + self.out(nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2))
        if self.kind == "wide" or (self.kind == "by-index" and self.layer_idx % 2):
            x = x + self.mlp(x).tanh()  # another op, and another activation kept
        return x + self.mlp(x)


class _Stack(nn.Module):
    """A mask made in the parent and handed to every block, as transformers does."""

    def __init__(self, layers=8, d=16, kinds=None):
        super().__init__()
        kinds = kinds or ["same"] * layers
        self.layers = nn.ModuleList(_Block(d, i, kind) for i, kind in enumerate(kinds))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool).tril().expand(x.shape[0], 1, t, t).contiguous()
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x).logsumexp(-1).mean()


@contextlib.contextmanager
def _whole_model(monkeypatch):
    with monkeypatch.context() as m:

        @contextlib.contextmanager
        def off(*args):
            yield None

        m.setattr(_repeated_blocks, "short_stack", off)
        yield


def _calls(model):
    counts = {}
    for name, block in model.named_modules():
        if name.startswith("layers.") and name.count(".") == 1:
            block.register_forward_pre_hook(lambda m, a, name=name: counts.__setitem__(name, counts.get(name, 0) + 1))
    return counts


def _assert_same(short, whole, seed=0):
    for field in ("baseline_peak_bytes", "resting_bytes", "param_bytes", "grad_bytes", "parameters", "unchained"):
        assert getattr(short, field) == getattr(whole, field), field
    assert short.step_time_s == pytest.approx(whole.step_time_s, rel=1e-9)
    assert short.blocks == whole.blocks
    names = [b.name for b in whole.blocks]
    rng = random.Random(seed)
    for _ in range(100):
        assignment = {n: rng.choice(whole.policies) for n in names}
        assert short.predict_peak(assignment) == whole.predict_peak(assignment), assignment
    floor = remat.plan(whole, strategy="none").min_peak_bytes
    assert remat.plan(short, strategy="none").min_peak_bytes == floor
    for budget in (floor, (floor + whole.baseline_peak_bytes) // 2):
        a, b = remat.plan(short, f"{budget}B"), remat.plan(whole, f"{budget}B")
        assert (a.assignment, a.segments, a.predicted_peak_bytes) == (b.assignment, b.segments, b.predicted_peak_bytes)


def test_alike_blocks_are_profiled_once_and_the_profile_is_the_whole_models(monkeypatch):
    torch.manual_seed(0)
    model, x = _Stack(), torch.randn(2, 32, 16)
    calls = _calls(model)
    modules = list(model.layers._modules.items())
    short = remat.profile(model, x, fake=True)
    assert any(NOTE in n for n in short.notes)
    assert set(calls) == {f"layers.{k}" for k in (0, 1, 2, 3, 7)}  # the blocks left out never ran
    assert list(model.layers._modules.items()) == modules  # the container is as it was
    assert any(len(c.receivers) == 8 for c in short.crossings)  # the mask, handed to every block
    with _whole_model(monkeypatch):
        whole = remat.profile(model, x, fake=True)
    assert not any(NOTE in n for n in whole.notes) and len(calls) == 8
    _assert_same(short, whole)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_zoo_transformer_profiled_once_equals_its_whole_profile(monkeypatch, name):
    sizes = {"layers": 7, "hidden": 64, "heads": 4, "vocab": 256, "seq": 32, "batch": 2}
    with torch.device("meta"):
        zoo = build(name, **sizes, **({"intermediate": 128} if name == "llama" else {}))
    inputs = build(name, **sizes, **({"intermediate": 128} if name == "llama" else {})).inputs
    short = remat.profile(zoo.model, inputs, zoo.loss_fn, fake=True)
    assert any(NOTE in n for n in short.notes)
    with _whole_model(monkeypatch):
        whole = remat.profile(zoo.model, inputs, zoo.loss_fn, fake=True)
    _assert_same(short, whole)


@pytest.mark.parametrize(
    "kinds",
    [
        ["same"] * 5 + ["wide"] + ["same"] * 2,  # an attribute says the block differs
        ["by-index"] * 8,  # only the layer index says so: the middle blocks differ when profiled
    ],
    ids=["attribute", "layer-index"],
)
def test_blocks_that_differ_get_the_whole_models_profile(monkeypatch, kinds):
    torch.manual_seed(0)
    model, x = _Stack(kinds=kinds), torch.randn(2, 32, 16)
    prof = remat.profile(model, x, fake=True)
    assert not any(NOTE in n for n in prof.notes)
    with _whole_model(monkeypatch):
        _assert_same(prof, remat.profile(model, x, fake=True))


def test_a_forward_that_needs_every_block_gets_the_whole_models_profile():
    class Indexed(_Stack):
        def forward(self, x):
            t = x.shape[1]
            mask = torch.ones(t, t, dtype=torch.bool).tril()
            for k in range(8):
                x = self.layers[k](x, mask)
            return self.head(x).logsumexp(-1).mean()

    torch.manual_seed(0)
    model = Indexed()
    modules = list(model.layers._modules.items())
    prof = remat.profile(model, torch.randn(2, 32, 16), fake=True)
    assert len(prof.blocks) == 8 and not any(NOTE in n for n in prof.notes)
    assert list(model.layers._modules.items()) == modules


def test_a_loop_with_an_optimizer_profiles_every_block():
    torch.manual_seed(0)
    model, x = _Stack(), torch.randn(2, 32, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prof = remat.profile(model, x, fake=True, optimizer=optimizer)
    assert not any(NOTE in n for n in prof.notes)


def test_a_policy_traced_only_when_wanted_is_asked_of_the_whole_models_profile():
    # NOTE [A policy traced only when wanted]: the test sees the widened profile, all 8 blocks, not the stack of 5
    from remat.profiling._schedule import traced_only_if

    torch.manual_seed(0)
    model, x = _Stack(layers=8), torch.randn(2, 6, 16)
    policies = ("keep", "full", "full-fine")
    seen = []

    def never(prof):
        seen.append(len(prof.blocks))
        return False

    with traced_only_if("full-fine", never):
        coarse = remat.profile(model, x, fake=True, policies=policies)
    assert seen == [8] and coarse.policies == ("keep", "full")
    assert any(NOTE in note for note in coarse.notes)  # profiled on the short stack
    with traced_only_if("full-fine", lambda prof: True):
        wanted = remat.profile(model, x, fake=True, policies=policies)
    whole = remat.profile(model, x, fake=True, policies=policies)
    assert wanted.policies == whole.policies == policies
    assert wanted.segments == whole.segments and wanted.blocks == whole.blocks
    assert coarse.segments == {p: whole.segments[p] for p in coarse.policies}
