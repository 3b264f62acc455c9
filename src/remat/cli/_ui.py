"""Where the command line writes: results on stdout (a rich table, or JSON and nothing
else with ``--json``), status spinners, progress bars and errors on stderr."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:  # the callback type only: the bench wing is imported when a command needs it
    from remat.bench._rounds import Progress as ProgressCallback

# Wide enough for the profile table when stdout is a pipe (rich would fall back to 80
# columns and truncate numbers); COLUMNS still wins.
_WIDTH = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "160"))


@dataclass
class Ui:
    """The consoles of one command, and whether it speaks JSON."""

    json: bool = False
    """``--json``: stdout carries one JSON document and nothing else."""
    quiet: bool = False
    """``-q``: no spinners or progress bars."""
    out: Console = field(default_factory=lambda: Console(width=_WIDTH, highlight=False))
    err: Console = field(default_factory=lambda: Console(stderr=True, highlight=False))

    def status(self, text: str) -> contextlib.AbstractContextManager[Any]:
        """A spinner on stderr while slow work runs (nothing under ``-q``)."""
        return contextlib.nullcontext() if self.quiet else self.err.status(escape(text))

    def say(self, text: str) -> None:
        """A line for the reader: stdout, or stderr when stdout is reserved for JSON."""
        (self.err if self.json else self.out).print(escape(text))

    def show(self, renderable: Any) -> None:
        """A table or other rich renderable on stdout (never called with ``--json``)."""
        self.out.print(renderable)

    def emit(self, data: Any) -> None:
        """The ``--json`` document."""
        sys.stdout.write(json.dumps(data, indent=1) + "\n")

    @contextlib.contextmanager
    def progress(self, title: str) -> Iterator[ProgressCallback]:
        """A progress bar on stderr fed by ``progress(description, completed, total)`` calls."""
        bar = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.err,
            transient=True,
            disable=self.quiet or not self.err.is_terminal,
        )
        task = bar.add_task(escape(title), total=None)

        def update(description: str, completed: int, total: int) -> None:
            bar.update(task, description=escape(description), completed=completed, total=total)

        with bar:
            yield update


def error_line(message: str) -> None:
    """One plain line on stderr: no rich wrapping, so scripts can grep it whole."""
    text = " ".join(message.split()).removeprefix("remat: ")
    sys.stderr.write(f"remat: error: {text}\n")


def warning_line(message: str) -> None:
    """One plain warning line on stderr (stdout stays the result's, JSON included)."""
    text = " ".join(message.split())
    sys.stderr.write(f"remat: warning: {text}\n")
