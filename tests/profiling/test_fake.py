"""Profiling on fake tensors: same memory as a real profile, no allocation, any size."""

import dataclasses
import importlib.util
import itertools
import json

import pytest
import torch
from conftest import Interruptible, UntouchedByCtrlC
from torch import nn

import remat
from remat.profiling import _fake, targets
from remat.profiling.targets import TARGETS, Target, calibrate_cpu, get_target
from remat.zoo import build


class TinyTransformer(nn.Module):
    """Attention + MLP blocks without data-dependent control flow."""

    def __init__(self, layers=3, width=64, heads=4, vocab=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True) for _ in range(layers)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x).logsumexp(-1).mean()


def _compare(model, inputs, loss_fn=None):
    real = remat.profile(model, inputs, loss_fn, repeat=1, warmup=0)
    fake = remat.profile(model, inputs, loss_fn, fake=True, target="cpu")  # CPU kernels, as the real run
    names = [b.name for b in real.blocks]
    for assignment in ({}, {n: "full" for n in names}, {names[0]: "selective", names[-1]: "full"}):
        r, f = real.predict_peak(assignment), fake.predict_peak(assignment)
        assert abs(r - f) <= 0.01 * r, (assignment, r, f)
    assert fake.fake and fake.target == "cpu" and fake.resting_bytes == real.resting_bytes
    return real, fake


def test_fake_profile_memory_equals_real_seed_cnn():
    zoo = build("seed-cifar", batch=8)
    _compare(zoo.model, zoo.inputs, zoo.loss_fn)


def test_fake_profile_memory_equals_real_transformer():
    torch.manual_seed(0)
    _, fake = _compare(TinyTransformer(), torch.randint(0, 256, (2, 32)))
    assert all(b.fwd_flops > 0 and b.extra_time_s["full"] > 0 for b in fake.blocks)


def test_fake_profile_leaves_the_model_alone():
    zoo = build("seed-cifar", batch=4)
    params = {n: p for n, p in zoo.model.named_parameters()}
    values = {n: p.detach().clone() for n, p in params.items()}
    rng = torch.get_rng_state()
    remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, fake=True, target="a100")
    for n, p in zoo.model.named_parameters():
        assert p is params[n] and torch.equal(p, values[n]) and p.grad is None
    assert torch.equal(rng, torch.get_rng_state())


@pytest.mark.parametrize("swap, step", [(3, None), (None, 0)])  # while the fake twins go in, in a fake step
def test_ctrl_c_in_a_fake_profile_leaves_everything_as_it_was(monkeypatch, swap, step):
    model, x = Interruptible(step), torch.randn(4, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.zero_grad()
    optimizer.step()  # a state to swap out and back
    untouched = UntouchedByCtrlC(model, optimizer)
    params = dict(model.named_parameters())
    calls, fake_like = itertools.count(), _fake.fake_like

    def interrupted(mode, t):
        if next(calls) == swap:
            raise KeyboardInterrupt
        return fake_like(mode, t)

    monkeypatch.setattr(_fake, "fake_like", interrupted)
    untouched.check(
        lambda: remat.profile(model, x, blocks=["blocks.0", "blocks.2"], optimizer=optimizer, fake=True, target="a100")
    )
    assert all(p is params[n] for n, p in model.named_parameters())
    assert all(p is q for p, q in zip(optimizer.param_groups[0]["params"], params.values(), strict=True))


def test_llama_7b_shape_profiles_without_allocating():
    """Llama-2-7B shape (32 layers, hidden 4096, seq 4096), built on the meta device."""
    tf = pytest.importorskip("transformers")
    config = tf.LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
        use_cache=False,
    )
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(config)
    ids = torch.randint(0, 32000, (1, 4096))
    prof = remat.profile(model, {"input_ids": ids, "labels": ids}, fake=True, target="h100")
    assert len(prof.blocks) == 32
    params = sum(p.numel() for p in model.parameters())
    assert prof.param_bytes == 4 * params and params > 6.7e9
    plan = remat.plan(prof, "60GB")
    assert plan.predicted_peak_bytes <= 60e9 < prof.baseline_peak_bytes
    assert all(p.is_meta for p in model.parameters())


def test_targets():
    assert get_target("H100") is TARGETS["h100"]
    with pytest.raises(remat.RematError, match="unknown target"):
        get_target("tpu")
    cpu = calibrate_cpu()
    assert cpu.matmul_flops["float32"] > 1e8 and cpu.bytes_per_s > 1e8
    with pytest.raises(remat.RematError, match="only applies to fake=True"):
        zoo = build("seed-cifar", batch=2)
        remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, target="h100")


def test_a_fake_profile_is_the_same_recomputation_for_recomputation_every_time():
    # a storage's key is its address: what a recomputation rebuilt is told by the allocation clock, not by keys
    # taken before it, which an address reused during it would hide
    runs = []
    for _ in range(2):
        with torch.device("meta"):
            zoo = build("gpt2")
        prof = remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, fake=True)
        runs.append([r.to_json() for r in prof.recomputes])
    assert runs[0] == runs[1] and any(r["freed_after"] for r in runs[0])


class _MaskedBlock(nn.Module):
    """A block that reads a small buffer (a causal mask, as transformers 4.x GPT-2 registers) and, with
    ``norm``, writes one (batch-norm running statistics, without bumping their version)."""

    def __init__(self, width=32, seq=16, norm=False):
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)), persistent=False)
        self.proj = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(seq) if norm else nn.Identity()

    def forward(self, x):
        scores = torch.where(self.mask, x @ x.transpose(-1, -2), -1e4).softmax(-1)
        return self.norm(torch.tanh(self.proj(scores @ x)))


@pytest.mark.parametrize("norm", [False, True], ids=["read-only-buffer", "batch-norm"])
def test_a_later_checkpointed_call_keeps_only_the_buffers_it_writes_on_fake_tensors(norm):
    # The first checkpointed call learns which buffers a block writes; later ones copy small buffers and drop
    # the copies whose values did not change. Fake tensors have no values: a read-only mask's copy was kept,
    # so `full` blocks were predicted 4100 B high on transformers 4.x GPT-2, and only when a selective step
    # was traced before the full one.
    torch.manual_seed(0)
    model = nn.Sequential(*(_MaskedBlock(norm=norm) for _ in range(3)))
    inputs = torch.randn(4, 16, 32)
    policies = ("keep", "selective", "full")
    real = remat.profile(model, inputs, lambda out: out.square().mean(), policies=policies, repeat=1, warmup=0)
    fake = remat.profile(model, inputs, lambda out: out.square().mean(), policies=policies, fake=True, target="cpu")
    for r, f in zip(real.blocks, fake.blocks, strict=True):
        assert f.saved_bytes == r.saved_bytes, (r.name, r.saved_bytes, f.saved_bytes)
    if norm:  # the running statistics are written: their copies are kept on both
        assert real.blocks[1].saved_bytes["full"] > 0


class _Scores(nn.Module):
    """Attention-like scores plus a bias, in place (the cached ``bmm`` output is written: NOTE [Cached outputs
    written in place] in remat.core._contexts) or not."""

    def __init__(self, in_place: bool):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        self.in_place = in_place

    def forward(self, x):
        scores = torch.matmul(self.q(x), self.k(x).transpose(-1, -2))
        bias = torch.linspace(0.0, 1.0, scores.shape[-1])
        if self.in_place:
            scores += bias
        else:
            scores = scores + bias
        return x + torch.softmax(scores, -1) @ self.v(x)


def test_the_cpu_calibration_takes_the_fastest_run(monkeypatch):
    # NOTE [The CPU is calibrated on its fastest runs]: a run slowed by another process does not lower it
    runs = [5.0, 1.0, 5.0, 5.0, 5.0, 4.0, 5.0, 5.0, 5.0]  # seconds per run: the second ran undisturbed
    clock = iter([t for i, s in enumerate(runs) for t in (10.0 * i, 10.0 * i + s)])
    monkeypatch.setattr(targets.time, "perf_counter", lambda: next(clock))
    assert targets._fastest_seconds(lambda: None, repeat=len(runs)) == 1.0


def _fixed_cpu(monkeypatch, tmp_path):
    """``target="cpu"`` as a machine with these numbers, whatever this one measures."""
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    fixed = Target("cpu", {"float32": 80e9, "bfloat16": 40e9, "float16": 40e9}, 25e9, 24 * 2**30, 1.0)
    targets._cache_path().write_text(json.dumps(dataclasses.asdict(fixed)))


def test_a_fake_profile_charges_selective_for_recomputing_a_kept_output_written_in_place(monkeypatch, tmp_path):
    _fixed_cpu(monkeypatch, tmp_path)  # which op weighs is the claim, not this machine's calibration
    extra = {}
    for in_place in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*(_Scores(in_place) for _ in range(3)))
        prof = remat.profile(model, torch.randn(4, 256, 64), fake=True, target="cpu")  # where the bmm weighs
        block = prof.blocks[1]
        extra[in_place] = block.extra_time_s["selective-ops"], block.extra_time_s["full"]
    (ops_out, full_out), (ops_in, full_in) = extra[False], extra[True]
    # The written scores are recomputed: the bmm of 4 x 256 x 256 x 64, besides what selective recomputes anyway.
    assert ops_in > ops_out * 1.2
    assert ops_in <= full_in * 1.0001 and full_in == pytest.approx(full_out, rel=0.05)


def _exact(model, inputs, loss_fn=None):
    """Fake and real profiles predict every one-block assignment to the byte."""
    real = remat.profile(model, inputs, loss_fn, repeat=1, warmup=0)
    fake = remat.profile(model, inputs, loss_fn, fake=True, target="cpu")
    assert fake.resting_bytes == real.resting_bytes
    for name, policy in itertools.product([b.name for b in real.blocks], real.policies):
        assert fake.predict_peak({name: policy}) == real.predict_peak({name: policy}), (name, policy)


def test_inputs_sharing_a_storage_share_one_fake_storage():
    # labels=input_ids, as Hugging Face's causal LM recipes pass them: counted once, as on the device
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 32))
    model = TinyTransformer()
    _exact(model, {"ids": ids}, None)
    _exact(_TakesLabels(model), {"ids": ids, "labels": ids})
    _exact(_TakesLabels(model), {"ids": ids[:, :16], "labels": ids[:, 16:]})  # views of one batch


def test_fake_inputs_twin_storages_gradients_and_views_as_a_step_counts_them():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from remat.profiling._shadow import ValueShadows

    leaf = torch.randn(4, 8, requires_grad=True)
    leaf.grad = torch.ones(4, 8)
    batch = torch.arange(12.0)
    inputs = {"x": leaf, "a": batch[:6], "b": batch[6:], "y": leaf * 2, "n": 3}
    for step in (False, True):
        fakes = _fake.fake_inputs(FakeTensorMode(allow_non_fake_inputs=True), ValueShadows(), inputs, step=step)
        assert fakes["n"] == 3 and all(isinstance(fakes[k], FakeTensor) for k in "xaby")
        assert fakes["a"].untyped_storage()._cdata == fakes["b"].untyped_storage()._cdata  # one batch, one storage
        assert fakes["a"].untyped_storage().nbytes() == batch.untyped_storage().nbytes()
        assert fakes["x"].requires_grad and (fakes["x"].grad is not None) == step
        assert fakes["y"].is_leaf != step  # in a step a non-leaf input stays one: its gradient is used and freed


class _TakesLabels(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(ids) + 0 * labels.sum()


def test_a_float32_mixture_of_experts_profiles_on_fake_tensors_as_on_real_ones():
    # NOTE [Grouped matmuls in float32]: transformers 5 runs the experts with torch._grouped_mm, whose meta
    # kernel refused float32 ("Expected inputs of BF16 type") while the CPU kernel runs it
    transformers = pytest.importorskip("transformers")
    if importlib.util.find_spec("transformers.integrations.moe") is None:
        pytest.skip("this transformers loops over the experts (4.x): see the nonzero test below")
    config = transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    ids = torch.randint(0, 256, (2, 32))
    _exact(model, {"input_ids": ids, "labels": ids})


class _PicksTokens(nn.Module):
    """A router in the style of transformers 4.x's mixture of experts: each expert takes the tokens routed to it."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(16, 2)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2))

    def forward(self, x):
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            (rows,) = torch.where(choice == i)
            out = out.index_add(0, rows, expert(x[rows]))
        return out.square().mean()


def test_an_output_sized_by_values_is_refused_with_where_it_is_made():
    model = _PicksTokens()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(remat.RematError, match=r"size depends on tensor values .*at test_fake\.py:\d+ \(forward\)"):
        remat.profile(model, torch.randn(64, 16), fake=True, target="cpu", blocks=["experts.0", "experts.1"])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    real = remat.profile(model, torch.randn(64, 16), blocks=["experts.0", "experts.1"], repeat=1, warmup=0)
    assert real.baseline_peak_bytes > 0
