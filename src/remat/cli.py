"""The ``remat`` command line. Each command: a parser function and a command function;
numbers come from the library, this module only renders them."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from remat._format import human_bytes
from remat.errors import RematError

# Wide enough for the tables when stdout is a pipe (rich would fall back to 80 columns).
_console = Console(width=None if sys.stdout.isatty() else 120)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the seed 000 CNN: remat vs no checkpointing vs the seed's reentrant bug")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.set_defaults(command=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from remat._demo import run_demo

    with _console.status("training the seed 000 CNN three ways ..."):
        variants = run_demo(batch=args.batch, steps=args.steps)
    ref = variants[0]
    table = Table(title=f"seed 000 CIFAR-10 CNN, batch {args.batch}, {args.steps} SGD steps")
    for col in ("variant", "peak", "step time", "grads ok", "frozen params", "final loss", "losses == reference"):
        table.add_column(col)
    for v in variants:
        table.add_row(
            v.name,
            human_bytes(v.measurement.peak_bytes),
            f"{v.measurement.step_time_s * 1e3:.0f} ms ({v.measurement.step_time_s / ref.measurement.step_time_s:.2f}x)",
            "yes" if v.measurement.grads_ok else f"no: {len(v.measurement.missing_grads)} missing",
            str(len(v.frozen)),
            f"{v.losses[-1]:.4f}",
            "yes (bit-equal)" if v.losses == ref.losses else "NO",
        )
    _console.print(table)
    remat_ok = variants[1].losses == ref.losses and not variants[1].frozen
    bug = variants[2]
    _console.print(
        f"remat: loss sequence bit-equal to no checkpointing: {'yes' if remat_ok else 'NO'}. "
        f"Reentrant torch checkpoint: {len(bug.frozen)} parameters never trained "
        f"({', '.join(bug.frozen) or 'none'})."
    )
    return 0 if remat_ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remat", description=__doc__)
    parser.add_argument("-v", "--verbose", action="count", default=0)
    parser.add_argument("-q", "--quiet", action="store_true")
    sub = parser.add_subparsers(dest="name", required=True)
    _add_demo(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.ERROR if args.quiet else (logging.DEBUG if args.verbose > 1 else logging.INFO if args.verbose else logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.command(args)
    except RematError as exc:
        _console.print(f"[red]error:[/red] {exc}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
