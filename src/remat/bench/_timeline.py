"""The memory timeline picture: live bytes along one training step, from the profile's peak model.

NOTE [What the timeline draws]
``Profile.timeline`` walks the composed step segment by segment (NOTE [The peak model]):
for each it gives the live bytes at its start and the most live inside it. The picture
puts every segment one unit wide, in step order (forward, the loss, backward), and draws
a line from each segment's start to its top, so the line's highest point is exactly
``Profile.predict_peak`` for the same assignment: the picture shows the model's numbers,
not a second estimate. Each block's forward and backward segments get a shaded band; the
glue after the last block's forward (where the loss runs) and before the last block's
backward (the loss's backward) is the ``loss`` phase. Nested plans (``Plan.segments``) run
another walk (``remat.planning._nested``) that has no per-segment record, so they are refused.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from remat import Plan, Profile, RematError, parse_budget
from remat.core._typing import Budget
from remat.profiling._format import human_bytes

__all__ = ["Timeline", "plot_timeline", "timeline_of"]

_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))


@dataclass(frozen=True)
class Timeline:
    """One assignment's walk, ready to draw (x in segments, y in bytes)."""

    label: str
    xs: tuple[float, ...]
    live: tuple[int, ...]
    """The line's heights: a segment's start, then its top, for every segment in step order."""
    bands: tuple[tuple[str, str, int, int], ...]
    """(block, ``forward`` or ``backward``, first segment, last segment + 1)."""
    peak_bytes: int
    peak_block: str
    """The block whose segment sets the peak, or ``loss`` / ``input`` for glue."""
    peak_phase: str
    peak_x: float


def _assignment(plan: Plan | Mapping[str, str] | None) -> tuple[str, dict[str, str]]:
    if plan is None:
        return "none", {}
    if isinstance(plan, Plan):
        if plan.segments:
            raise RematError(
                f"remat.bench.plot_timeline: the plan checkpoints {len(plan.segments)} nested segment(s) of blocks, "
                "whose walk the per-segment timeline does not record (NOTE [What the timeline draws]); draw a "
                "one-level plan, e.g. remat.plan(profile, budget) with a budget above its lowest one-level peak."
            )
        return f"{plan.strategy} plan", dict(plan.assignment)
    return "plan", dict(plan)


def _places(walk: list[tuple[Any, int, int]]) -> list[tuple[str, str]]:
    """(block, phase) per segment; glue is ``input`` before the first block, ``loss`` after the last
    block's forward and before the first block's backward, else ``between blocks``."""
    fwd = [i for i, (k, _, _) in enumerate(walk) if k[0] == "fwd"]
    bwd = [i for i, (k, _, _) in enumerate(walk) if k[0] != "fwd"]
    in_fwd = [i for i in fwd if walk[i][0][1] is not None] or [len(walk)]
    in_bwd = [i for i in bwd if walk[i][0][1] is not None] or [len(walk)]
    out = []
    for i, (key, _, _) in enumerate(walk):
        phase = "forward" if key[0] == "fwd" else "backward"
        if key[1] is not None:
            out.append((key[1], phase))
        elif phase == "forward":
            out.append(("input" if i < in_fwd[0] else "loss" if i > in_fwd[-1] else "between blocks", phase))
        else:
            out.append(("loss" if i < in_bwd[0] else "between blocks", phase))
    return out


def timeline_of(profile: Profile, plan: Plan | Mapping[str, str] | None = None) -> Timeline:
    """The walk of ``plan`` (a Plan, block -> policy, or None for no checkpointing) on ``profile``."""
    label, assignment = _assignment(plan)
    walk = profile.timeline(assignment)
    xs: list[float] = []
    live: list[int] = []
    bands: list[tuple[str, str, int, int]] = []
    peak = (-1, "", "", 0.0)
    for i, ((key, start, top), (block, phase)) in enumerate(zip(walk, _places(walk))):
        if key[1] is not None:
            if bands and bands[-1][:2] == (key[1], phase) and bands[-1][3] == i:
                bands[-1] = (key[1], phase, bands[-1][2], i + 1)
            else:
                bands.append((key[1], phase, i, i + 1))
        xs += [i, i + 0.5]
        live += [start, top]
        if top > peak[0]:
            peak = (top, block, phase, i + 0.5)
    return Timeline(label, tuple(xs), tuple(live), tuple(bands), *peak)


def _unit(top: int) -> tuple[int, str]:
    return next((u, name) for u, name in _UNITS if top >= u or u == 1)


def plot_timeline(
    profile: Profile,
    plan: Plan | Mapping[str, str] | None = None,
    *,
    budget: Budget | None = None,
    path: str | pathlib.Path | None = None,
    compare: bool = True,
    measured: Mapping[str, int] | None = None,
) -> Any:
    """Live bytes along one training step: no checkpointing and ``plan`` on one figure.

    ``measured``: peaks measured in real steps (label -> bytes, e.g. from ``remat.doctor``), drawn as
    dotted lines beside the predicted walks.

    ``plan``: a :class:`remat.Plan` or block -> policy (None: no checkpointing alone).
    ``budget``: drawn as a horizontal line (bytes, ``"20GiB"`` or a fraction of the peak without
    checkpointing; default the plan's budget). ``compare``: also draw no checkpointing beside the plan.
    ``path``: save a PNG there. Returns the matplotlib ``Figure`` (close it with ``plt.close(fig)``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [timeline_of(profile, plan)]
    if plan is not None and compare:
        lines.insert(0, timeline_of(profile, None))
    if budget is None and isinstance(plan, Plan):
        budget = plan.budget_bytes
    limit = parse_budget(budget, profile.baseline_peak_bytes) if budget is not None else None
    measured = dict(measured or {})
    unit, unit_name = _unit(max([t.peak_bytes for t in lines] + list(measured.values())))
    fig, ax = plt.subplots(figsize=(max(6.0, min(14.0, len(lines[0].xs) / 6)), 4))
    _draw_bands(ax, lines[-1].bands, len(profile.blocks))
    backward = next((x for x, (k, _, _) in enumerate(profile.timeline({})) if k[0] != "fwd"), None)
    if backward is not None:
        ax.axvline(backward - 0.25, color="black", lw=0.6, ls=":")
        ax.annotate(
            "forward  |  backward",
            (backward - 0.25, 1),
            xycoords=("data", "axes fraction"),
            ha="center",
            va="top",
            fontsize=7,
            xytext=(0, -2),
            textcoords="offset points",
        )
    for t, colour in zip(lines, ("tab:gray", "tab:blue") if len(lines) == 2 else ("tab:blue",)):
        ax.plot(
            t.xs,
            [v / unit for v in t.live],
            color=colour,
            lw=1.5,
            label=f"{t.label} (peak {human_bytes(t.peak_bytes)})",
            gid=f"live:{t.label}",
        )
        ax.plot([t.peak_x], [t.peak_bytes / unit], "v", color=colour, ms=7)
        right = t.peak_x > 0.6 * len(t.xs) / 2  # keep the label inside the axes
        ax.annotate(
            f"peak: {t.peak_block}, {t.peak_phase}",
            (t.peak_x, t.peak_bytes / unit),
            fontsize=7,
            xytext=(-6 if right else 6, -10),
            textcoords="offset points",
            color=colour,
            ha="right" if right else "left",
        )
    for (label, peak), colour in zip(measured.items(), ("tab:gray", "tab:blue", "tab:purple", "tab:brown")):
        ax.axhline(
            peak / unit,
            color=colour,
            ls=":",
            lw=1,
            label=f"measured peak, {label} ({human_bytes(peak)})",
            gid=f"measured:{label}",
        )
    if limit is not None:
        ax.axhline(limit / unit, color="tab:red", ls="--", lw=1, label=f"budget {human_bytes(limit)}", gid="budget")
    ax.set_xlabel("segments of one training step: forward, loss, backward")
    ax.set_ylabel(f"live memory ({unit_name})")
    ax.set_title(f"{profile.model}: memory along one training step")
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.12)  # room for the legend and the phase label
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def _draw_bands(ax: Any, bands: tuple[tuple[str, str, int, int], ...], n_blocks: int) -> None:
    # Alternate two shades so neighbouring blocks stay apart; names only where they fit.
    for j, (block, phase, lo, hi) in enumerate(bands):
        ax.axvspan(
            lo - 0.1,
            hi - 0.4,
            color=("tab:green" if phase == "forward" else "tab:orange"),
            alpha=0.08 if j % 2 else 0.16,
            lw=0,
        )
        if n_blocks <= 16:
            ax.annotate(block, (lo, 0), xytext=(1, 2), textcoords="offset points", fontsize=6, rotation=90, va="bottom")
