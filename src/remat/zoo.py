"""Named models with random weights and synthetic batches, for demos, tests and benchmarks.

Every builder returns a :class:`ZooModel`; nothing is downloaded. The real
architectures are built from ``transformers`` configs, imported only when such a
model is asked for (``import remat`` does not import transformers). Defaults are
sized so that one training step takes about 0.5-2 s on 2 CPU cores:

==========  ===================================================================
seed-cifar  seed 000's CIFAR-10 CNN, batch 256 x 3x32x32
gpt2        GPT2LMHeadModel: 6 layers, hidden 512, 8 heads, vocab 8192,
            dropout 0.1 (residual, embedding, attention), batch 4 x 256 tokens
llama       LlamaForCausalLM: 6 layers, hidden 512, intermediate 1376, 8 heads,
            4 KV heads, vocab 8192, batch 4 x 256 tokens
vit         ViTForImageClassification: ViT-B/16's layout (12 layers, patch
            16, 224x224, MLP 4x hidden) at ViT-S/16's width (hidden 384,
            6 heads), 1000 classes, batch 4 x 197 tokens
resnet50    ResNetForImageClassification with ``ResNetConfig()``'s layout
            (bottleneck depths 3-4-6-3), 1000 classes, batch 4 x 3x128x128
==========  ===================================================================

NOTE [Building for training]
* Reproducible: weights come from ``torch.manual_seed(seed)`` inside
  ``torch.random.fork_rng`` (the caller's RNG stream is left as it was), data
  from a ``torch.Generator`` seeded with ``seed``. Same seed, same model and batch.
* ``use_cache=False``: a language model called in training with the config's
  default ``use_cache=True`` builds a KV cache and every decoder layer appends to
  it. Under checkpointing the recompute appends a second time (eager attention
  then fails on mismatched shapes; SDPA silently crops the doubled keys), and
  while the output lives the cache holds every layer's keys and values. Training
  never reads the cache; ``transformers`` turns it off under its own gradient
  checkpointing for the same reason.
* ``attention="sdpa"`` by default: it is what ``transformers`` users train with,
  and on CPU without attention dropout it dispatches to
  ``aten._scaled_dot_product_flash_attention_for_cpu``, the fused op that the
  selective policy keeps (``remat.SAVE_OPS``). With attention dropout > 0
  (GPT-2's 0.1) CPU SDPA falls back to the math path, which materialises the
  attention maps and draws the dropout mask from the CPU RNG (restored in
  recompute). ``attention="eager"`` gives transformers' explicit
  matmul-softmax-dropout-matmul instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.core._typing import Inputs, LossFn
from remat.errors import RematError

__all__ = ["ZooModel", "build", "names", "options", "SeedCifarCNN"]


@dataclass
class ZooModel:
    """A model, a batch it is called with, and the loss of a training step."""

    name: str
    """Zoo name the model was built from."""
    model: nn.Module
    """The model, in training mode, random weights."""
    inputs: Inputs
    """What the model is called with: a tensor, a tuple or a dict."""
    loss_fn: LossFn | None
    """``loss_fn(output) -> scalar``; None means ``output.loss`` / sum of outputs."""
    blocks: tuple[str, ...] = field(default=())
    """Qualified names of the repeated blocks, the natural checkpointing units."""


class SeedCifarCNN(nn.Module):
    """The CIFAR-10 CNN of seed 000, exactly as the user wrote it (Dropout inside the blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.cnn_block_1 = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2),
            nn.Dropout(0.25),
        )
        self.cnn_block_2 = nn.Sequential(
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2),
            nn.Dropout(0.25),
        )
        self.flatten = lambda inp: torch.flatten(inp, 1)
        self.head = nn.Sequential(nn.Linear(64 * 8 * 8, 512), nn.ReLU(), nn.Dropout(0.5), nn.Linear(512, 10))

    def forward(self, X: torch.Tensor) -> torch.Tensor:  # noqa: N803 (the user's name)
        X = self.cnn_block_1(X)
        X = self.cnn_block_2(X)
        X = self.flatten(X)
        return self.head(X)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weights(seed: int, make: Callable[[], nn.Module]) -> nn.Module:
    """``make()`` under ``torch.manual_seed(seed)``, in training mode, caller's RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make().train()


def _fail(name: str, problem: str, fix: str) -> RematError:
    return RematError(f"remat.zoo.build({name!r}): {problem}; {fix}.")


def _check_positive(name: str, **sizes: int) -> None:
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _fail(name, f"{key}={value!r} is not a positive integer", f"pass {key}=1 or more")


def _check_divides(name: str, big: str, big_value: int, small: str, small_value: int) -> None:
    if big_value % small_value:
        near = -(-big_value // small_value) * small_value  # the next multiple up
        raise _fail(
            name,
            f"{big}={big_value} is not a multiple of {small}={small_value}",
            f"choose e.g. {big}={near}",
        )


def _check_classes(name: str, classes: int) -> None:
    # One label would make transformers treat the task as regression (MSE on integer labels).
    if classes < 2:
        raise _fail(name, f"classes={classes} leaves nothing to classify", "pass classes=2 or more")


def _check_seq(name: str, seq: int) -> None:
    # The model shifts labels by one: a single token leaves no target and a NaN loss.
    if seq < 2:
        raise _fail(name, f"seq={seq} leaves no next token to predict", "pass seq=2 or more")


def _check_dropout(name: str, dropout: float) -> None:
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise _fail(name, f"dropout={dropout!r} is outside [0, 1)", "pass e.g. dropout=0.1, or 0.0 for none")


def _check_attention(name: str, attention: str) -> None:
    if attention not in ("sdpa", "eager"):
        raise _fail(name, f"attention={attention!r} is not supported", "pass attention='sdpa' or attention='eager'")


def _import_transformers(name: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise _fail(
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
    ids = torch.randint(0, vocab, (batch, seq), generator=_generator(seed))
    # labels = input_ids: the model shifts them itself, so ``output.loss`` is next-token prediction.
    return {"input_ids": ids, "labels": ids.clone()}


def _image_inputs(seed: int, classes: int, batch: int, image: int) -> dict[str, torch.Tensor]:
    gen = _generator(seed)
    pixels = torch.randn(batch, 3, image, image, generator=gen)
    return {"pixel_values": pixels, "labels": torch.randint(0, classes, (batch,), generator=gen)}


def _seed_cifar(*, batch: int = 256, seed: int = 0) -> ZooModel:
    """Seed 000's CNN on a random CIFAR-10-shaped batch."""
    _check_positive("seed-cifar", batch=batch)
    gen = _generator(seed)
    model = _weights(seed, SeedCifarCNN)
    images = torch.randn(batch, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (batch,), generator=gen)
    return ZooModel(
        name="seed-cifar",
        model=model,
        inputs=images,
        loss_fn=lambda logits: F.cross_entropy(logits, labels),
        blocks=("cnn_block_1", "cnn_block_2", "head"),
    )


def _gpt2(
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
    _check_positive("gpt2", layers=layers, hidden=hidden, heads=heads, vocab=vocab, batch=batch, seq=seq)
    _check_seq("gpt2", seq)
    _check_divides("gpt2", "hidden", hidden, "heads", heads)
    _check_dropout("gpt2", dropout)
    _check_attention("gpt2", attention)
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
    model = _weights(seed, lambda: _causal_lm(tf.GPT2LMHeadModel(config)))
    blocks = _children(model, "transformer.h")
    return ZooModel("gpt2", model, _lm_inputs(seed, vocab, batch, seq), None, blocks)


def _llama(
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
    _check_positive(
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
    _check_seq("llama", seq)
    _check_divides("llama", "hidden", hidden, "heads", heads)
    _check_divides("llama", "hidden // heads", hidden // heads, "2 (rotary embedding pairs)", 2)
    _check_divides("llama", "heads", heads, "kv_heads", kv_heads)
    _check_attention("llama", attention)
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
    model = _weights(seed, lambda: _causal_lm(tf.LlamaForCausalLM(config)))
    blocks = _children(model, "model.layers")
    return ZooModel("llama", model, _lm_inputs(seed, vocab, batch, seq), None, blocks)


def _vit(
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
    _check_positive(
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
    _check_divides("vit", "hidden", hidden, "heads", heads)
    _check_divides("vit", "image", image, "patch", patch)
    _check_classes("vit", classes)
    _check_dropout("vit", dropout)
    _check_attention("vit", attention)
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
    model = _weights(seed, lambda: tf.ViTForImageClassification(config))
    blocks = _children(model, "vit.layers", "vit.encoder.layer")
    return ZooModel("vit", model, _image_inputs(seed, classes, batch, image), None, blocks)


def _resnet50(
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
        raise _fail(
            "resnet50",
            f"depths={depths!r} and hidden_sizes={hidden_sizes!r} must be sequences",
            "give one entry per stage, e.g. depths=(1, 1), hidden_sizes=(32, 64)",
        )
    depths, hidden_sizes = tuple(depths), tuple(hidden_sizes)
    _check_positive(
        "resnet50",
        embedding_size=embedding_size,
        image=image,
        classes=classes,
        batch=batch,
        **{f"depths[{i}]": d for i, d in enumerate(depths)},
    )
    if not depths or len(depths) != len(hidden_sizes):
        raise _fail(
            "resnet50",
            f"depths has {len(depths)} stages and hidden_sizes {len(hidden_sizes)}",
            "give one hidden size per stage, e.g. depths=(1, 1), hidden_sizes=(32, 64)",
        )
    for i, size in enumerate(hidden_sizes):
        _check_positive("resnet50", **{f"hidden_sizes[{i}]": size})
        _check_divides("resnet50", f"hidden_sizes[{i}]", size, "4 (the bottleneck reduction)", 4)
    _check_classes("resnet50", classes)
    tf = _import_transformers("resnet50")
    config = tf.ResNetConfig(
        embedding_size=embedding_size, hidden_sizes=list(hidden_sizes), depths=list(depths), num_labels=classes
    )
    model = _weights(seed, lambda: tf.ResNetForImageClassification(config))
    stages = _children(model, "resnet.encoder.stages")
    blocks = tuple(block for stage in stages for block in _children(model, f"{stage}.layers"))
    return ZooModel("resnet50", model, _image_inputs(seed, classes, batch, image), None, blocks)


_BUILDERS: dict[str, Callable[..., ZooModel]] = {
    "seed-cifar": _seed_cifar,
    "gpt2": _gpt2,
    "llama": _llama,
    "vit": _vit,
    "resnet50": _resnet50,
}


def names() -> list[str]:
    """Names :func:`build` accepts."""
    return sorted(_BUILDERS)


def options(name: str) -> dict[str, Any]:
    """The options :func:`build` accepts for model ``name``, with their defaults."""
    if name not in _BUILDERS:
        raise RematError(f"remat.zoo.options: unknown model {name!r}; known models: {', '.join(names())}.")
    return {k: p.default for k, p in inspect.signature(_BUILDERS[name]).parameters.items()}


def build(name: str, **options: Any) -> ZooModel:
    """Build zoo model ``name`` with random weights; ``options`` set its sizes (e.g. ``batch=64``).

    Every model takes ``seed`` (same seed, identical weights and batch) and
    ``batch``; the other options and their defaults are the keyword arguments of
    the builder (see the table at the top of this module).
    """
    if name not in _BUILDERS:
        raise RematError(f"remat.zoo.build: unknown model {name!r}; known models: {', '.join(names())}.")
    builder = _BUILDERS[name]
    accepted = inspect.signature(builder).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise RematError(
            f"remat.zoo.build: bad options for {name!r}: {', '.join(unknown)}; {name!r} accepts {', '.join(accepted)}."
        )
    return builder(**options)
