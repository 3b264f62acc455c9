"""The one writer of BENCHMARKS.md: each script owns the sections between its markers.

A script records what it prints and, asked to (``--write``), puts it into BENCHMARKS.md between

    <!-- benchmarks/NAME.py writes from here -->
    <!-- benchmarks/NAME.py wrote up to here -->

(``<!-- benchmarks/NAME.py (PART) writes from here -->`` where one script writes several sections, e.g.
one per model), under a heading and a line with the command, the date, the device and torch. A section
already there is replaced in place; a new one goes at the end. Nothing else in the file is touched, so
every figure in BENCHMARKS.md comes from the script named around it (``tests/test_benchmarks_doc.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import platform
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "BENCHMARKS.md"

#: A section's first and last lines; group 1 is the script's path, group 2 the part (or None).
BEGIN = re.compile(r"^<!-- (benchmarks/[\w.-]+\.py)(?: \(([^)]*)\))? writes from here -->$")
END = re.compile(r"^<!-- (benchmarks/[\w.-]+\.py)(?: \(([^)]*)\))? wrote up to here -->$")


def markers(script: str, part: str | None = None) -> tuple[str, str]:
    """The first and last lines of ``script``'s section (``script``: a path or ``__file__``)."""
    name = f"benchmarks/{Path(script).name}" + (f" ({part})" if part else "")
    return f"<!-- {name} writes from here -->", f"<!-- {name} wrote up to here -->"


def command_line() -> str:
    """How this process was started, as a reader would type it from the repository's root."""
    env = " ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS",) if k in os.environ)
    script = f"benchmarks/{Path(sys.argv[0]).name}"
    return " ".join(filter(None, [env, "PYTHONPATH=src python", script, shlex.join(sys.argv[1:])]))


def device(cuda: bool = False) -> str:
    """The device the figures were taken on, with the machine's load when the run started (a shared CPU)."""
    if cuda:
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{platform.machine()} CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s), "
        f"load average {load:.1f} at the start"
    )


def header(title: str, *, cuda: bool = False) -> list[str]:
    """The heading and the line every section starts with: command, date, device, torch."""
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    return [
        f"## {title}",
        "",
        f"Command: `{command_line()}`. Run {today} on {device(cuda)}; torch {torch.__version__}.",
        "",
    ]


def replace(text: str, section: str, script: str, part: str | None = None) -> str:
    """``text`` with ``script``'s section (``part``) replaced by ``section`` (its markers added)."""
    begin, end = markers(script, part)
    own = f"{begin}\n{section.rstrip()}\n{end}\n"
    if begin in text and end in text:
        return text[: text.index(begin)] + own + text[text.index(end) + len(end) + 1 :]
    return text.rstrip("\n") + "\n\n" + own if text.strip() else own


def write(script: str, lines: list[str], *, part: str | None = None, path: Path = BENCHMARKS) -> None:
    """Put ``lines`` (a header's and a body's) into ``path`` as ``script``'s section."""
    old = path.read_text() if path.exists() else ""
    path.write_text(replace(old, "\n".join(lines), script, part))


class _Tee(io.TextIOBase):
    def __init__(self, out: io.TextIOBase) -> None:
        self.out, self.kept = out, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def recorded(
    script: str, title: str, *, write_to: Path | None, part: str | None = None, cuda: bool = False
) -> Iterator[None]:
    """Everything printed inside, also kept; with ``write_to``, written there as ``script``'s section when the
    block ends without an error (a failed run leaves the old section as it was)."""
    head = header(title, cuda=cuda)  # the load average before the run, not after
    tee = _Tee(sys.stdout)  # type: ignore[arg-type]
    with contextlib.redirect_stdout(tee):  # type: ignore[type-var]
        yield
    if write_to is not None:
        write(script, [*head, tee.kept.getvalue().strip("\n")], part=part, path=write_to)
        print(f"wrote {markers(script, part)[0]} into {write_to}", file=sys.stderr)


def add_write_option(parser) -> None:  # noqa: ANN001  (an argparse parser)
    parser.add_argument(
        "--write",
        nargs="?",
        const=BENCHMARKS,
        type=Path,
        metavar="FILE",
        help="also write the output into BENCHMARKS.md (or FILE) between this script's markers",
    )
