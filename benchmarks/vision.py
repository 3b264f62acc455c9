"""remat.auto on torchvision and timm image models at full width: the budget held, the step bit for bit.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/vision.py                      # every model
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/vision.py tv-densenet121      # some
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/vision.py --write             # into BENCHMARKS.md

Needs torchvision and timm beside the torch their wheels pin (``make test-compat``'s venv has torchvision
0.29.1 and torch 2.14.1; ``pip install timm`` there). A model whose package is missing is a row saying so.
Each model is built with random weights and 10 classes, in training mode, and fed ``--batch`` images of
``--size`` pixels; the loss is the cross-entropy of its logits with fixed labels. The checks are
``benchmarks/architectures.py``'s (its ``_row``): ``remat.auto`` (verify on) at 0.8 of the peak without
checkpointing and at the floor + 1%, the plan's predicted and measured peaks, the step with the plan equal to
an untouched copy's (``torch.equal``: loss, every gradient, every buffer), and ``remat.remove`` restoring the
model. These models show what the transformers sweep does not: DenseNet hands each layer the list of every
earlier output (NOTE [Arguments as the call saw them] in remat.core._arguments), HRNet's stages write into the
list they are handed and its head runs modules as ``.forward()`` (NOTE [A unit run without its hooks] in
remat.profiling._profile_run), CaiT and MobileViT hold their trunk beside a repeated pair (NOTE [Units beside
repeated ones] in remat.profiling._blocks).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import _sections
import architectures
import torch
from torch import nn

Built = tuple[nn.Module, dict[str, Any], Callable[[Any], torch.Tensor]]


def _torchvision(name: str, **kw: Any) -> tuple[str, Callable[[int], nn.Module]]:
    def make(size: int) -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(weights=None, num_classes=10, **kw)

    return "torchvision", make


def _vit_torchvision(size: int) -> nn.Module:
    import torchvision

    shape = {"patch_size": 16, "num_layers": 6, "num_heads": 3, "hidden_dim": 192, "mlp_dim": 768}
    return torchvision.models.VisionTransformer(image_size=size, **shape, dropout=0.1, num_classes=10)


def _timm(name: str, *, sized: bool = False, **kw: Any) -> tuple[str, Callable[[int], nn.Module]]:
    def make(size: int) -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=10, **({"img_size": size} if sized else {}), **kw)

    return "timm", make


MODELS: dict[str, tuple[str, Callable[[int], nn.Module]]] = {
    "tv-densenet121": _torchvision("densenet121"),
    "tv-mobilenet_v2": _torchvision("mobilenet_v2"),
    "tv-vit": ("torchvision", _vit_torchvision),
    "tv-shufflenet_v2": _torchvision("shufflenet_v2_x0_5"),
    "tv-googlenet": _torchvision("googlenet", aux_logits=False, init_weights=True),
    "timm-hrnet_w18_small": _timm("hrnet_w18_small"),
    "timm-mobilevit_xxs": _timm("mobilevit_xxs"),
    "timm-cait_xxs24": _timm("cait_xxs24_224", sized=True),
    "timm-vit_tiny": _timm("vit_tiny_patch16_224", sized=True, drop_path_rate=0.1),
    "timm-convnext_atto": _timm("convnext_atto"),
    "timm-ghostnet": _timm("ghostnet_100"),
    "timm-pvt_v2_b0": _timm("pvt_v2_b0"),
    "timm-fastvit_t8": _timm("fastvit_t8"),
    "timm-mambaout_femto": _timm("mambaout_femto"),
    "timm-xcit_nano": _timm("xcit_nano_12_p16_224", sized=True),
    "timm-maxvit_nano": _timm("maxvit_nano_rw_256", sized=True),
}


def _build(name: str, batch: int, size: int) -> Built:
    make = MODELS[name][1]
    images = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(4))
    return make(size), {"x": images}, lambda logits: nn.functional.cross_entropy(logits, labels)


def _model(name: str, batch: int, size: int) -> list[bool]:
    return architectures.budgets_held(name, lambda: _build(name, batch, size), needs=MODELS[name][0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"models (default: all of {', '.join(MODELS)})")
    parser.add_argument("--batch", type=int, default=8, help="images per batch (default 8)")
    parser.add_argument("--size", type=int, default=128, help="image side in pixels (default 128)")
    _sections.add_write_option(parser)
    args = parser.parse_args()
    names = architectures.prepared(parser, args.names, list(MODELS), "model")
    with _sections.recorded(__file__, "remat.auto on torchvision and timm models", write_to=args.write):
        versions = {
            p: importlib.import_module(p).__version__ for p in ("torchvision", "timm") if importlib.util.find_spec(p)
        }
        print(
            f"{len(names)} models at full width, batch {args.batch} of {args.size}x{args.size} images; "
            + ", ".join(f"{p} {v}" for p, v in versions.items())
            + ". Budgets and peaks are fractions of the peak without checkpointing.\n"
        )
        print("| model | budget | plan | predicted | measured | step bit-equal | restored (auto's time) |")
        print("|---|---|---|---|---|---|---|")
        held = [ok for name in names for ok in _model(name, args.batch, args.size)]
        print(f"\n{sum(held)} of {len(held)} budgets held every check (a refusal below the floor counts as held).")


if __name__ == "__main__":
    main()
