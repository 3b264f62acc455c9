"""remat.auto across transformers, diffusers and torchvision architectures: the budget held, the step bit for bit.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/architectures.py            # every architecture
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/architectures.py llama t5   # some
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/architectures.py --write    # into BENCHMARKS.md

Each architecture is built from a tiny config with random weights (nothing is downloaded) with ``--layers`` layers,
in training mode (dropout as its config sets it), fed a batch with labels so that ``output.loss`` is the loss
(diffusers models: the mean squared error of ``output.sample`` from a fixed target of the whole batch, as a
denoising or reconstruction loss is; torchvision models, where it is installed: the cross-entropy of the logits
with fixed labels; ``llama-lora`` is Llama with peft's LoRA on every linear); remat finds the blocks
(``blocks=None``). One profile gives the peak without checkpointing and the lowest peak any plan reaches (the
floor); then ``remat.auto`` (verify on) at 0.8 of that peak and at the floor + 1%. Per budget: the plan's policies
and nested segments, predicted and measured peaks (``remat.measure``), and whether the step with the plan (loss,
every gradient, every buffer) equals a step of an untouched copy of the model (``use_cache`` off, as
``remat.apply`` sets it), compared here with ``torch.equal`` (torch's, NumPy's and Python's generators seeded
alike: wav2vec2 masks with NumPy); then ``remat.remove`` must leave the parameters and the module tree as they
were. A refusal (a budget below the floor) is a row too, with auto's reason.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
import random
import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import _sections
import numpy as np
import torch
from torch import nn

import remat
from remat.core._hf import disable_cache

BATCH, SEQ, VOCAB = 4, 128, 256
Built = tuple[nn.Module, dict[str, Any]]
Loss = Callable[[Any], torch.Tensor] | None
"""A builder's loss of the model's output; None: ``output.loss`` (transformers models given labels)."""


def _ids(seed: int = 1, vocab: int = VOCAB, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, seq), generator=torch.Generator().manual_seed(seed))


def _config(kind: str, layers: int, **kw: Any) -> Any:
    import transformers

    small = dict(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    return transformers.AutoConfig.for_model(kind, **{**small, **kw})


def _causal_lm(kind: str, **kw: Any) -> Callable[[int], Built]:
    def build(layers: int) -> Built:
        import transformers

        model = transformers.AutoModelForCausalLM.from_config(_config(kind, layers, **kw))
        ids = _ids()
        return model, {"input_ids": ids, "labels": ids}

    return build


def _classifier(kind: str, **kw: Any) -> Callable[[int], Built]:
    def build(layers: int) -> Built:
        import transformers

        model = transformers.AutoModelForSequenceClassification.from_config(_config(kind, layers, num_labels=3, **kw))
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[BATCH // 2 :, SEQ - 8 :] = 0  # padding in half the batch
        return model, {"input_ids": _ids(), "attention_mask": mask, "labels": torch.arange(BATCH) % 3}

    return build


def _seq2seq(kind: str, **kw: Any) -> Callable[[int], Built]:
    def build(layers: int) -> Built:
        import transformers

        model = transformers.AutoModelForSeq2SeqLM.from_config(_config(kind, layers, **kw))
        ids = _ids()
        return model, {"input_ids": ids, "labels": ids[:, : SEQ // 8].contiguous()}

    return build


def _image(kind: str, size: int = 32, **kw: Any) -> Callable[[int], Built]:
    def build(layers: int) -> Built:
        import transformers

        config = transformers.AutoConfig.for_model(kind, num_labels=3, **kw)
        if hasattr(config, "num_hidden_layers") and "depths" not in kw:
            config.num_hidden_layers = layers
        model = transformers.AutoModelForImageClassification.from_config(config)
        pixels = torch.randn(BATCH, 3, size, size, generator=torch.Generator().manual_seed(2))
        return model, {"pixel_values": pixels, "labels": torch.arange(BATCH) % 3}

    return build


def _whisper(layers: int) -> Built:
    import transformers

    config = transformers.WhisperConfig(
        d_model=64,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_mel_bins=16,
        max_source_positions=32,
        vocab_size=VOCAB,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    features = torch.randn(BATCH, 16, 64, generator=torch.Generator().manual_seed(3))
    return transformers.WhisperForConditionalGeneration(config), {"input_features": features, "labels": _ids(seq=12)}


def _wav2vec2(layers: int) -> Built:
    import transformers

    config = transformers.Wav2Vec2Config(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=32,
        conv_dim=(32, 32, 32),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        ctc_loss_reduction="mean",
        pad_token_id=0,
    )
    wave = torch.randn(BATCH, 4000, generator=torch.Generator().manual_seed(4))
    labels = torch.randint(1, 32, (BATCH, 10), generator=torch.Generator().manual_seed(5))
    return transformers.Wav2Vec2ForCTC(config), {"input_values": wave, "labels": labels}


# diffusers models return ``output.sample``: the loss is its mean squared error from a fixed target, as a
# denoising step's is. Sizes are tiny; ``layers`` sets the transformers' depth (the U-Nets' is their config's).
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mse_from(target: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    return lambda output: (output.sample.float() - target).square().mean()


_STEPS = torch.tensor([3, 7, 11, 500])


def _unet2d_condition(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
    import diffusers

    model = diffusers.UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=2,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        norm_num_groups=8,
        attention_head_dim=8,
    )
    batch = {
        "sample": torch.randn(BATCH, 4, 16, 16, generator=_gen(1)),
        "timestep": _STEPS,
        "encoder_hidden_states": torch.randn(BATCH, 8, 32, generator=_gen(2)),
    }
    return model, batch, _mse_from(torch.randn(BATCH, 4, 16, 16, generator=_gen(3)))


def _unet2d(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
    import diffusers

    model = diffusers.UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        layers_per_block=2,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
        attention_head_dim=8,
        dropout=0.1,
    )
    batch = {"sample": torch.randn(BATCH, 3, 16, 16, generator=_gen(1)), "timestep": _STEPS}
    return model, batch, _mse_from(torch.randn(BATCH, 3, 16, 16, generator=_gen(3)))


def _autoencoder_kl(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
    import diffusers

    model = diffusers.AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(32, 64),
        layers_per_block=2,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
    )
    images = torch.randn(BATCH, 3, 32, 32, generator=_gen(1))
    return model, {"sample": images}, _mse_from(images)


def _dit(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
    import diffusers

    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        num_layers=layers,
        sample_size=16,
        patch_size=2,
        num_embeds_ada_norm=1000,
        dropout=0.1,
    )
    batch = {
        "hidden_states": torch.randn(BATCH, 4, 16, 16, generator=_gen(1)),
        "timestep": _STEPS,
        "class_labels": torch.tensor([1, 2, 3, 4]),
    }
    return model, batch, _mse_from(torch.randn(BATCH, 4, 16, 16, generator=_gen(3)))


def _pixart(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
    import diffusers

    model = diffusers.PixArtTransformer2DModel(
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,
        num_layers=layers,
        cross_attention_dim=64,
        sample_size=16,
        patch_size=2,
        caption_channels=32,
        dropout=0.1,
    )
    batch = {
        "hidden_states": torch.randn(BATCH, 4, 16, 16, generator=_gen(1)),
        "encoder_hidden_states": torch.randn(BATCH, 8, 32, generator=_gen(2)),
        "timestep": _STEPS,
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
    }
    return model, batch, _mse_from(torch.randn(BATCH, 8, 16, 16, generator=_gen(3)))


def _sd3(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
    import diffusers

    model = diffusers.SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_layers=layers,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        caption_projection_dim=64,
        pooled_projection_dim=32,
        out_channels=4,
        pos_embed_max_size=32,
    )
    batch = {
        "hidden_states": torch.randn(BATCH, 4, 16, 16, generator=_gen(1)),
        "encoder_hidden_states": torch.randn(BATCH, 8, 32, generator=_gen(2)),
        "pooled_projections": torch.randn(BATCH, 32, generator=_gen(4)),
        "timestep": _STEPS,
    }
    return model, batch, _mse_from(torch.randn(BATCH, 4, 16, 16, generator=_gen(3)))


def _flux(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
    import diffusers

    model = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=layers // 2,
        num_single_layers=layers - layers // 2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    )
    image, text = 64, 8
    batch = {
        "hidden_states": torch.randn(BATCH, image, 16, generator=_gen(1)),
        "encoder_hidden_states": torch.randn(BATCH, text, 32, generator=_gen(2)),
        "pooled_projections": torch.randn(BATCH, 32, generator=_gen(4)),
        "timestep": torch.tensor([0.1, 0.3, 0.5, 0.9]),
        "img_ids": torch.zeros(image, 3),
        "txt_ids": torch.zeros(text, 3),
    }
    return model, batch, _mse_from(torch.randn(BATCH, image, 16, generator=_gen(3)))


_KV = {"num_key_value_heads": 2}


def _lora(layers: int) -> Built:
    # LoRA on every linear ("all-linear", the QLoRA recipe) with adapter dropout: the base frozen, each layer's
    # 7 projections wrapped (NOTE [A block is refined into what it calls] in remat.profiling._blocks).
    import peft

    model, batch = _causal_lm("llama", **_KV)(layers)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.1)
    return peft.get_peft_model(model, config), batch


# torchvision models (in the compatibility lane's venv): images and class labels, the loss their cross-entropy.
# DenseNet hands each layer the list of every earlier output and appends to it after the call (NOTE [Arguments as
# the call saw them] in remat.core._arguments); ViT's nn.MultiheadAttention is called with one tensor three times.
_LABELS = torch.randint(0, 10, (BATCH,), generator=torch.Generator().manual_seed(6))


def _torchvision(make: Callable[[int], nn.Module]) -> Callable[[int], tuple[nn.Module, dict[str, Any], Loss]]:
    def build(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
        images = torch.randn(BATCH, 3, 32, 32, generator=_gen(7))
        return make(layers), {"x": images}, lambda logits: nn.functional.cross_entropy(logits, _LABELS)

    return build


def _densenet(layers: int) -> nn.Module:
    import torchvision

    config = {"growth_rate": 8, "block_config": (layers, layers), "num_init_features": 16, "bn_size": 2}
    return torchvision.models.DenseNet(**config, drop_rate=0.1, num_classes=10)


def _vit_torchvision(layers: int) -> nn.Module:
    import torchvision

    size = {"image_size": 32, "patch_size": 8, "hidden_dim": 64, "mlp_dim": 128, "num_heads": 4}
    return torchvision.models.VisionTransformer(**size, num_layers=layers, dropout=0.1, num_classes=10)


def _fasterrcnn(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
    """Faster R-CNN (MobileNetV3 and FPN) in training: images and boxes in, a dict of losses out. Its transform
    reads a draw to pick a training size (NOTE [Branches on random draws]) and its samplers draw ``randperm``."""
    import torchvision

    detection = torchvision.models.detection
    model = detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=5, min_size=96, max_size=96
    )
    images = list(torch.rand(2, 3, 96, 96, generator=_gen(8)))
    boxes = torch.tensor([[10.0, 20.0, 60.0, 90.0], [30.0, 30.0, 80.0, 85.0]])
    targets = [{"boxes": boxes, "labels": torch.tensor([1, 3])} for _ in images]
    return model, {"images": images, "targets": targets}, lambda losses: sum(losses.values())


ARCHITECTURES: dict[str, Callable[[int], Built | tuple[nn.Module, dict[str, Any], Loss]]] = {
    "gpt2": lambda n: _causal_lm("gpt2", n_embd=64, n_layer=n, n_head=4, n_positions=SEQ)(n),
    "llama": _causal_lm("llama", **_KV),
    "llama-lora": _lora,
    "mistral": _causal_lm("mistral", **_KV, sliding_window=16),
    "qwen2": _causal_lm("qwen2", **_KV),
    "qwen3": _causal_lm("qwen3", **_KV, head_dim=16),
    "gemma2": _causal_lm("gemma2", **_KV, head_dim=16),
    "phi3": _causal_lm("phi3", **_KV, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gpt_neox": _causal_lm("gpt_neox"),
    "bloom": lambda n: _causal_lm("bloom", n_layer=n, n_head=4)(n),
    "opt": _causal_lm("opt", ffn_dim=128, word_embed_proj_dim=64),
    "falcon": _causal_lm("falcon", new_decoder_architecture=False),
    "mixtral": _causal_lm("mixtral", **_KV, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True),
    "qwen2_moe": _causal_lm(
        "qwen2_moe",
        **_KV,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        output_router_logits=True,
    ),
    "bert": _classifier("bert"),
    "roberta": _classifier("roberta", pad_token_id=1, max_position_embeddings=SEQ + 2),
    "deberta-v2": _classifier("deberta-v2"),
    "distilbert": lambda n: _classifier("distilbert", dim=64, n_layers=n, n_heads=4, hidden_dim=128)(n),
    "electra": _classifier("electra", embedding_size=32),
    "albert": _classifier("albert", embedding_size=32),
    "t5": lambda n: _seq2seq(
        "t5", d_model=64, d_kv=16, d_ff=128, num_layers=n, num_decoder_layers=n, num_heads=4, decoder_start_token_id=0
    )(n),
    "bart": lambda n: _seq2seq(
        "bart",
        d_model=64,
        encoder_layers=n,
        decoder_layers=n,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
    )(n),
    "whisper": _whisper,
    "wav2vec2": _wav2vec2,
    "vit": _image("vit", hidden_size=64, num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=8),
    "dinov2": _image("dinov2", hidden_size=64, num_attention_heads=4, image_size=32, patch_size=8),
    "swin": _image("swin", embed_dim=16, depths=[2, 2], num_heads=[2, 4], image_size=32, patch_size=4, window_size=4),
    "convnext": _image("convnext", size=96, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1]),
    "resnet": _image("resnet", size=96, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], embedding_size=16),
    "unet2d-condition": _unet2d_condition,
    "unet2d": _unet2d,
    "autoencoder-kl": _autoencoder_kl,
    "dit": _dit,
    "pixart": _pixart,
    "sd3": _sd3,
    "flux": _flux,
    "densenet": _torchvision(_densenet),
    "vit-torchvision": _torchvision(_vit_torchvision),
    "fasterrcnn": _fasterrcnn,
}


DIFFUSERS = ("unet2d-condition", "unet2d", "autoencoder-kl", "dit", "pixart", "sd3", "flux")
TORCHVISION = ("densenet", "vit-torchvision", "fasterrcnn")
PEFT = ("llama-lora",)


def _build(name: str, layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
    built = ARCHITECTURES[name](layers)
    return built if len(built) == 3 else (*built, None)


def _step(model: nn.Module, batch: dict[str, Any], loss_fn: Loss, seed: int = 7) -> tuple[torch.Tensor, dict, dict]:
    """Loss, gradients and buffers after one step from the same generator states."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model.zero_grad(set_to_none=True)
    output = model(**batch)
    loss = output.loss if loss_fn is None else loss_fn(output)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, {n: b.clone() for n, b in model.named_buffers()}


def _cache_off(model: nn.Module) -> nn.Module:
    """``model`` with ``use_cache`` off on every config, nested ones too, as ``remat.apply`` sets it: with
    transformers 4.57 that alone changes the rounding of a Llama's gradients (docs/planning.md)."""
    disable_cache(model)
    return model


def _differences(ref: tuple, got: tuple) -> list[str]:
    (loss, grads, bufs), (loss2, grads2, bufs2) = ref, got
    out = [] if torch.equal(loss, loss2) else ["loss"]
    out += ["gradient names"] if grads.keys() != grads2.keys() else []
    out += [n for n in grads.keys() & grads2.keys() if not torch.equal(grads[n], grads2[n])]
    return out + [n for n in bufs if n in bufs2 and not torch.equal(bufs[n], bufs2[n])]


def _plan_cell(plan: remat.Plan) -> str:
    counts = Counter(plan.assignment.values())
    text = ", ".join(f"{n} {p}" for p, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return text + (f"; {len(plan.segments)} nested segment(s)" if plan.segments else "")


def _row(name: str, built: tuple[nn.Module, dict, Loss], fraction: float, base: int, floor: int) -> tuple[str, bool]:
    """One budget's row (its table line, whether every check held); the model is left without a plan."""
    model, batch, loss_fn = built
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state, tree = copy.deepcopy(model.state_dict()), str(model)  # with its metadata (torchvision's versions)
    reference = _step(_cache_off(copy.deepcopy(model)), batch, loss_fn)
    start = time.perf_counter()
    try:
        plan = remat.auto(model, batch, fraction, loss_fn=loss_fn, repeat=1, warmup=0)
    except remat.RematError as err:
        below = "below the lowest peak" in str(err)
        reason = f"below the floor, {floor / base:.3f}" if below else str(err)[:120].replace("|", "/")
        return f"| {name} | {fraction:.3f} | refused: {reason} | | | | |", below
    seconds = time.perf_counter() - start
    measured = remat.measure(model, batch, loss_fn, repeat=1, warmup=0).peak_bytes
    differs = _differences(reference, _step(model, batch, loss_fn))
    remat.remove(model)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, params[n])]
    restored = not moved and str(model) == tree
    model.load_state_dict(state)  # the steps moved BatchNorm statistics on: the next budget starts alike
    within = measured <= plan.budget_bytes
    equal = "yes" if not differs else f"no: {', '.join(differs[:3])}"
    line = (
        f"| {name} | {fraction:.3f} | {_plan_cell(plan)} | {plan.predicted_peak_bytes / base:.3f} | "
        f"{measured / base:.3f} {'≤' if within else '>'} budget | {equal} | {'yes' if restored else 'no'} "
        f"({seconds:.0f} s) |"
    )
    return line, within and not differs and restored


def _architecture(name: str, layers: int) -> list[bool]:
    needs = "torchvision" if name in TORCHVISION else "peft" if name in PEFT else None
    return budgets_held(name, lambda: _build(name, layers), needs=needs)


def budgets_held(name: str, build: Callable[[], tuple[nn.Module, dict, Loss]], *, needs: str | None) -> list[bool]:
    """Print the model's rows (its peak, then auto at 0.8 and at the floor + 1%); whether each budget held. A model
    whose package ``needs`` is not installed is one row saying so."""
    if needs is not None and importlib.util.find_spec(needs) is None:
        print(f"| {name} | | not run: {needs} is not installed | | | | |")
        return []
    torch.manual_seed(0)
    built = build()
    model, batch, loss_fn = built
    model.train()
    prof = remat.profile(model, batch, loss_fn, repeat=1, warmup=0)
    base = prof.baseline_peak_bytes
    floor = remat.plan(prof, strategy="none").min_peak_bytes
    units = f"{len(prof.blocks)} unit{'s' if len(prof.blocks) > 1 else ''}"
    print(f"| {name} ({units}) | 1.000 | peak without checkpointing {base / 2**20:.1f} MiB | | | | |")
    held = []
    for fraction in (0.8, min((floor * 1.01 + 1) / base, 1.0)):
        line, ok = _row(name, built, fraction, base, floor)
        print(line, flush=True)
        held.append(ok)
    return held


def prepared(parser: argparse.ArgumentParser, names: list[str], known: list[str], kind: str) -> list[str]:
    """The names to run (all of ``known`` when none is given), with the libraries' notes silenced and torch
    deterministic; an unknown name is the parser's error."""
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"no {kind} {', '.join(unknown)}; choose from {', '.join(known)}")
    warnings.simplefilter("ignore")  # transformers' notes on tiny configs
    logging.disable(logging.WARNING)
    torch.use_deterministic_algorithms(True)
    return names or known


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"architectures (default: all of {', '.join(ARCHITECTURES)})")
    parser.add_argument("--layers", type=int, default=4, help="layers per stack (default 4)")
    _sections.add_write_option(parser)
    args = parser.parse_args()
    names = prepared(parser, args.names, list(ARCHITECTURES), "architecture")
    with _sections.recorded(
        __file__, "remat.auto across transformers and diffusers architectures", write_to=args.write
    ):
        print(
            f"{len(names)} architectures, {args.layers} layers per stack, batch {BATCH} (x {SEQ} tokens for text; "
            "diffusers' U-Nets and VAE at their configs' depth)."
        )
        print("Budgets and peaks are fractions of the peak without checkpointing.\n")
        print("| architecture | budget | plan | predicted | measured | step bit-equal | restored (auto's time) |")
        print("|---|---|---|---|---|---|---|")
        held = [ok for name in names for ok in _architecture(name, args.layers)]
        print(f"\n{sum(held)} of {len(held)} budgets held every check (a refusal below the floor counts as held).")


if __name__ == "__main__":
    main()
