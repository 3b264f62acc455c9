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
from _architecture_images import (
    autoencoder_kl,
    densenet,
    dit,
    fasterrcnn,
    flux,
    pixart,
    sd3,
    torchvision_model,
    unet2d,
    unet2d_condition,
    vit_torchvision,
)
from _architecture_zoo import (
    BATCH,
    KV,
    SEQ,
    Built,
    Loss,
    causal_lm,
    classifier,
    image,
    lora,
    seq2seq,
    wav2vec2,
    whisper,
)
from torch import nn

import remat
from remat.core._hf import disable_cache

ARCHITECTURES: dict[str, Callable[[int], Built | tuple[nn.Module, dict[str, Any], Loss]]] = {
    "gpt2": lambda n: causal_lm("gpt2", n_embd=64, n_layer=n, n_head=4, n_positions=SEQ)(n),
    "llama": causal_lm("llama", **KV),
    "llama-lora": lora,
    "mistral": causal_lm("mistral", **KV, sliding_window=16),
    "qwen2": causal_lm("qwen2", **KV),
    "qwen3": causal_lm("qwen3", **KV, head_dim=16),
    "gemma2": causal_lm("gemma2", **KV, head_dim=16),
    "phi3": causal_lm("phi3", **KV, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gpt_neox": causal_lm("gpt_neox"),
    "bloom": lambda n: causal_lm("bloom", n_layer=n, n_head=4)(n),
    "opt": causal_lm("opt", ffn_dim=128, word_embed_proj_dim=64),
    "falcon": causal_lm("falcon", new_decoder_architecture=False),
    "mixtral": causal_lm("mixtral", **KV, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True),
    "qwen2_moe": causal_lm(
        "qwen2_moe",
        **KV,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        output_router_logits=True,
    ),
    "gemma3": causal_lm("gemma3_text", **KV, head_dim=16, sliding_window=16),
    "olmo2": causal_lm("olmo2", **KV),
    "llama4": causal_lm(
        "llama4_text",
        **KV,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        intermediate_size_mlp=128,
        output_router_logits=True,
    ),
    "deepseek_v3": causal_lm(  # latent attention; the first layer dense, the others experts and a shared one
        "deepseek_v3",
        **KV,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
    "gpt_oss": causal_lm(
        "gpt_oss",
        **KV,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        output_router_logits=True,
    ),
    # state-space, recurrent and hybrid models, on transformers' PyTorch paths (no fused kernels on the CPU)
    "mamba": causal_lm("mamba", state_size=8, expand=2, conv_kernel=4, use_mambapy=False),
    "mamba2": causal_lm("mamba2", state_size=8, expand=2, num_heads=8, head_dim=16, n_groups=1, chunk_size=32),
    "jamba": causal_lm(  # Mamba and attention layers, experts in every other layer
        "jamba",
        **KV,
        num_experts=4,
        num_experts_per_tok=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=8,
        mamba_expand=2,
        use_mamba_kernels=False,
        output_router_logits=True,
    ),
    "falcon_h1": causal_lm(  # attention and Mamba-2 side by side in each layer
        "falcon_h1",
        **KV,
        head_dim=16,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_ssm=128,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_chunk_size=32,
    ),
    "qwen3_next": causal_lm(  # gated delta-net and attention layers, experts in each
        "qwen3_next",
        **KV,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        full_attention_interval=2,
        output_router_logits=True,
    ),
    "recurrent_gemma": causal_lm("recurrent_gemma", **KV, head_dim=16, lru_width=64, attention_window_size=16),
    "rwkv": causal_lm("rwkv", attention_hidden_size=64, context_length=SEQ),
    "xlstm": causal_lm(
        "xlstm",
        embedding_dim=64,
        num_heads=4,
        mode="train",
        chunkwise_kernel="chunkwise--native_autograd",
        sequence_kernel="native_sequence__native",
        step_kernel="native",
    ),
    "bert": classifier("bert"),
    "roberta": classifier("roberta", pad_token_id=1, max_position_embeddings=SEQ + 2),
    "deberta-v2": classifier("deberta-v2"),
    "distilbert": lambda n: classifier("distilbert", dim=64, n_layers=n, n_heads=4, hidden_dim=128)(n),
    "electra": classifier("electra", embedding_size=32),
    "albert": classifier("albert", embedding_size=32),
    "t5": lambda n: seq2seq(
        "t5", d_model=64, d_kv=16, d_ff=128, num_layers=n, num_decoder_layers=n, num_heads=4, decoder_start_token_id=0
    )(n),
    "bart": lambda n: seq2seq(
        "bart",
        d_model=64,
        encoder_layers=n,
        decoder_layers=n,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
    )(n),
    "whisper": whisper,
    "wav2vec2": wav2vec2,
    "vit": image("vit", hidden_size=64, num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=8),
    "dinov2": image("dinov2", hidden_size=64, num_attention_heads=4, image_size=32, patch_size=8),
    "swin": image("swin", embed_dim=16, depths=[2, 2], num_heads=[2, 4], image_size=32, patch_size=4, window_size=4),
    "convnext": image("convnext", size=96, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1]),
    "resnet": image("resnet", size=96, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], embedding_size=16),
    "unet2d-condition": unet2d_condition,
    "unet2d": unet2d,
    "autoencoder-kl": autoencoder_kl,
    "dit": dit,
    "pixart": pixart,
    "sd3": sd3,
    "flux": flux,
    "densenet": torchvision_model(densenet),
    "vit-torchvision": torchvision_model(vit_torchvision),
    "fasterrcnn": fasterrcnn,
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


def _row(
    name: str, built: tuple[nn.Module, dict, Loss], untouched: nn.Module, fraction: float, base: int, floor: int
) -> tuple[str, bool]:
    """One budget's row (its table line, whether every check held); the model is left without a plan. The reference
    step runs on a copy of ``untouched``, the model as built, with the model's parameters and buffers."""
    model, batch, loss_fn = built
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state, tree = copy.deepcopy(model.state_dict()), str(model)  # with its metadata (torchvision's versions)
    copied = _cache_off(copy.deepcopy(untouched))
    copied.load_state_dict(model.state_dict())
    reference = _step(copied, batch, loss_fn)
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
    # RecurrentGemma leaves each step's last recurrent state on its modules, in the step's graph: such a model
    # cannot be deep-copied after a step, so the references are copies of it as built
    untouched = copy.deepcopy(model)
    prof = remat.profile(model, batch, loss_fn, repeat=1, warmup=0)
    base = prof.baseline_peak_bytes
    floor = remat.plan(prof, strategy="none").min_peak_bytes
    units = f"{len(prof.blocks)} unit{'s' if len(prof.blocks) > 1 else ''}"
    print(f"| {name} ({units}) | 1.000 | peak without checkpointing {base / 2**20:.1f} MiB | | | | |")
    held = []
    for fraction in (0.8, min((floor * 1.01 + 1) / base, 1.0)):
        line, ok = _row(name, built, untouched, fraction, base, floor)
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
