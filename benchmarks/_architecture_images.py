"""diffusers' and torchvision's models for ``benchmarks/architectures.py``: tiny sizes, random weights, each
with its batch and loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from _architecture_zoo import BATCH, Loss
from torch import nn


# diffusers models return ``output.sample``: the loss is its mean squared error from a fixed target, as a
# denoising step's is. Sizes are tiny; ``layers`` sets the transformers' depth (the U-Nets' is their config's).
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mse_from(target: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    return lambda output: (output.sample.float() - target).square().mean()


_STEPS = torch.tensor([3, 7, 11, 500])


def unet2d_condition(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
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


def unet2d(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
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


def autoencoder_kl(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
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


def dit(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
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


def pixart(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
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


def sd3(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
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


def flux(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
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


# torchvision models (in the compatibility lane's venv): images and class labels, the loss their cross-entropy.
# DenseNet hands each layer the list of every earlier output and appends to it after the call (NOTE [Arguments as
# the call saw them] in remat.core._arguments); ViT's nn.MultiheadAttention is called with one tensor three times.
_LABELS = torch.randint(0, 10, (BATCH,), generator=torch.Generator().manual_seed(6))


def torchvision_model(make: Callable[[int], nn.Module]) -> Callable[[int], tuple[nn.Module, dict[str, Any], Loss]]:
    def build(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
        images = torch.randn(BATCH, 3, 32, 32, generator=_gen(7))
        return make(layers), {"x": images}, lambda logits: nn.functional.cross_entropy(logits, _LABELS)

    return build


def densenet(layers: int) -> nn.Module:
    import torchvision

    config = {"growth_rate": 8, "block_config": (layers, layers), "num_init_features": 16, "bn_size": 2}
    return torchvision.models.DenseNet(**config, drop_rate=0.1, num_classes=10)


def vit_torchvision(layers: int) -> nn.Module:
    import torchvision

    size = {"image_size": 32, "patch_size": 8, "hidden_dim": 64, "mlp_dim": 128, "num_heads": 4}
    return torchvision.models.VisionTransformer(**size, num_layers=layers, dropout=0.1, num_classes=10)


def fasterrcnn(layers: int) -> tuple[nn.Module, dict[str, Any], Loss]:
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
