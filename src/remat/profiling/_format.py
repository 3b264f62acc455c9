"""Plain-text rendering of remat's results (the CLI adds colour with rich), and reading them back."""

from __future__ import annotations

import json
from typing import Any

from remat.errors import RematError


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def render(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join([_row(header, widths), _row(["-" * w for w in widths], widths), *(_row(r, widths) for r in rows)])


def load_versioned(text: str, *, what: str, schema: int | tuple[int, ...]) -> dict[str, Any]:
    """The JSON object ``to_json`` wrote, without its ``schema`` key; a RematError for anything else.

    ``schema``: the version this remat writes, or every version it reads (the newest last).
    """
    readable = schema if isinstance(schema, tuple) else (schema,)
    if not isinstance(text, (str, bytes, bytearray)):
        raise RematError(
            f"{what}: expects the JSON text (a str, e.g. Path(file).read_text()), got {type(text).__name__}."
        )
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RematError(f"{what}: not JSON ({exc}).") from None
    if not isinstance(data, dict):
        raise RematError(f"{what}: expected a JSON object, got {type(data).__name__}.")
    if data.get("schema") not in readable:
        raise RematError(
            f"{what}: schema {data.get('schema')!r} is not supported; this remat reads "
            f"{' and '.join(map(str, readable))}."
        )
    data.pop("schema")
    return data
