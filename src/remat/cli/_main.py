"""The ``remat`` command line: profile, plan and diagnose a model, benchmark the zoo.

MODEL is a zoo name with options (``gpt2 --layers 6 --seq 256 --batch 4``) or
``path/to/file.py:factory`` (a function returning ``(model, inputs)``,
``(model, inputs, loss_fn)`` or a ``remat.zoo.ZooModel``).

Exit status: 0 on success; 1 when ``remat doctor`` finds an error (a finding of
severity "error": training differs from the model without checkpointing; warnings
alone exit 0) or ``remat demo`` sees remat train differently; 2 on bad usage or
bad input (unknown model, missing file or factory, bad or infeasible budget, any
``remat.RematError``; an exception raised by the user's model while remat runs it is one,
naming the step and the block), with one line on stderr and no traceback (``-vv`` or the
environment variable ``REMAT_TRACEBACK=1`` adds it, with the model's own traceback).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from rich.table import Table

from remat.cli._bench import cmd_bench, cmd_max_batch
from remat.cli._commands import _STRATEGY_HELP, OPTIMIZERS, cmd_plan, cmd_profile
from remat.cli._doctor import cmd_doctor
from remat.cli._model import add_model_options
from remat.cli._ui import Ui, error_line
from remat.errors import RematError
from remat.profiling._format import human_bytes

if TYPE_CHECKING:  # the type only: the demo's module is imported when the demo runs
    from remat.cli._demo import PlanDemo


def _cmd_demo(args: argparse.Namespace, ui: Ui) -> int:
    from remat.cli._demo import run_demo

    with ui.status("training the seed 000 CNN three ways ..."):
        variants = run_demo(batch=args.batch, steps=args.steps, rounds=args.rounds)
    ref = variants[0]
    timing = (
        f"step time: median of {args.rounds} interleaved rounds; ratio: median over rounds of the ratio to "
        "no checkpointing in the same round"
    )
    table = Table(title=f"seed 000 CIFAR-10 CNN, batch {args.batch}, {args.steps} SGD steps", caption=timing)
    for col in ("variant", "peak", "step time", "grads ok", "frozen params", "final loss", "losses == reference"):
        table.add_column(col)
    for v in variants:
        table.add_row(
            v.name,
            human_bytes(v.measurement.peak_bytes),
            f"{v.step_time_s * 1e3:.0f} ms ({v.time_ratio:.2f}x)",
            "yes" if v.measurement.grads_ok else f"no: {len(v.measurement.missing_grads)} missing",
            str(len(v.frozen)),
            f"{v.losses[-1]:.4f}",
            "yes (bit-equal)" if v.losses == ref.losses else "NO",
        )
    if not ui.json:
        ui.show(table)
    remat_ok = variants[1].losses == ref.losses and not variants[1].frozen
    bug = variants[2]
    ui.say(
        f"remat: loss sequence bit-equal to no checkpointing: {'yes' if remat_ok else 'NO'}. "
        f"Reentrant torch checkpoint: {len(bug.frozen)} parameters never trained "
        f"({', '.join(bug.frozen) or 'none'})."
    )
    if args.no_plan:
        _emit_demo(ui, variants, None)
        return 0 if remat_ok else 1
    from remat.cli._demo import run_plan_demo

    with ui.status("profiling, planning and verifying GPT-2 under a budget of 0.6 ..."):
        demo = run_plan_demo(budget=0.6, rounds=args.rounds)
    plan, base, ours = demo.plan, demo.baseline, demo.planned
    budget_bytes = plan.budget_bytes
    if budget_bytes is None:  # a plan made for a budget keeps it in bytes
        raise RuntimeError("remat demo: the plan for a budget of 0.6 carries no budget in bytes")
    table = Table(title=f"remat.auto on {demo.model}, budget 0.6 of the peak without checkpointing", caption=timing)
    for col in ("", "peak", "step time", "grads"):
        table.add_column(col)
    table.add_row("no checkpointing", human_bytes(base.peak_bytes), f"{demo.step_times_s[0] * 1e3:.0f} ms", "reference")
    table.add_row(
        f"remat plan (budget {human_bytes(budget_bytes)})",
        f"{human_bytes(ours.peak_bytes)} (predicted {human_bytes(plan.predicted_peak_bytes)})",
        f"{demo.step_times_s[1] * 1e3:.0f} ms ({demo.time_ratio:.2f}x; predicted {1 + plan.predicted_overhead:.2f}x)",
        "bit-equal" if demo.grads_equal else "DIFFER",
    )
    if not ui.json:
        ui.show(table)
    _emit_demo(ui, variants, demo)
    fits = ours.peak_bytes <= budget_bytes
    ui.say(f"{plan.summary()} Measured peak within budget: {'yes' if fits else 'NO'}.")
    return 0 if remat_ok and fits and demo.grads_equal else 1


def _emit_demo(ui: Ui, variants: list, plan_demo: PlanDemo | None) -> None:
    """``remat demo --json``: every variant (losses, measurement, frozen parameters, times) and the plan demo."""
    if ui.json:
        ref = variants[0].losses
        ui.emit(
            {
                "variants": [{**asdict(v), "losses_equal_reference": v.losses == ref} for v in variants],
                "plan_demo": None if plan_demo is None else asdict(plan_demo),
            }
        )


def _common() -> argparse.ArgumentParser:
    # SUPPRESS: a subcommand's -q/-v must not reset what was given before the subcommand.
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print one JSON document on stdout and nothing else (status goes to stderr)",
    )
    p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="errors only, no spinners")
    p.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,
        help="log what runs (-vv: debug, and tracebacks on errors)",
    )
    return p


def _model_parent(*, batch: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "model", metavar="MODEL", help="a zoo name (gpt2, llama, vit, resnet50, seed-cifar) or file.py:factory"
    )
    p.add_argument(
        "--device",
        metavar="cpu|cuda",
        help="move model, inputs and the loss's targets there (default: where the model was built, CPU for zoo models)",
    )
    add_model_options(p, batch=batch)
    return p


def _profile_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--fake",
        action="store_true",
        help="profile on fake tensors: plan without allocating (zoo models are built on the meta device)",
    )
    p.add_argument("--target", choices=("h100", "a100", "cpu"), help="with --fake: the device whose roofline times ops")
    p.add_argument("--blocks", metavar="auto|coarse|fine|A,B,...", help="the checkpointing units (default auto)")
    p.add_argument("--repeat", type=int, default=3, metavar="N", help="timed steps per policy (default 3)")
    p.add_argument(
        "--policies",
        metavar="P,P,...",
        default="keep,selective,selective-ops,full",
        help="the policies to profile and plan with (default keep,selective,selective-ops,full; also "
        "full-fine: a lower floor)",
    )
    p.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        help="plan for a loop that steps this optimizer after each backward (its state and step count)",
    )
    p.add_argument(
        "--accumulation-steps",
        type=int,
        default=1,
        metavar="N",
        help="backward passes per optimizer step (gradient accumulation; default 1)",
    )
    return p


def _add_commands(sub: argparse._SubParsersAction) -> None:
    common, model, prof = _common(), _model_parent(), _profile_parent()
    p = sub.add_parser("profile", parents=[common, model, prof], help="per-block memory and time, per policy")
    p.add_argument("--out", metavar="FILE", help="also write the full profile (remat.Profile.to_json)")
    p.add_argument("--plot", metavar="FILE.png", help="draw live memory along the step (remat.bench.plot_timeline)")
    p.add_argument("--budget", metavar="0.5|6GiB", help="with --plot: also draw the plan for this budget")
    p.set_defaults(command=cmd_profile)

    p = sub.add_parser("plan", parents=[common, model, prof], help="the fastest policy per block within a budget")
    p.add_argument("--budget", metavar="0.5|6GiB", help="fraction of the peak without checkpointing, or bytes")
    p.add_argument("--strategy", default="optimal", metavar="NAME", help=_STRATEGY_HELP)
    p.add_argument("--out", metavar="FILE", help="write the plan as JSON (remat.Plan.from_json reads it)")
    p.add_argument("--plot", metavar="FILE.png", help="draw live memory along the step, without and with the plan")
    p.set_defaults(command=cmd_plan)

    p = sub.add_parser("doctor", parents=[common, model], help="find silent checkpointing bugs; exit 1 on errors")
    p.add_argument("--plan", metavar="FILE", help="apply this plan (from remat plan --out) first, then diagnose")
    p.add_argument("--no-measure", action="store_true", help="skip measuring peak and time (faster; fewer checks)")
    p.add_argument("--repeat", type=int, default=3, metavar="N", help="timed rounds (default 3)")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw live memory along the step (profiled before --plan) with the measured peaks",
    )
    p.set_defaults(command=cmd_doctor)

    p = sub.add_parser(
        "demo", parents=[common], help="the main job: the seed 000 CNN three ways, then profile, plan and verify GPT-2"
    )
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        metavar="N",
        help="timed rounds, every variant once per round in a shuffled order (default 5)",
    )
    p.add_argument("--no-plan", action="store_true", help="only the seed 000 part (skip the GPT-2 plan)")
    p.set_defaults(command=_cmd_demo)


def _add_bench_commands(sub: argparse._SubParsersAction) -> None:
    common = _common()
    p = sub.add_parser("bench", parents=[common], help="zoo models under every strategy and budget, side by side")
    p.add_argument("models", nargs="+", metavar="MODEL", help="zoo names")
    p.add_argument("--quick", action="store_true", help="small sizes (remat.bench.QUICK) and 2 timed rounds")
    p.add_argument("--budgets", metavar="0.9,0.5,min", help="comma-separated budgets for remat's plans")
    p.add_argument("--repeat", type=int, metavar="N", help="timed rounds per model (default: remat.bench's)")
    p.add_argument(
        "--compile",
        metavar="1,0.5,0.1",
        help="also torch.compile at these activation memory budgets (compiles once each: minutes)",
    )
    p.add_argument("--markdown", metavar="FILE", help="also write the markdown table")
    add_model_options(p)
    p.set_defaults(command=cmd_bench)

    p = sub.add_parser("max-batch", parents=[common], help="the largest batch that fits a budget, per strategy")
    p.add_argument("model", metavar="MODEL", help="a zoo name")
    p.add_argument("--budget", required=True, metavar="6GiB", help="bytes (a fraction has no fixed meaning here)")
    p.add_argument("--strategies", metavar="none,every-block,remat", help="comma-separated strategies to compare")
    p.add_argument("--limit", type=int, metavar="N", help="largest batch to try (default: remat.bench's)")
    add_model_options(p, batch=False)
    p.set_defaults(command=cmd_max_batch)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remat", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log what runs (-vv: debug, tracebacks)")
    parser.add_argument("-q", "--quiet", action="store_true", help="errors only, no spinners")
    sub = parser.add_subparsers(dest="name", required=True)
    _add_commands(sub)
    _add_bench_commands(sub)
    return parser


def _configure_logging(args: argparse.Namespace) -> None:
    level = logging.ERROR if args.quiet else {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["remat", *argv])  # recorded in benchmark reports
    _configure_logging(args)
    ui = Ui(json=getattr(args, "json", False), quiet=args.quiet)
    try:
        return args.command(args, ui)
    except RematError as exc:
        if args.verbose > 1 or os.environ.get("REMAT_TRACEBACK"):
            traceback.print_exc()
        error_line(str(exc))
        return 2
    except KeyboardInterrupt:
        error_line("interrupted.")
        return 130
