"""The zoo's ``transformers`` models (GPT-2, Llama, ViT, ResNet-50), built from configs with random weights.

``transformers`` is imported only when one of them is built; see NOTE [Building for training]
in :mod:`remat.zoo` for the config choices (``use_cache=False``, ``attention="sdpa"``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from remat.errors import RematError
from remat.zoo._base import (
    ZooModel,
    check_attention,
    check_classes,
    check_divides,
    check_dropout,
    check_positive,
    check_seq,
    fail,
    generator,
    weights,
)


def _import_transformers(name: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise fail(
            name,
            "needs the transformers package, which is not installed",
            "install it with pip install 'remat[models]'",
        ) from None
    return transformers


def _causal_lm(model: nn.Module) -> nn.Module:
    # GPT2LMHeadModel's class name does not tell transformers its loss; without this it logs a warning.
    model.loss_type = "ForCausalLM"  # type: ignore[assignment]  # Module.__setattr__ takes any value
    return model


def _children(model: nn.Module, *paths: str) -> tuple[str, ...]:
    """Qualified names of the children of the first of ``paths`` that ``model`` has.

    Several paths because transformers renames containers between versions
    (ViT's layers are ``vit.encoder.layer`` in 4.x, ``vit.layers`` in 5.x).
    """
    modules = dict(model.named_modules())
    for path in paths:
        if path in modules:
            return tuple(f"{path}.{child}" for child, _ in modules[path].named_children())
    import transformers

    raise RematError(
        f"remat.zoo: {type(model).__name__} has none of the block containers {', '.join(paths)} under "
        f"transformers {transformers.__version__}; remat.zoo needs updating for this version (please "
        "report it), or install the transformers version in remat's 'models' extra."
    )


def _lm_inputs(seed: int, vocab: int, batch: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, seq), generator=generator(seed))
    # labels = input_ids: the model shifts them itself, so ``output.loss`` is next-token prediction.
    return {"input_ids": ids, "labels": ids.clone()}


def _image_inputs(seed: int, classes: int, batch: int, image: int) -> dict[str, torch.Tensor]:
    gen = generator(seed)
    pixels = torch.randn(batch, 3, image, image, generator=gen)
    return {"pixel_values": pixels, "labels": torch.randint(0, classes, (batch,), generator=gen)}


def gpt2(
    *,
    layers: int = 6,
    hidden: int = 512,
    heads: int = 8,
    vocab: int = 8192,
    batch: int = 4,
    seq: int = 256,
    dropout: float = 0.1,
    attention: str = "sdpa",
    seed: int = 0,
) -> ZooModel:
    """GPT-2 (``GPT2LMHeadModel``); ``dropout`` sets the residual, embedding and attention dropout."""
    check_positive("gpt2", layers=layers, hidden=hidden, heads=heads, vocab=vocab, batch=batch, seq=seq)
    check_seq("gpt2", seq)
    check_divides("gpt2", "hidden", hidden, "heads", heads)
    check_dropout("gpt2", dropout)
    check_attention("gpt2", attention)
    tf = _import_transformers("gpt2")
    config = tf.GPT2Config(
        vocab_size=vocab,
        n_positions=seq,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=vocab - 1,  # GPT-2 puts <|endoftext|> last; the default 50256 is outside a small vocab
        eos_token_id=vocab - 1,
        use_cache=False,  # see NOTE [Building for training]
        attn_implementation=attention,
    )
    model = weights(seed, lambda: _causal_lm(tf.GPT2LMHeadModel(config)))
    blocks = _children(model, "transformer.h")
    return ZooModel("gpt2", model, _lm_inputs(seed, vocab, batch, seq), None, blocks)


def llama(
    *,
    layers: int = 6,
    hidden: int = 512,
    intermediate: int = 1376,
    heads: int = 8,
    kv_heads: int = 4,
    vocab: int = 8192,
    batch: int = 4,
    seq: int = 256,
    attention: str = "sdpa",
    seed: int = 0,
) -> ZooModel:
    """Llama (``LlamaForCausalLM``) with grouped-query attention (``kv_heads`` < ``heads``)."""
    check_positive(
        "llama",
        layers=layers,
        hidden=hidden,
        intermediate=intermediate,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        batch=batch,
        seq=seq,
    )
    check_seq("llama", seq)
    check_divides("llama", "hidden", hidden, "heads", heads)
    check_divides("llama", "hidden // heads", hidden // heads, "2 (rotary embedding pairs)", 2)
    check_divides("llama", "heads", heads, "kv_heads", kv_heads)
    check_attention("llama", attention)
    tf = _import_transformers("llama")
    config = tf.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        bos_token_id=min(1, vocab - 1),
        eos_token_id=min(2, vocab - 1),
        use_cache=False,  # see NOTE [Building for training]
        attn_implementation=attention,
    )
    model = weights(seed, lambda: _causal_lm(tf.LlamaForCausalLM(config)))
    blocks = _children(model, "model.layers")
    return ZooModel("llama", model, _lm_inputs(seed, vocab, batch, seq), None, blocks)


def vit(
    *,
    layers: int = 12,
    hidden: int = 384,
    intermediate: int = 1536,
    heads: int = 6,
    image: int = 224,
    patch: int = 16,
    classes: int = 1000,
    batch: int = 4,
    dropout: float = 0.0,
    attention: str = "sdpa",
    seed: int = 0,
) -> ZooModel:
    """ViT (``ViTForImageClassification``); ``dropout`` sets the hidden and attention dropout."""
    check_positive(
        "vit",
        layers=layers,
        hidden=hidden,
        intermediate=intermediate,
        heads=heads,
        image=image,
        patch=patch,
        classes=classes,
        batch=batch,
    )
    check_divides("vit", "hidden", hidden, "heads", heads)
    check_divides("vit", "image", image, "patch", patch)
    check_classes("vit", classes)
    check_dropout("vit", dropout)
    check_attention("vit", attention)
    tf = _import_transformers("vit")
    config = tf.ViTConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        image_size=image,
        patch_size=patch,
        num_labels=classes,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        attn_implementation=attention,
    )
    model = weights(seed, lambda: tf.ViTForImageClassification(config))
    blocks = _children(model, "vit.layers", "vit.encoder.layer")
    return ZooModel("vit", model, _image_inputs(seed, classes, batch, image), None, blocks)


def resnet50(
    *,
    depths: tuple[int, ...] = (3, 4, 6, 3),
    hidden_sizes: tuple[int, ...] = (256, 512, 1024, 2048),
    embedding_size: int = 64,
    image: int = 128,
    classes: int = 1000,
    batch: int = 4,
    seed: int = 0,
) -> ZooModel:
    """ResNet (``ResNetForImageClassification``), by default ResNet-50's bottleneck layout."""
    if not isinstance(depths, (tuple, list)) or not isinstance(hidden_sizes, (tuple, list)):
        raise fail(
            "resnet50",
            f"depths={depths!r} and hidden_sizes={hidden_sizes!r} must be sequences",
            "give one entry per stage, e.g. depths=(1, 1), hidden_sizes=(32, 64)",
        )
    depths, hidden_sizes = tuple(depths), tuple(hidden_sizes)
    check_positive(
        "resnet50",
        embedding_size=embedding_size,
        image=image,
        classes=classes,
        batch=batch,
        **{f"depths[{i}]": d for i, d in enumerate(depths)},
    )
    if not depths or len(depths) != len(hidden_sizes):
        raise fail(
            "resnet50",
            f"depths has {len(depths)} stages and hidden_sizes {len(hidden_sizes)}",
            "give one hidden size per stage, e.g. depths=(1, 1), hidden_sizes=(32, 64)",
        )
    for i, size in enumerate(hidden_sizes):
        check_positive("resnet50", **{f"hidden_sizes[{i}]": size})
        check_divides("resnet50", f"hidden_sizes[{i}]", size, "4 (the bottleneck reduction)", 4)
    check_classes("resnet50", classes)
    tf = _import_transformers("resnet50")
    config = tf.ResNetConfig(
        embedding_size=embedding_size, hidden_sizes=list(hidden_sizes), depths=list(depths), num_labels=classes
    )
    model = weights(seed, lambda: tf.ResNetForImageClassification(config))
    stages = _children(model, "resnet.encoder.stages")
    blocks = tuple(block for stage in stages for block in _children(model, f"{stage}.layers"))
    return ZooModel("resnet50", model, _image_inputs(seed, classes, batch, image), None, blocks)
