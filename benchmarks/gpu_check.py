"""GPU acceptance check: remat's predictions against what an H100-class GPU measures.

    PYTHONPATH=src python benchmarks/gpu_check.py                 # both files, every configuration
    PYTHONPATH=src python benchmarks/gpu_check.py --files h100.json --configs gpt2-4x512

For each configuration of ``benchmarks/gpu-truth/h100.json`` (and ``h100-bf16.json``,
forward under bf16 autocast):

* with CUDA: profiles it for real on the GPU and on fake tensors from the CPU
  (``target="h100"``), measures every assignment of the file with ``remat.measure``
  (2 warm-up, 5 timed steps, as the file was made), and plans at 0.8 / 0.6 / 0.45 of
  the un-checkpointed peak from both profiles, measuring each plan;
* without CUDA: says so, and compares the fake profiles with the file's own
  measurements (peaks and step-time ratios), plus what each budget's plan predicts.

``--extra`` adds the configurations of ``EXTRA`` (a ViT-Base and a Mistral-like GQA Llama, bf16 autocast),
which no file holds: measured like the others on a GPU, their fake predictions alone without one.

Prints markdown tables with the device, torch, CUDA and transformers versions; ``--write``
puts them into BENCHMARKS.md (``benchmarks/_sections.py``). No network is needed (zoo models
have random weights).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Iterator
from typing import Any

import _sections
import torch

import remat
from remat.bench._gpu_truth import FILES, as_measured, build_config, compare, load
from remat.core._fine import FINE, wrap_fine
from remat.core._policy_registry import POLICIES
from remat.profiling._blocks import find_blocks
from remat.profiling._format import human_bytes

BUDGETS = (0.8, 0.6, 0.45)

#: ``--extra``: configurations the truth files do not hold, measured on the GPU only (bf16 autocast): a ViT-Base and
#: a Mistral-like Llama (grouped-query attention, 4 query heads per K/V head, a 3.5x MLP, a 32k vocabulary).
EXTRA: dict[str, Any] = {
    "autocast": "bf16",
    "models": {
        "vit-base-224": {
            "zoo": "vit",
            "opts": {"layers": 12, "hidden": 768, "intermediate": 3072, "heads": 12, "image": 224, "batch": 64},
        },
        "mistral-like-8x1024": {
            "zoo": "llama",
            "opts": {
                "layers": 8,
                "hidden": 1024,
                "intermediate": 3584,
                "heads": 16,
                "kv_heads": 4,
                "vocab": 32000,
                "seq": 2048,
                "batch": 4,
            },
        },
    },
}

#: The policies each ``--extra`` configuration is measured under, every block alike.
EXTRA_POLICIES = ("keep", "full", "selective", "selective-ops", "full-fine")


def extra_truth() -> dict[str, Any]:
    """``EXTRA`` with its assignments: every block under each of ``EXTRA_POLICIES``, and keep / full alternating."""
    models = {}
    for label, entry in EXTRA["models"].items():
        blocks = find_blocks(build_config(EXTRA, label).model)
        assignments = {
            "none" if policy == "keep" else f"all-{policy}": {"policies": dict.fromkeys(blocks, policy)}
            for policy in EXTRA_POLICIES
        }
        alternate = {name: ("keep", "full")[i % 2] for i, name in enumerate(blocks)}
        models[label] = {**entry, "assignments": {**assignments, "alternate": {"policies": alternate}}}
    return {**EXTRA, "models": models}


def versions() -> str:
    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = "none"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    return (
        f"device: {gpu}; torch {torch.__version__} (CUDA build {torch.version.cuda or 'none'}); "
        f"transformers {tf}; host {platform.machine()}, {torch.get_num_threads()} threads"
    )


def err(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.2%}"


def measure(zoo: Any, assignment: dict[str, str]) -> remat.Measurement:
    modules = dict(zoo.model.named_modules())
    try:
        for block, policy in assignment.items():
            if policy == FINE:
                wrap_fine(modules[block])
            elif policy != "keep":
                remat.wrap(modules[block], policy=policy)
        return remat.measure(zoo.model, zoo.inputs, zoo.loss_fn, warmup=2, repeat=5)
    finally:
        remat.remove(zoo.model)


def _plan(prof: remat.Profile, fraction: float) -> remat.Plan | None:
    try:
        return remat.plan(prof, fraction)
    except remat.RematError:  # below the lowest reachable peak
        return None


def _lowest(prof: remat.Profile) -> str:
    low = remat.plan(prof, strategy="all").min_peak_bytes
    return f"{human_bytes(low)}, {low / prof.baseline_peak_bytes:.2f} of the peak"


def policies_of(truth: dict[str, Any], label: str) -> tuple[str, ...]:
    """remat.profile's default policies and any other the configuration's assignments use (``full-fine``)."""
    used = (p for row in truth["models"][label]["assignments"].values() for p in row["policies"].values())
    return tuple(dict.fromkeys([*POLICIES, *used]))


def fake_profile(truth: dict[str, Any], label: str) -> tuple[remat.Profile, float]:
    zoo = build_config(truth, label)  # meta device: nothing allocated
    start = time.perf_counter()
    prof = remat.profile(
        zoo.model, zoo.inputs, zoo.loss_fn, fake=True, target="h100", policies=policies_of(truth, label)
    )
    return prof, time.perf_counter() - start


def configurations(files: list[str], configs: list[str] | None) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(file name, its ground truth, configuration label) for every configuration asked for."""
    for name in files:
        truth = load(name)
        for label in truth["models"]:
            if not configs or label in configs:
                yield name, truth, label


def extra_cpu_part() -> None:
    """``--extra`` without a GPU: the fake profiles' predictions, to be measured where there is one."""
    print("| config | assignment | fake predicted peak (H100) | fake predicted time ratio | fake profile took |")
    print("|---|---|---|---|---|")
    truth = extra_truth()
    for label, entry in truth["models"].items():
        prof, took = fake_profile(truth, label)
        for assignment, row in entry["assignments"].items():
            print(
                f"| {label} | {assignment} | {human_bytes(prof.predict_peak(row['policies']))} | "
                f"{prof.predict_time(row['policies']) / prof.predict_time({}):.3f} | {took:.1f} s |"
            )


def cpu_part(files: list[str], configs: list[str] | None) -> None:
    print(
        "| file | config | assignment | measured peak (H100) | fake predicted | error "
        "| measured time ratio | fake predicted ratio | difference |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    plans = []
    for name, measured, label in configurations(files, configs):
        truth = as_measured(measured)  # its selective rows, as they ran
        prof, took = fake_profile(truth, label)
        for r in compare(truth, label, prof):
            print(
                f"| {name} | {label} | {r.assignment} | {human_bytes(r.measured_peak)} | "
                f"{human_bytes(r.predicted_peak)} | {r.peak_error:+.2%} | {r.measured_ratio:.3f} | "
                f"{r.predicted_ratio:.3f} | {r.predicted_ratio - r.measured_ratio:+.3f} |"
            )
        for fraction in BUDGETS:
            plan = _plan(prof, fraction)
            if plan is None:
                plans.append(
                    f"| {name} | {label} | {fraction} | below the lowest peak any plan reaches "
                    f"({_lowest(prof)}) | | | | {took:.0f} s |"
                )
                continue
            chosen = list(plan.assignment.values())
            counts = ", ".join(f"{chosen.count(p)} {p}" for p in dict.fromkeys(sorted(chosen)))
            plans.append(
                f"| {name} | {label} | {fraction} | {human_bytes(plan.budget_bytes)} | "
                f"{human_bytes(plan.predicted_peak_bytes)} | {1 + plan.predicted_overhead:.3f} | "
                f"{counts} | {took:.0f} s |"
            )
    print("\nPlans from the fake profiles (not measured: no GPU here):\n")
    print(
        "| file | config | budget | bytes | predicted peak | predicted time ratio | blocks per policy "
        "| fake profile took |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(plans))


def gpu_part(files: list[str], configs: list[str] | None, device: str = "cuda", extra: bool = False) -> None:
    print(
        "| file | config | assignment | measured peak | real profile | error | fake profile | error "
        "| measured time ratio | real predicted | fake predicted |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    budget_rows = []
    chosen = list(configurations(files, configs))
    if extra:
        truth = extra_truth()
        chosen += [("extra (bf16)", truth, label) for label in truth["models"]]
    for name, truth, label in chosen:
        zoo = build_config(truth, label, device=device)
        real = remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, repeat=3, warmup=1, policies=policies_of(truth, label))
        fake, _ = fake_profile(truth, label)
        base = None
        for assignment, row in truth["models"][label]["assignments"].items():
            m = measure(zoo, row["policies"])
            base = base or m.step_time_s
            pr, pf = real.predict_peak(row["policies"]), fake.predict_peak(row["policies"])
            print(
                f"| {name} | {label} | {assignment} | {human_bytes(m.peak_bytes)} | {human_bytes(pr)} | "
                f"{err(pr, m.peak_bytes)} | {human_bytes(pf)} | {err(pf, m.peak_bytes)} | "
                f"{m.step_time_s / base:.3f} | {real.predict_time(row['policies']) / real.step_time_s:.3f} | "
                f"{fake.predict_time(row['policies']) / fake.step_time_s:.3f} |"
            )
        for fraction in BUDGETS:
            for source, prof in (("real", real), ("fake", fake)):
                plan = _plan(prof, fraction)
                if plan is None:
                    budget_rows.append(
                        f"| {name} | {label} | {fraction} ({source}) | below the lowest peak "
                        f"any plan reaches ({_lowest(prof)}) | | | | | | |"
                    )
                    continue
                m = measure(zoo, plan.assignment)
                fits = "yes" if m.peak_bytes <= plan.budget_bytes else "**no**"
                budget_rows.append(
                    f"| {name} | {label} | {fraction} ({source}) | {human_bytes(plan.budget_bytes)} | "
                    f"{human_bytes(plan.predicted_peak_bytes)} | {human_bytes(m.peak_bytes)} | "
                    f"{err(plan.predicted_peak_bytes, m.peak_bytes)} | {fits} | "
                    f"{1 + plan.predicted_overhead:.3f} | {m.step_time_s / base:.3f} |"
                )
        # A run stopped at its time limit prints no table: each row goes to stderr as it is measured.
        print("\n".join(budget_rows[-2 * len(BUDGETS) :]), file=sys.stderr, flush=True)
        del zoo
        if device == "cuda":
            torch.cuda.empty_cache()
    print(
        "\n| file | config | budget (profile) | bytes | predicted peak | measured peak | error | fits "
        "| predicted time ratio | measured time ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(budget_rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="*", default=list(FILES), choices=list(FILES))
    parser.add_argument("--configs", nargs="*", help="configuration labels (default: all)")
    parser.add_argument("--extra", action="store_true", help="also the configurations of EXTRA (bf16)")
    _sections.add_write_option(parser)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    title = "GPU check: " + ("measured on this GPU" if cuda else "fake H100 profiles against the H100 measurements")
    with _sections.recorded(__file__, title, write_to=args.write, part="cuda" if cuda else "cpu", cuda=cuda):
        _check(args)


def _check(args: argparse.Namespace) -> None:
    print(versions() + "\n")
    if torch.cuda.is_available():
        gpu_part(args.files, args.configs, extra=args.extra)
    else:
        print(
            "No CUDA device here: the GPU part (real profiles, remat.measure, plans measured) did not run. "
            "Below, fake profiles made on this CPU for target='h100' against the files' H100 measurements; "
            "their selective rows ran op by op (`selective-ops`, before selective ran by module) and are "
            "predicted so.\n"
        )
        cpu_part(args.files, args.configs)
        if args.extra:
            print("\nConfigurations not in the files (--extra), predicted only:\n")
            extra_cpu_part()


if __name__ == "__main__":
    main()
