"""``remat bench`` and ``remat max-batch``: thin front ends to :mod:`remat.bench`, which
collects every number; this module only passes options and renders its markdown."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from rich.markdown import Markdown

from remat.cli._model import check_zoo_name, is_factory, model_options
from remat.cli._ui import Ui
from remat.errors import RematError

log = logging.getLogger("remat.cli")


def _zoo_names(names: list[str], command: str) -> None:
    for name in names:
        if is_factory(name):
            raise RematError(
                f"remat {command}: {name!r}: benchmarks run zoo models only; "
                "profile and plan your own with remat profile / remat plan."
            )
        check_zoo_name(name)


def _accepted(name: str) -> set[str]:
    from remat.zoo import options

    return set(options(name))


def per_model_options(names: list[str], options: dict[str, Any], command: str) -> dict[str, dict[str, Any]]:
    """Each option goes to every listed model that takes it; one that no model takes is an error."""
    per = {name: {k: v for k, v in options.items() if k in _accepted(name)} for name in names}
    unused = sorted(set(options) - {k for chosen in per.values() for k in chosen})
    if unused:
        raise RematError(f"remat {command}: no model among {', '.join(names)} takes {', '.join(unused)}.")
    return per


def _budget_item(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text.strip()


def _compile_budgets(text: str) -> tuple[float, ...]:
    """Parsed only: remat.bench checks the range."""
    try:
        budgets = tuple(float(b) for b in text.split(",") if b.strip())
    except ValueError:
        budgets = ()
    if not budgets:
        raise RematError(
            f"remat bench --compile {text}: give activation memory budgets between 0 and 1, "
            "comma-separated (e.g. --compile 1,0.5,0.1)."
        )
    return budgets


def cmd_bench(args: argparse.Namespace, ui: Ui) -> int:
    _zoo_names(args.models, "bench")
    options = {n: o for n, o in per_model_options(args.models, model_options(args), "bench").items() if o}
    from remat import bench  # lazily: it pulls in plotting and every zoo model

    kwargs: dict[str, Any] = {"quick": args.quick, "options": options or None, "command": args.command_line}
    if args.repeat is not None:
        kwargs["repeat"] = args.repeat
    if args.budgets:
        kwargs["budgets"] = tuple(_budget_item(b) for b in args.budgets.split(",") if b.strip())
    if args.compile:
        kwargs["compile_budgets"] = _compile_budgets(args.compile)
    log.info("benchmarking %s with %s", args.models, kwargs)
    with ui.progress(f"benchmarking {', '.join(args.models)}") as progress:
        report = bench.run_bench(args.models, progress=progress, **kwargs)
    if args.markdown:
        Path(args.markdown).write_text(report.markdown())
    if ui.json:
        ui.emit(report.to_dict())
    else:
        ui.show(Markdown(report.markdown()))
    if args.markdown:
        ui.say(f"Wrote the markdown report to {args.markdown}.")
    return 0


def _absolute_budget(text: str) -> int:
    from remat.planning.plan import parse_budget

    # A fraction needs the peak without checkpointing at each batch size: not a fixed limit.
    budget = parse_budget(text, 0)
    if budget <= 0:
        raise RematError(f"remat max-batch: --budget {text!r} is a fraction; give bytes such as 6GiB or 500MB.")
    return budget


def cmd_max_batch(args: argparse.Namespace, ui: Ui) -> int:
    _zoo_names([args.model], "max-batch")
    budget = _absolute_budget(args.budget)
    options = per_model_options([args.model], model_options(args), "max-batch")[args.model]
    from remat import bench

    kwargs: dict[str, Any] = {"options": options or None}
    if args.limit is not None:
        kwargs["limit"] = args.limit
    if args.strategies:
        kwargs["strategies"] = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    with ui.progress(f"largest batch of {args.model} within {args.budget}") as progress:
        result = bench.max_batch(args.model, budget, progress=progress, **kwargs)
    if ui.json:
        ui.emit(result.to_dict())
    else:
        ui.show(Markdown(result.markdown()))
    return 0
