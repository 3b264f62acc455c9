"""Measure the GPU ground truth again under today's policies, beside the file's own rows.

    PYTHONPATH=src python benchmarks/gpu_truth_remeasure.py [--files h100.json h100-bf16.json] [--configs LABEL ...]

For every configuration of ``benchmarks/gpu-truth/<file>`` it measures (``remat.measure``: 2 warm-up and 5 timed
steps, as the files were made) the file's own assignments and every block under each of today's policies
(``keep``, ``selective`` by module, ``selective-ops``, ``full``, ``full-fine``), and writes
``benchmarks/gpu-truth/<file stem>-<device>-<date>.json`` in the same layout with the device, torch, CUDA and
transformers versions. The old file's ``hidden_workspace`` tables are kept: they are per-op properties of the
kernels, measured by another tool. The old file stays as it is; tests read the files named in
``remat.bench._gpu_truth.FILES``. ``--device cpu`` runs the same on the CPU (a smoke test of this script with
``--configs`` of a small configuration; the file it writes is then not a GPU truth).
"""

from __future__ import annotations

import argparse
import datetime
import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from gpu_check import EXTRA_POLICIES, measure

from remat.bench._gpu_truth import FILES, TRUTH_DIR, build_config, load
from remat.profiling._blocks import find_blocks


def assignments(truth: dict[str, Any], label: str) -> dict[str, dict[str, str]]:
    """The file's own assignments, then every block under each of today's policies (named ``today-<policy>``)."""
    own = {name: row["policies"] for name, row in truth["models"][label]["assignments"].items()}
    blocks = find_blocks(build_config(truth, label).model)
    return {**own, **{f"today-{policy}": dict.fromkeys(blocks, policy) for policy in EXTRA_POLICIES}}


def remeasure(truth: dict[str, Any], label: str, device: str) -> dict[str, Any]:
    """The configuration's entry, measured on ``device``."""
    entry = truth["models"][label]
    zoo = build_config(truth, label, device=device)
    rows = {}
    for name, policies in assignments(truth, label).items():
        m = measure(zoo, policies)
        rows[name] = {
            "policies": policies,
            "peak": m.peak_bytes,
            "resting": m.resting_bytes,
            "t": m.step_time_s,
            "grads_ok": m.grads_ok,
        }
        print(f"{label} {name}: peak {m.peak_bytes} t {m.step_time_s:.4f}", flush=True)
    del zoo
    if device == "cuda":
        torch.cuda.empty_cache()
    return {**entry, "assignments": rows}


def versions(device: str) -> dict[str, str]:
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    return {
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "transformers": version("transformers"),
        "device": name,
        "measured": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="*", default=list(FILES), choices=list(FILES))
    parser.add_argument("--configs", nargs="*", help="configuration labels (default: all)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, default=TRUTH_DIR, help="where the new files go")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_truth_remeasure.py needs CUDA (or --device cpu for a smoke test); nothing was measured.")
        return
    for name in args.files:
        truth = load(name)
        labels = [label for label in truth["models"] if not args.configs or label in args.configs]
        models = {label: remeasure(truth, label, args.device) for label in labels}
        head = {k: v for k, v in truth.items() if k != "models"}
        fresh = {**head, **versions(args.device), "models": models}
        out = args.out / f"{Path(name).stem}-{args.device}-{fresh['measured']}.json"
        out.write_text(json.dumps(fresh, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
