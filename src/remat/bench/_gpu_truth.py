"""The H100 ground truth (``benchmarks/gpu-truth/``): its configurations, built as they were measured.

Each file holds, per zoo configuration, six per-block assignments with the peak
(``torch.cuda.max_memory_allocated``, resting bytes included), resting bytes and
median step time measured on one H100; ``h100-bf16.json`` ran every model's
forward under bfloat16 autocast. :func:`build_config` builds a configuration the
same way, on any device (``meta`` for fake profiles), and :func:`compare` sets a
profile's predictions beside the measured rows.
"""

from __future__ import annotations

import contextlib
import copy
import json
import pathlib
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
from torch import nn

from remat.core._policy_registry import SELECTIVE, SELECTIVE_OPS
from remat.profiling._types import Profile
from remat.zoo import ZooModel, build

TRUTH_DIR = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "gpu-truth"
FILES = ("h100.json", "h100-bf16.json")


def load(name: str, directory: pathlib.Path | None = None) -> dict[str, Any]:
    """One ground-truth file (``h100.json`` or ``h100-bf16.json``)."""
    return json.loads(((directory or TRUTH_DIR) / name).read_text())


def as_measured(truth: dict[str, Any]) -> dict[str, Any]:
    """``truth`` with its selective rows named for how they ran on the H100: op by op on every call
    (``selective-ops``), measured before selective ran by module; a fake profile predicts those rows so."""
    out = copy.deepcopy(truth)
    for entry in out["models"].values():
        for row in entry["assignments"].values():
            row["policies"] = {b: SELECTIVE_OPS if p == SELECTIVE else p for b, p in row["policies"].items()}
    return out


def autocast_forward(model: nn.Module, dtype: torch.dtype) -> None:
    """Run ``model``'s forward under ``torch.autocast(<device of its inputs>, dtype)``, as the bf16 runs did.

    The device type is read from the inputs at each call, so the same model runs
    under CUDA autocast on a GPU and under the fake run's CPU autocast (with CUDA's
    cast lists for a CUDA target) when profiled on fake tensors.
    """
    inner = type(model).forward.__get__(model)

    def forward(*args: Any, **kwargs: Any) -> Any:
        first = next((t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)), None)
        device = first.device.type if first is not None else "cpu"
        with torch.autocast(device, dtype=dtype):
            return inner(*args, **kwargs)

    model.forward = forward


# NOTE [The measured attention call]
# Every configuration was measured with transformers 5.x, whose GPT-2 and Llama call SDPA, for the
# unpadded batches the zoo builds, with no mask and ``is_causal=True`` (Llama also ``enable_gqa=True``,
# its K/V heads not repeated). transformers 4.x (4.57 seen), given position ids and no attention mask,
# always builds an explicit boolean causal mask (its packed-sequence check returns a mask even for one
# sequence per row) and then repeats the K/V heads, on a GPU as on fake tensors: SDPA takes another
# kernel (fp32 Llama: memory-efficient instead of math, which keeps no attention maps), a different
# computation that these peaks do not describe. An all-ones attention mask makes 4.x drop its mask and
# make the measured call; 5.x makes that call either way, so the mask is added only under 4.x and the
# inputs stay as measured elsewhere. The mask is a real CPU tensor even for a meta build: the fake run
# answers transformers' ``mask.all()`` check from its values.


def _needs_all_ones_mask() -> bool:
    """Whether the installed transformers needs an attention mask to make the measured attention call."""
    try:
        major = int(version("transformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return False
    return major < 5


def build_config(truth: dict[str, Any], label: str, device: str | torch.device = "meta") -> ZooModel:
    """Configuration ``label`` of a ground-truth file, on ``device`` (``meta``: for fake profiles only),
    making the attention call that was measured (NOTE [The measured attention call])."""
    entry = truth["models"][label]
    meta = str(device) == "meta"
    with torch.device("meta") if meta else contextlib.nullcontext():
        zoo = build(entry["zoo"], **entry["opts"])
    if _needs_all_ones_mask() and "input_ids" in zoo.inputs:
        zoo.inputs["attention_mask"] = torch.ones(zoo.inputs["input_ids"].shape, dtype=torch.long)
    if not meta:
        zoo.model.to(device)
        zoo.inputs = {k: v.to(device) for k, v in zoo.inputs.items()}
    if truth.get("autocast") == "bf16":
        autocast_forward(zoo.model, torch.bfloat16)
    return zoo


@dataclass(frozen=True)
class Row:
    """One measured assignment beside a profile's predictions."""

    label: str
    assignment: str
    policies: dict[str, str]
    measured_peak: int
    predicted_peak: int
    measured_ratio: float
    """Step time against no checkpointing, measured."""
    predicted_ratio: float

    @property
    def peak_error(self) -> float:
        return (self.predicted_peak - self.measured_peak) / self.measured_peak


def compare(truth: dict[str, Any], label: str, profile: Profile) -> list[Row]:
    """Every assignment of configuration ``label``, predicted by ``profile``."""
    rows = truth["models"][label]["assignments"]
    base_t, base_p = rows["none"]["t"], profile.predict_time({})
    return [
        Row(
            label,
            name,
            row["policies"],
            row["peak"],
            profile.predict_peak(row["policies"]),
            row["t"] / base_t,
            profile.predict_time(row["policies"]) / base_p,
        )
        for name, row in rows.items()
    ]
