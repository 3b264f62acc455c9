"""The bench report (:class:`BenchReport`): its markdown table, the target checks and the Pareto plots.

NOTE [Comparing two noisy step times]
Two setups are compared on their per-round differences (both ran in every
round), in units of no checkpointing's step time: the median difference, and a
90% bootstrap interval of that median. A target counts as met when the median
difference is on the right side; when it is not but the interval reaches zero,
the report says the two are within noise, with the numbers, rather than
calling a winner that another run could reverse.
"""

from __future__ import annotations

import pathlib
import random
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from remat.bench._rows import BenchRow
from remat.profiling._format import human_bytes


@dataclass
class BenchReport:
    """Rows of every model, and what was run where."""

    rows: list[BenchRow]
    meta: dict[str, str]
    notes: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "notes": self.notes,
            "rows": [{**asdict(r), "predicted_error": r.predicted_error} for r in self.rows],
        }

    def markdown(self) -> str:
        return markdown(self)


def _yes(flag: bool) -> str:
    return "yes" if flag else "**no**"


def _row(r: BenchRow, none: BenchRow) -> str:
    predicted = (
        "" if r.predicted_peak_bytes is None else f"{human_bytes(r.predicted_peak_bytes)} ({r.predicted_error:+.1%})"
    )
    overhead = "" if r.predicted_overhead is None else f"{1 + r.predicted_overhead:.2f}x"
    _, lo, hi = paired_difference(r, none)
    spread = "" if r is none else f" [{1 + lo:.2f}, {1 + hi:.2f}]"
    return (
        f"| {r.setup} | {human_bytes(r.peak_bytes)} | {r.peak_ratio:.2f} | {r.time_s * 1e3:.0f} ms | "
        f"{r.time_ratio:.2f}x{spread} | {_yes(r.grads_equal)} | {_yes(r.buffers_equal)} | {predicted} | "
        f"{overhead} |"
    )


def paired_difference(
    a: BenchRow, b: BenchRow, *, share: float = 1.0, resamples: int = 2000
) -> tuple[float, float, float]:
    """Median over rounds of ``a``'s overhead minus ``share`` times ``b``'s (in units of no
    checkpointing's step time), and its 90% bootstrap interval."""
    diffs = [(x - 1) - share * (y - 1) for x, y in zip(a.round_ratios, b.round_ratios)]
    if not diffs:
        d = (a.time_ratio - 1) - share * (b.time_ratio - 1)
        return d, d, d
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(resamples))
    return statistics.median(diffs), medians[int(0.05 * resamples)], medians[int(0.95 * resamples) - 1]


def _vs(d: tuple[float, float, float]) -> str:
    return f"{d[0]:+.2f} [{d[1]:+.2f}, {d[2]:+.2f}]"


def _verdict(d: tuple[float, float, float], met: str, close: str, missed: str) -> str:
    """``met`` when the median difference is not above zero, ``close`` when its interval reaches zero."""
    return met if d[0] <= 0 else close if d[1] <= 0 else missed


def _baseline_points(base: list[BenchRow], ours: list[BenchRow]) -> list[str]:
    out = []
    for b in base[1:]:
        fitting = [(r, paired_difference(r, b)) for r in ours if r.peak_bytes <= b.peak_bytes]
        head = f"{b.setup} ({b.peak_ratio:.2f} peak, {b.time_ratio:.2f}x): "
        if not fitting:
            out.append(head + "**not matched**: no remat point reaches its peak")
            continue
        r, d = min(fitting, key=lambda x: x[1][0])
        out.append(
            head + f"{_verdict(d, 'matched by', 'within noise of', '**not matched** by')} {r.setup} "
            f"({r.peak_ratio:.2f} peak, {r.time_ratio:.2f}x; time vs it {_vs(d)})"
        )
    return out


def _dominated(base: list[BenchRow], ours: list[BenchRow], *, by: str = "a baseline") -> str:
    found, close = [], []
    for r in ours:
        for b in base:
            if b.peak_bytes < r.peak_bytes:
                d = paired_difference(r, b)
                kind = _verdict(d, "not slower", "slower within noise", "slower")
                if kind == "slower":
                    found.append(f"{r.setup} by {b.setup} (time {_vs(d)})")
                elif kind == "slower within noise":
                    close.append(f"{r.setup} vs {b.setup} ({_vs(d)})")
    text = f"remat points dominated by {by}: " + ("; ".join(found) or "none")
    return text + (f" (slower within noise: {'; '.join(close)})" if close else "")


def targets(rows: list[BenchRow]) -> list[str]:
    """The issue's targets, checked on one model's rows, as sentences with the numbers."""
    base = [r for r in rows if r.kind == "baseline"]
    ours = [r for r in rows if r.kind == "remat"]
    none = next(r for r in base if r.setup == "none")
    out = _baseline_points(base, ours)
    for r in ours:
        if r.budget_bytes and 0.6 <= r.budget_bytes / none.peak_bytes <= 0.9 and "remat 0" in r.setup:
            fitting = [b for b in base if b.peak_bytes <= r.budget_bytes]
            if fitting:
                cheapest = min(fitting, key=lambda b: b.time_ratio)
                d = paired_difference(r, cheapest, share=0.5)
                verdict = _verdict(d, "at most half", "more than half, within noise", "**more than half**")
                out.append(
                    f"{r.setup}: overhead {r.time_ratio - 1:+.2f} vs cheapest fitting baseline "
                    f"{cheapest.setup} {cheapest.time_ratio - 1:+.2f} -> {verdict} "
                    f"(overhead minus half of it: {_vs(d)})"
                )
    out.append(_dominated(base, ours))
    fractions = sorted(
        (r for r in ours if "remat 0" in r.setup or "remat min" in r.setup), key=lambda r: -(r.budget_bytes or 0)
    )
    rising = [f"{a.setup} -> {b.setup}" for a, b in zip(fractions, fractions[1:]) if b.peak_bytes > a.peak_bytes]
    out.append("measured peak rises as the budget falls: " + (", ".join(rising) or "never"))
    worst = max((abs(e) for r in ours if (e := r.predicted_error) is not None), default=0.0)
    out.append(f"largest predicted-vs-measured peak error: {worst:.2%}")
    compiled = [r for r in rows if r.kind == "compile"]
    if compiled:  # another execution (fused kernels), so kept apart from the eager baselines above
        out += [f"torch.compile point {line}" for line in _baseline_points([none, *compiled], ours)]
        out.append(_dominated(compiled, ours, by="a torch.compile point"))
    return out


def markdown(report: BenchReport) -> str:
    meta = report.meta
    lines = [
        f"Run {meta['date']}, torch {meta['torch']}, {meta['machine']}, {meta['threads']} threads, "
        f"{meta['sizes']}. Command: `{meta['command']}`.",
        "",
        "Step time: median over interleaved rounds (shuffled order) of the ratio to no checkpointing in the "
        "same round; [90%]: bootstrap interval of that median. Comparisons below use per-round differences "
        "(median [90% interval], in units of no checkpointing's step).",
        "",
    ]
    for model in dict.fromkeys(r.model for r in report.rows):
        rows = [r for r in report.rows if r.model == model]
        none = next(r for r in rows if r.setup == "none")
        lines += [
            f"### {model}",
            "",
            "| setup | peak | x none | step | x none [90%] | grads equal | buffers equal "
            "| predicted peak (error) | predicted time |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [_row(r, none) for r in rows]
        lines += ["", *[f"- {t}" for t in targets(rows)], *[f"- {n}" for n in report.notes.get(model, [])], ""]
    return "\n".join(lines)


#: Per kind of non-remat row: marker style and label offset (baselines filled dots, torch.compile open squares).
_POINT_STYLE: dict[str, tuple[dict[str, Any], tuple[int, int]]] = {
    "baseline": ({"fmt": "o"}, (4, 4)),
    "compile": ({"fmt": "s", "mfc": "white"}, (4, -8)),
}


def _error_bars(rs: list[BenchRow], none: BenchRow) -> list[list[float]]:
    """matplotlib's ``yerr`` for ``rs``: how far below and above each time ratio its 90% interval reaches."""
    spans = [paired_difference(r, none) for r in rs]
    return [[d - lo for d, lo, _ in spans], [hi - d for d, _, hi in spans]]


def plot(report: BenchReport, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """One Pareto plot per model: peak vs step time, baselines as points, remat's plans as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for model in dict.fromkeys(r.model for r in report.rows):
        rows = [r for r in report.rows if r.model == model]
        none = next(r for r in rows if r.setup == "none")
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in (r for r in rows if r.kind in _POINT_STYLE):
            style, offset = _POINT_STYLE[r.kind]
            ax.errorbar(
                r.peak_bytes / 2**20, r.time_ratio, yerr=_error_bars([r], none), ms=6, capsize=3, zorder=3, **style
            )
            ax.annotate(
                r.setup, (r.peak_bytes / 2**20, r.time_ratio), fontsize=7, xytext=offset, textcoords="offset points"
            )
        ours = sorted((r for r in rows if r.kind == "remat"), key=lambda r: r.peak_bytes)
        ax.errorbar(
            [r.peak_bytes / 2**20 for r in ours],
            [r.time_ratio for r in ours],
            yerr=_error_bars(ours, none),
            fmt="o-",
            color="black",
            capsize=3,
            label="remat plans (bars: 90% interval)",
            zorder=2,
        )
        ax.set_xlabel("peak memory of a training step (MiB)")
        ax.set_ylabel("step time / no checkpointing")
        ax.set_title(f"{model}: memory vs time")
        ax.legend(loc="upper right")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"pareto-{model}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
