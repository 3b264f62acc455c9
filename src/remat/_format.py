"""Plain-text rendering of remat's results (the CLI adds colour with rich), and reading them back."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from remat.errors import RematError

if TYPE_CHECKING:
    from remat.profile import Profile


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


def profile_table(p: Profile) -> str:
    header = ["block", "in", "out", "saved keep", "saved sel", "saved full", "fwd ms", "bwd ms",
              "+ms sel", "+ms full", "GFLOP fwd", "peak if full"]
    base = p.baseline_peak_bytes
    rows = []
    for b in p.blocks:
        alone = p.predict_peak({b.name: "full"}) if "full" in p.policies else base
        rows.append([
            b.name, human_bytes(b.input_bytes), human_bytes(b.output_bytes),
            *(human_bytes(b.saved_bytes.get(k, 0)) if k in b.saved_bytes else "-" for k in ("keep", "selective", "full")),
            f"{b.fwd_time_s * 1e3:.1f}", f"{b.bwd_time_s * 1e3:.1f}",
            *(f"{b.extra_time_s[k] * 1e3:.1f}" if k in b.extra_time_s else "-" for k in ("selective", "full")),
            f"{b.fwd_flops / 1e9:.2f}", f"{(alone - base) / base:+.1%}",
        ])
    kind = f"fake tensors, times modelled for {p.target}" if p.fake else f"measured on {p.device}"
    summary = (
        f"{p.model}: {len(p.blocks)} blocks, {kind}. Resting {human_bytes(p.resting_bytes)} "
        f"(parameters {human_bytes(p.param_bytes)}), gradients {human_bytes(p.grad_bytes)}, "
        f"peak without checkpointing {human_bytes(base)}, step {p.step_time_s * 1e3:.0f} ms."
    )
    return "\n".join([summary, render(header, rows), *p.notes])


def load_versioned(text: str, *, what: str, schema: int) -> dict[str, Any]:
    """The JSON object ``to_json`` wrote, without its ``schema`` key; a RematError for anything else."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RematError(f"{what}: not JSON ({exc}).") from None
    if not isinstance(data, dict):
        raise RematError(f"{what}: expected a JSON object, got {type(data).__name__}.")
    if data.get("schema") != schema:
        raise RematError(f"{what}: schema {data.get('schema')!r} is not supported; this remat reads {schema}.")
    data.pop("schema")
    return data
