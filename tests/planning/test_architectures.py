"""remat.auto on transformers and diffusers architectures the family tests do not build, through
``benchmarks/architectures.py`` (imported from there: the test and the benchmark build the same models and run
the same checks).

ALBERT (its units come from the execution: one layer group called at every layer), wav2vec2 (SpecAugment draws its
masks from NumPy's generator, LayerDrop from torch's: at its floor it once got a verified nested plan whose
segments ran the layers LayerDrop skipped, NOTE [LayerDrop and nested segments]) and Whisper (encoder and decoder
stacks, audio features), and diffusers' AutoencoderKL (its loss closes over the images of the whole batch: at its
floor the reference on a slice of the batch failed, NOTE [A step that depends on the batch size]), and
torchvision's DenseNet, ViT and Faster R-CNN where torchvision is installed (the compatibility lane; Faster R-CNN
reads a draw to pick its training size, once refused as a branch on a random draw), and Llama with peft's LoRA on
every linear (its units once were the 28 wrapped projections, floor 0.639 of the peak; its attentions and MLPs
reach 0.32, NOTE [A block is refined into what it calls]), Jamba (Mamba and attention layers, experts with router
logits the loss reads in every other one: units of two kinds) and RecurrentGemma (it leaves each step's last
recurrent state on its modules, in the step's graph): at 0.8 of the peak without checkpointing and at the
floor + 1%, the plan auto applies measures within its budget, its step is bit-equal to an untouched copy's, and
``remat.remove`` leaves the parameters and the module tree as they were. The benchmark runs every architecture it
has.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import pathlib
import sys

import pytest
import torch

import remat
from remat.profiling._blocks import find_blocks

pytest.importorskip("transformers")

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "architectures.py"


def _load_benchmark():
    sys.path.insert(0, str(_BENCH.parent))  # for its _sections
    spec = importlib.util.spec_from_file_location("_remat_bench_architectures", _BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


architectures = _load_benchmark()


@pytest.mark.parametrize(
    "name",
    [
        "albert",
        "wav2vec2",
        "whisper",
        "autoencoder-kl",
        "densenet",
        "vit-torchvision",
        "fasterrcnn",
        "llama-lora",
        "jamba",
        "recurrent_gemma",
    ],
)
def test_auto_holds_its_budget_and_the_step_on_the_architecture(name, capsys):
    if name in architectures.DIFFUSERS:
        pytest.importorskip("diffusers")
    if name in architectures.TORCHVISION:
        pytest.importorskip("torchvision")
    if name in architectures.PEFT:
        pytest.importorskip("peft")
    if name == "recurrent_gemma" and int(importlib.metadata.version("transformers").split(".")[0]) < 5:
        # transformers 4's RecurrentGemma adds the previous step's recurrent state, its graph freed, when use_cache is
        # off (as checkpointing needs): its second step fails, remat's or not; remat's error says so
        with pytest.raises(remat.RematError, match="run two steps with use_cache=False"):
            architectures._architecture(name, 4)
        return
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        held = architectures._architecture(name, 4)  # 4 layers: wav2vec2 once got a nested plan that skipped no layer
    finally:
        torch.use_deterministic_algorithms(deterministic)
    rows = capsys.readouterr().out
    assert len(held) == 2 and all(held), rows
    assert "refused" not in rows.splitlines()[-1], rows  # the floor + 1% is always planned


def test_torchvisions_vit_at_its_full_fine_floor_is_exact():
    # full-fine checkpoints nn.MultiheadAttention inside each recomputed block, and the block calls it with one
    # tensor three times: handed back as three, it recomputed along its other path and torch refused the shapes.
    pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model, batch, loss_fn = architectures._build("vit-torchvision", 2)
    prof = remat.profile(model, batch, loss_fn, policies=("keep", "full", "full-fine"), repeat=1, warmup=0)
    floor = remat.plan(prof, strategy="none").min_peak_bytes
    plan = remat.plan(prof, floor)
    assert "full-fine" in plan.assignment.values(), plan.summary()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        reference = architectures._step(model, batch, loss_fn)
        remat.apply(model, plan)
        assert not architectures._differences(reference, architectures._step(model, batch, loss_fn))
        measured = remat.measure(model, batch, loss_fn, repeat=1, warmup=0).peak_bytes
    finally:
        torch.use_deterministic_algorithms(deterministic)
        remat.remove(model)
    assert measured <= plan.budget_bytes and plan.predicted_peak_bytes - measured <= 0.01 * measured


def test_lora_on_every_linear_refines_each_layer_into_attention_and_mlp():
    pytest.importorskip("peft")
    torch.manual_seed(0)
    model, _, _ = architectures._build("llama-lora", 4)
    units = [n.split("layers.")[1] for n in find_blocks(model)]
    assert units == [f"{i}.{n}" for i in range(4) for n in ("self_attn", "mlp")]


class _LoraBlock(torch.nn.Module):
    """A custom MLP block: its GELU between the two linears is the block's own code."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.l1, self.l2 = torch.nn.LayerNorm(32), torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)

    def forward(self, x):
        return x + self.l2(torch.nn.functional.gelu(self.l1(self.norm(x))))


class _LoraStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_LoraBlock() for _ in range(5))
        self.head = torch.nn.Linear(32, 32)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_auto_plans_on_the_blocks_where_their_refined_lora_linears_fall_short():
    # NOTE [Coarser units when the refined ones fall short]: five blocks were refined into their ten lora.Linear
    # wrappers, which leave each GELU outside every unit (floor 0.75), and auto refused 0.6; the blocks reach it.
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["l1", "l2"], lora_dropout=0.0)
    model, x = peft.get_peft_model(_LoraStack(), config), torch.randn(8, 64, 32)
    assert all(n.endswith((".l1", ".l2")) for n in find_blocks(model))  # the premise: refined into the linears
    twin = copy.deepcopy(model)
    plan = remat.auto(model, x, 0.6, repeat=1, warmup=0)
    try:
        assert sorted(plan.assignment) == [f"base_model.model.blocks.{i}" for i in range(5)]
        assert plan.measured_peak_bytes <= plan.budget_bytes and any("coarser units" in n for n in plan.notes)
        for net in (model, twin):
            net(x).square().mean().backward()
        for (n, a), (_, b) in zip(twin.named_parameters(), model.named_parameters()):
            assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), n
    finally:
        remat.remove(model)
