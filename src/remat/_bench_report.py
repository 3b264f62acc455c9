"""Turning bench rows into the markdown table, the target checks and the Pareto plots."""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING

from remat._format import human_bytes

if TYPE_CHECKING:
    from remat.bench import BenchReport, BenchRow


def _yes(flag: bool) -> str:
    return "yes" if flag else "**no**"


def _row(r: BenchRow) -> str:
    predicted = "" if r.predicted_peak_bytes is None else f"{human_bytes(r.predicted_peak_bytes)} ({r.predicted_error:+.1%})"
    overhead = "" if r.predicted_overhead is None else f"{1 + r.predicted_overhead:.2f}x"
    return (f"| {r.setup} | {human_bytes(r.peak_bytes)} | {r.peak_ratio:.2f} | {r.time_s * 1e3:.0f} ms | "
            f"{r.time_ratio:.2f}x | {_yes(r.grads_equal)} | {_yes(r.buffers_equal)} | {predicted} | {overhead} |")


def targets(rows: list[BenchRow]) -> list[str]:
    """The issue's targets, checked on one model's rows, as sentences with the numbers."""
    base = [r for r in rows if r.kind == "baseline"]
    ours = [r for r in rows if r.kind == "remat"]
    none = next(r for r in base if r.setup == "none")
    out = []
    for b in base[1:]:
        match = [r for r in ours if r.peak_bytes <= b.peak_bytes and r.time_ratio <= b.time_ratio]
        best = min(match, key=lambda r: r.time_ratio, default=None)
        out.append(f"{b.setup} ({b.peak_ratio:.2f} peak, {b.time_ratio:.2f}x): " + (
            f"matched by {best.setup} ({best.peak_ratio:.2f}, {best.time_ratio:.2f}x)" if best
            else "**not matched** by any remat point"))
    for r in ours:
        if r.budget_bytes and 0.6 <= r.budget_bytes / none.peak_bytes <= 0.9 and "remat 0" in r.setup:
            fitting = [b for b in base if b.peak_bytes <= r.budget_bytes]
            if fitting:
                cheapest = min(fitting, key=lambda b: b.time_ratio)
                ok = (r.time_ratio - 1) <= 0.5 * max(cheapest.time_ratio - 1, 0)
                out.append(f"{r.setup}: overhead {r.time_ratio - 1:+.2f} vs cheapest fitting baseline "
                           f"{cheapest.setup} {cheapest.time_ratio - 1:+.2f} -> {'at most half' if ok else '**more than half**'}")
    dominated = [r.setup for r in ours for b in base if b.peak_bytes < r.peak_bytes and b.time_ratio < r.time_ratio]
    out.append("remat points dominated by a baseline: " + (", ".join(sorted(set(dominated))) or "none"))
    fractions = sorted((r for r in ours if "remat 0" in r.setup or "remat min" in r.setup),
                       key=lambda r: -(r.budget_bytes or 0))
    rising = [f"{a.setup} -> {b.setup}" for a, b in zip(fractions, fractions[1:]) if b.peak_bytes > a.peak_bytes]
    out.append("measured peak rises as the budget falls: " + (", ".join(rising) or "never"))
    worst = max((abs(r.predicted_error) for r in ours), default=0.0)
    out.append(f"largest predicted-vs-measured peak error: {worst:.2%}")
    return out


def markdown(report: BenchReport) -> str:
    meta = report.meta
    lines = [f"Run {meta['date']}, torch {meta['torch']}, {meta['machine']}, {meta['threads']} threads, "
             f"{meta['sizes']}. Command: `{meta['command']}`.", ""]
    for model in dict.fromkeys(r.model for r in report.rows):
        rows = [r for r in report.rows if r.model == model]
        lines += [f"### {model}", "",
                  "| setup | peak | x none | step | x none | grads equal | buffers equal | predicted peak (error) | predicted time |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [_row(r) for r in rows]
        lines += ["", *[f"- {t}" for t in targets(rows)], *[f"- {n}" for n in report.notes.get(model, [])], ""]
    return "\n".join(lines)


def plot(report: BenchReport, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """One Pareto plot per model: peak vs step time, baselines as points, remat's plans as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for model in dict.fromkeys(r.model for r in report.rows):
        rows = [r for r in report.rows if r.model == model]
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in (r for r in rows if r.kind == "baseline"):
            ax.scatter(r.peak_bytes / 2**20, r.time_ratio, s=40, zorder=3)
            ax.annotate(r.setup, (r.peak_bytes / 2**20, r.time_ratio), fontsize=7, xytext=(4, 4),
                        textcoords="offset points")
        ours = sorted((r for r in rows if r.kind == "remat"), key=lambda r: r.peak_bytes)
        ax.plot([r.peak_bytes / 2**20 for r in ours], [r.time_ratio for r in ours], "o-", color="black",
                label="remat plans", zorder=2)
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
