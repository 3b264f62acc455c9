"""transformers' models for ``benchmarks/architectures.py`` (and ``tests/planning/test_architectures.py``): tiny
configs with random weights, each with a batch.

A builder takes the number of layers per stack and returns ``(model, batch)`` (the loss is ``output.loss``: the
batch has labels) or ``(model, batch, loss_fn)``; ``build`` returns the triple either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

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


def causal_lm(kind: str, **kw: Any) -> Callable[[int], Built]:
    def build(layers: int) -> Built:
        import transformers

        model = transformers.AutoModelForCausalLM.from_config(_config(kind, layers, **kw))
        ids = _ids()
        return model, {"input_ids": ids, "labels": ids}

    return build


def classifier(kind: str, **kw: Any) -> Callable[[int], Built]:
    def build(layers: int) -> Built:
        import transformers

        model = transformers.AutoModelForSequenceClassification.from_config(_config(kind, layers, num_labels=3, **kw))
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[BATCH // 2 :, SEQ - 8 :] = 0  # padding in half the batch
        return model, {"input_ids": _ids(), "attention_mask": mask, "labels": torch.arange(BATCH) % 3}

    return build


def seq2seq(kind: str, **kw: Any) -> Callable[[int], Built]:
    def build(layers: int) -> Built:
        import transformers

        model = transformers.AutoModelForSeq2SeqLM.from_config(_config(kind, layers, **kw))
        ids = _ids()
        return model, {"input_ids": ids, "labels": ids[:, : SEQ // 8].contiguous()}

    return build


def image(kind: str, size: int = 32, **kw: Any) -> Callable[[int], Built]:
    def build(layers: int) -> Built:
        import transformers

        config = transformers.AutoConfig.for_model(kind, num_labels=3, **kw)
        if hasattr(config, "num_hidden_layers") and "depths" not in kw:
            config.num_hidden_layers = layers
        model = transformers.AutoModelForImageClassification.from_config(config)
        pixels = torch.randn(BATCH, 3, size, size, generator=torch.Generator().manual_seed(2))
        return model, {"pixel_values": pixels, "labels": torch.arange(BATCH) % 3}

    return build


def whisper(layers: int) -> Built:
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


def wav2vec2(layers: int) -> Built:
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


KV = {"num_key_value_heads": 2}


def lora(layers: int) -> Built:
    # LoRA on every linear ("all-linear", the QLoRA recipe) with adapter dropout: the base frozen, each layer's
    # 7 projections wrapped (NOTE [A block is refined into what it calls] in remat.profiling._blocks).
    import peft

    model, batch = causal_lm("llama", **KV)(layers)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.1)
    return peft.get_peft_model(model, config), batch
