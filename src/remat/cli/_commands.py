"""``remat profile`` and ``remat plan``, and what every command shares (loading MODEL, checking
output paths, drawing the timeline). Each command collects its numbers in a ``*_data`` function
(what ``--json`` prints, the Python API's own figures) and renders them in a separate one;
``remat doctor`` is in ``_doctor``."""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from rich import box
from rich.markup import escape
from rich.table import Table

import remat
from remat.cli._model import Loaded, check_device, load_model, model_options
from remat.cli._ui import Ui, warning_line
from remat.core._policy_registry import FULL, KEEP, REGISTRY, SELECTIVE
from remat.errors import RematError
from remat.profiling._format import human_bytes

log = logging.getLogger("remat.cli")

_STRATEGY_HELP = "optimal (default: least extra time within --budget), none, all, selective, sqrt, every:K"


def _num(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def ms(seconds: float) -> str:
    return _num(seconds * 1e3)


def _time_unit(step_time_s: float) -> tuple[str, float]:
    # Fake profiles of small models on an H100 roofline take microseconds: ms would read 0.00.
    return ("ms", 1e3) if step_time_s >= 1e-3 else ("µs", 1e6)


def _check_flags(args: argparse.Namespace) -> None:
    fake = getattr(args, "fake", False)
    if getattr(args, "target", None) and not fake:
        raise RematError(
            f"remat: --target {args.target} only applies with --fake (a real profile measures "
            "the device it runs on); add --fake."
        )
    if fake and args.device is not None:
        raise RematError("remat: --fake runs on fake tensors and times them for --target; drop --device.")
    check_device(args.device)


def load(args: argparse.Namespace, ui: Ui) -> Loaded:
    """MODEL with its options, on ``--device``; flags checked before the slow part."""
    _check_flags(args)
    options = model_options(args)
    log.info("building %s with options %s", args.model, options)
    with ui.status(f"building {args.model} ..."):
        return load_model(args.model, options, device=args.device, fake=getattr(args, "fake", False))


def _blocks(text: str | None) -> str | list[str] | None:
    if text is None or text in ("auto", "coarse", "fine"):
        return text
    return [name.strip() for name in text.split(",") if name.strip()]


def _profile_options(args: argparse.Namespace, loaded: Loaded) -> dict[str, Any]:
    """``remat.profile``'s options from the command line."""
    return {
        "blocks": _blocks(args.blocks),
        "repeat": args.repeat,
        "fake": args.fake,
        "target": args.target if args.fake else None,
        "policies": tuple(p.strip() for p in args.policies.split(",") if p.strip()),
        "optimizer": make_optimizer(args.optimizer, loaded.model),
        "accumulation_steps": args.accumulation_steps,
    }


def profile_within(args: argparse.Namespace, ui: Ui, loaded: Loaded) -> tuple[Any, str | None]:
    """The profile to plan ``--budget`` on, running no real step over it (NOTE [Within the budget] in
    remat.planning._within), with a progress line per profile; and a line saying why it stayed on fake tensors
    when it did (said after the result: a command that fails prints nothing on stdout)."""
    from remat.planning._within import RAN_OUT, profile_within

    def run(options: dict[str, Any]) -> Any:
        kind = f"fake tensors for {options.get('target') or 'cpu'}" if options.get("fake") else "measured"
        with ui.status(f"profiling {args.model} ({kind}): one traced step per policy ..."):
            return remat.profile(loaded.model, loaded.inputs, loaded.loss_fn, **options)

    within = profile_within(
        loaded.model,
        loaded.inputs,
        loaded.loss_fn,
        args.budget,
        api=f"remat {args.name}",
        options=_profile_options(args, loaded),
        run=run,
    )
    prof = within.profile
    if within.fake_because is None:
        return prof, None
    budget = human_bytes(within.budget_bytes or 0)
    fake = "profiled on fake tensors (memory exact, times from the device's roofline)"
    if within.fake_because == RAN_OUT:
        note = f"The real profile ran out of device memory (budget {budget}): {fake}."
    else:
        note = (
            f"The step without checkpointing is predicted at {human_bytes(prof.baseline_peak_bytes)}, over the "
            f"budget {budget}: {fake}, so that no step over the budget ran."
        )
    note += " remat.auto verifies such a plan with real steps within the budget."
    return prof, note


#: ``--optimizer``: the loop's optimizer, on the model's parameters (memory does not depend on the rates).
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-4),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
}


def make_optimizer(name: str | None, model: Any) -> Any:
    return None if name is None else OPTIMIZERS[name](model.parameters())


def _table(title: str, names: list[str], columns: tuple[str, ...]) -> Table:
    """A compact table whose first column fits the block names whole (they are what users copy)."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("block", no_wrap=True, min_width=min(48, max(map(len, names), default=5)))
    for col in columns:  # headers take two lines to keep columns narrow; in a narrow terminal
        table.add_column(col, justify="right")  # numbers wrap rather than being cut off
    return table


# -- profile ------------------------------------------------------------------------------------


def profile_data(args: argparse.Namespace, prof: Any, loaded: Loaded) -> dict[str, Any]:
    """The profile as ``remat profile --json`` prints it: summary figures and one entry per block."""
    blocks = [
        {**asdict(b), "peak_if_full_bytes": prof.predict_peak({b.name: FULL}) if FULL in prof.policies else None}
        for b in prof.blocks
    ]
    return {
        "source": args.model,
        "options": loaded.options,
        "model": prof.model,
        "device": prof.device,
        "fake": prof.fake,
        "target": prof.target,
        "baseline_peak_bytes": prof.baseline_peak_bytes,
        "min_peak_bytes": remat.plan(prof, strategy="none").min_peak_bytes,
        "resting_bytes": prof.resting_bytes,
        "param_bytes": prof.param_bytes,
        "grad_bytes": prof.grad_bytes,
        "step_time_s": prof.step_time_s,
        "policies": list(prof.policies),
        "blocks": blocks,
        "notes": list(prof.notes),
    }


def _profile_table(data: dict[str, Any]) -> Table:
    """Per block: input and output bytes; bytes kept for backward beyond the output under each
    policy; forward and backward time; extra step time per policy; forward FLOPs; the step's
    peak with only this block fully recomputed, against the peak without checkpointing."""
    kind = f"fake tensors, times modelled for {data['target']}" if data["fake"] else f"measured on {data['device']}"
    unit, scale = _time_unit(data["step_time_s"])
    flop_unit, flop_scale = (
        ("GFLOP", 1e9) if max((b["fwd_flops"] for b in data["blocks"]), default=0) >= 1e9 else ("MFLOP", 1e6)
    )
    shown = [k for k in data.get("policies", (KEEP, SELECTIVE, FULL)) if k != KEEP]
    short = {p.name: p.short for p in REGISTRY}
    columns = (
        "in",
        "out",
        "kept\nkeep",
        *(f"kept\n{short.get(k, k)}" for k in shown),
        f"fwd\n{unit}",
        f"bwd\n{unit}",
        *(f"+{unit}\n{short.get(k, k)}" for k in shown),
        f"{flop_unit}\nfwd",
        "peak if\nfull",
    )
    table = _table(
        f"{data['model']} ({data['source']}): {len(data['blocks'])} blocks, {kind}",
        [b["name"] for b in data["blocks"]],
        columns,
    )
    base = data["baseline_peak_bytes"]
    for b in data["blocks"]:
        saved = [human_bytes(b["saved_bytes"][k]) if k in b["saved_bytes"] else "-" for k in (KEEP, *shown)]
        extra = [_num(b["extra_time_s"][k] * scale) if k in b["extra_time_s"] else "-" for k in shown]
        full = b["peak_if_full_bytes"]
        table.add_row(
            escape(b["name"]),
            human_bytes(b["input_bytes"]),
            human_bytes(b["output_bytes"]),
            *saved,
            _num(b["fwd_time_s"] * scale),
            _num(b["bwd_time_s"] * scale),
            *extra,
            _num(b["fwd_flops"] / flop_scale),
            "-" if full is None else f"{(full - base) / base:+.1%}",
        )
    return table


def check_writable(path: str | None, flag: str = "--out") -> None:
    """A RematError now, before minutes of profiling, when ``path`` cannot be written."""
    if path is None:
        return
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise RematError(f"remat: {flag} {path!r} is a folder; give a file name such as {str(target / 'plan.json')!r}.")
    if not folder.is_dir():
        raise RematError(
            f"remat: {flag} {path!r}: the folder {str(folder)!r} does not exist; create it or write somewhere else."
        )
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise RematError(f"remat: {flag} {path!r} cannot be written (permission denied); write somewhere else.")


def draw_timeline(ui: Ui, prof: Any, plan: Any, path: str | None, measured: dict[str, int] | None = None) -> None:
    if not path:
        return
    import matplotlib.pyplot as plt

    from remat.bench import plot_timeline

    plt.close(plot_timeline(prof, plan, path=path, measured=measured))
    ui.say(f"Drew live memory along the step to {path}.")


def cmd_profile(args: argparse.Namespace, ui: Ui) -> int:
    check_writable(args.out)
    check_writable(args.plot, "--plot")
    if args.budget is not None and not args.plot:
        raise RematError(
            "remat profile: --budget only draws a plan on --plot FILE.png; add --plot, or use "
            "remat plan --budget to choose a plan."
        )
    if args.budget is not None:
        remat.parse_budget(args.budget, 1)  # a typo fails now, not after profiling
    loaded = load(args, ui)
    prof, fake_note = profile_within(args, ui, loaded)
    data = profile_data(args, prof, loaded)
    if args.out:
        Path(args.out).write_text(prof.to_json())
    draw_timeline(ui, prof, remat.plan(prof, args.budget) if args.budget is not None else None, args.plot)
    if ui.json:
        ui.emit(data)
    else:
        ui.show(_profile_table(data))
        ui.say(
            f"Peak without checkpointing {human_bytes(data['baseline_peak_bytes'])}; lowest any plan reaches "
            f"{human_bytes(data['min_peak_bytes'])}. Resting {human_bytes(data['resting_bytes'])} (parameters "
            f"{human_bytes(data['param_bytes'])}), gradients {human_bytes(data['grad_bytes'])}, step "
            f"{_num(data['step_time_s'] * _time_unit(data['step_time_s'])[1])} {_time_unit(data['step_time_s'])[0]}."
        )
        for note in data["notes"]:
            ui.say(note)
    if fake_note:
        ui.say(fake_note)
    if args.out:
        ui.say(f"Wrote the full profile to {args.out} (remat.Profile.from_json reads it).")
    return 0


# -- plan ---------------------------------------------------------------------------------------


def _check_plan_args(args: argparse.Namespace) -> None:
    from remat.planning.plan import parse_budget

    if args.strategy == "optimal" and args.budget is None:
        raise RematError(
            "remat plan: give --budget (a fraction of the peak without checkpointing such as 0.5, "
            "or bytes such as 6GiB), or a hand-made --strategy."
        )
    if args.budget is not None:
        parse_budget(args.budget, 1)  # a typo fails now, not after profiling


def plan_data(plan: Any) -> dict[str, Any]:
    """The plan exactly as ``Plan.to_json`` writes it (so ``--json`` output loads with ``Plan.from_json``)."""
    return json.loads(plan.to_json())


def _plan_table(plan: Any, prof: Any) -> Table:
    by_name = {b.name: b for b in prof.blocks}
    unit, scale = _time_unit(prof.step_time_s)
    table = _table(
        f"{plan.strategy} plan for {plan.model}",
        list(plan.assignment),
        ("policy", "kept for backward", f"extra {unit}"),
    )
    for name, policy in plan.assignment.items():
        b = by_name[name]
        table.add_row(
            escape(name),
            policy,
            human_bytes(b.saved_bytes.get(policy, 0)),
            _num(b.extra_time_s.get(policy, 0.0) * scale),
        )
    return table


def cmd_plan(args: argparse.Namespace, ui: Ui) -> int:
    _check_plan_args(args)
    check_writable(args.out)
    check_writable(args.plot, "--plot")
    loaded = load(args, ui)
    prof, fake_note = profile_within(args, ui, loaded)
    chosen = remat.plan(prof, args.budget, strategy=args.strategy)
    if chosen.budget_bytes is not None and chosen.predicted_peak_bytes > chosen.budget_bytes:
        warning_line(
            f"the {chosen.strategy} plan's predicted peak {human_bytes(chosen.predicted_peak_bytes)} "
            f"({chosen.predicted_peak_bytes} bytes) is over the budget {human_bytes(chosen.budget_bytes)} "
            f"({chosen.budget_bytes} bytes): a hand-made strategy ignores the budget. --strategy optimal fits it "
            f"when it can (lowest peak any plan reaches: {human_bytes(chosen.min_peak_bytes)})."
        )
    if args.out:
        Path(args.out).write_text(chosen.to_json())
    draw_timeline(ui, prof, chosen, args.plot)
    if ui.json:
        ui.emit(plan_data(chosen))
    else:
        ui.show(_plan_table(chosen, prof))
        ui.say(chosen.summary())
        ui.say(f"Lowest peak any plan reaches: {human_bytes(chosen.min_peak_bytes)}.")
    if fake_note:
        ui.say(fake_note)
    if args.out:
        ui.say(f"Wrote the plan to {args.out}; apply it with remat.apply(model, remat.Plan.from_json(text)).")
    return 0
