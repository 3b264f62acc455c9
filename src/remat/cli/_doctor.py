"""``remat doctor``: collects its findings in ``doctor_data`` (what ``--json`` prints, the
Python API's own report) and renders them in a separate function."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich import box
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

import remat
from remat.cli._commands import check_writable, draw_timeline, load, ms
from remat.cli._model import Loaded
from remat.cli._ui import Ui
from remat.errors import RematError
from remat.profiling._format import human_bytes


def _read_plan_file(path: str) -> Any:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise RematError(f"remat doctor: cannot read --plan {path!r}: {exc.strerror}.") from None
    return remat.Plan.from_json(text)


def _doctor_profile(args: argparse.Namespace, ui: Ui, loaded: Loaded) -> Any:
    """The profile --plot draws from, made before a --plan is applied; None (and a word) where remat cannot
    profile the model as written (its own checkpointing, e.g. torch's, is in the way)."""
    if not args.plot:
        return None
    try:
        with ui.status(f"profiling {args.model} for --plot ..."):
            return remat.profile(loaded.model, loaded.inputs, loaded.loss_fn, repeat=1, warmup=0)
    except RematError as err:
        ui.say(f"remat doctor: no timeline drawn: {err}")
        return None


def _doctor_plot(args: argparse.Namespace, ui: Ui, prof: Any, plan: Any, report: Any) -> None:
    if prof is None:
        return
    ref, ck = report.reference, report.checkpointed
    measured = {}
    if ref is not None and ck is not None:
        measured = {
            "none": ref.peak_bytes,
            (f"{plan.strategy} plan" if plan is not None else "as written"): ck.peak_bytes,
        }
    draw_timeline(ui, prof, plan if plan is not None and not plan.segments else None, args.plot, measured)


def doctor_data(report: Any) -> dict[str, Any]:
    """The report as ``DoctorReport.to_dict`` gives it."""
    return report.to_dict()


def _sites_table(report: Any) -> Table:
    table = Table(
        title="checkpointing found in one training step", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False
    )
    table.add_column("site", overflow="fold")  # a path has no spaces to wrap at; show all of it
    for col in ("checkpoints", "api", "calls", "implementation", "RNG preserved"):
        table.add_column(col)
    for c in report.checkpoints:
        table.add_row(
            escape(c.site),
            escape(c.target),
            escape(c.api),
            str(c.calls),
            "reentrant" if c.reentrant else "non-reentrant",
            "yes" if c.preserve_rng_state else "NO",
        )
    return table


def _render_finding(ui: Ui, f: Any) -> None:
    colour = "red" if f.severity == "error" else "yellow"
    where = f" ({', '.join(f.modules)})" if f.modules else ""
    ui.out.print(f"[bold {colour}]{f.severity.upper()}[/] [bold]{escape(f.code)}[/]{escape(where)}")
    lines = [Text(f.message), Text.assemble(("fix: ", "bold"), f.fix)]
    if f.sites:
        lines.append(Text(f"at: {', '.join(f.sites)}"))
    for line in lines:  # indented as a block, so wrapped lines stay under their finding
        ui.out.print(Padding(line, (0, 0, 0, 2)))


def _render_doctor(ui: Ui, report: Any, label: str) -> None:
    if not report.checkpoints:
        ui.say(
            f"{label}: no checkpointing found in a training step, so nothing to diagnose "
            f"(loss {report.loss_reference:.4f})."
        )
        return
    ui.show(_sites_table(report))
    for f in report.findings:
        _render_finding(ui, f)
    ref, ck = report.reference, report.checkpointed
    if ref is not None and ck is not None:
        ui.say(
            f"Measured: without checkpointing peak {human_bytes(ref.peak_bytes)}, step {ms(ref.step_time_s)} ms; "
            f"as written peak {human_bytes(ck.peak_bytes)}, step {ms(ck.step_time_s)} ms."
        )
    errors, warnings = len(report.errors), len(report.findings) - len(report.errors)
    if report.ok:
        ui.say(
            f"{label}: ok: checkpointing trains exactly like the model without it (loss "
            f"{report.loss_checkpointed:.4f} vs {report.loss_reference:.4f})."
        )
    else:
        ui.say(f"{label}: {errors} error(s), {warnings} warning(s).")


def cmd_doctor(args: argparse.Namespace, ui: Ui) -> int:
    """Exit status 1 when a finding is an error (training differs), 0 otherwise (warnings shown)."""
    check_writable(args.plot, "--plot")
    loaded = load(args, ui)
    plan = _read_plan_file(args.plan) if args.plan else None
    prof = _doctor_profile(args, ui, loaded)
    if plan is not None:
        remat.apply(loaded.model, plan)
    with ui.status(f"running {args.model} with and without its checkpointing ..."):
        report = remat.doctor(
            loaded.model, loaded.inputs, loaded.loss_fn, measure_cost=not args.no_measure, repeat=args.repeat
        )
    _doctor_plot(args, ui, prof, plan, report)
    if ui.json:
        ui.emit(doctor_data(report))
    else:
        _render_doctor(ui, report, args.model)
    return 1 if report.errors else 0
