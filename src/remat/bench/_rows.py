"""The rows the bench produces: one per setup of a model, and the max-batch result."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["BenchRow", "MaxBatchResult"]


@dataclass(frozen=True)
class BenchRow:
    """One setup of one model."""

    model: str
    setup: str
    kind: str
    """``baseline`` or ``remat``."""
    peak_bytes: int
    peak_ratio: float
    """Peak over the peak without checkpointing."""
    time_s: float
    """Median step time."""
    time_ratio: float
    """Median over rounds of step time over no checkpointing's step time in the same round."""
    grads_equal: bool
    """Every gradient ``torch.equal`` to no checkpointing's."""
    buffers_equal: bool
    """Every buffer (BatchNorm statistics ...) ``torch.equal`` after one step."""
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    predicted_overhead: float | None = None
    round_ratios: tuple[float, ...] = ()
    """Per timed round: step time over no checkpointing's in that round."""

    @property
    def predicted_error(self) -> float | None:
        if self.predicted_peak_bytes is None:
            return None
        return (self.predicted_peak_bytes - self.peak_bytes) / self.peak_bytes


@dataclass
class MaxBatchResult:
    """Largest batch whose measured step peak fits a budget, per strategy."""

    model: str
    budget_bytes: int
    batches: dict[str, int]
    """Strategy -> largest batch that fits (0: not even ``start``)."""
    peaks: dict[str, int]
    """Strategy -> measured peak at that batch."""
    tried: dict[str, list[int]]
    """Strategy -> batch sizes tried, in order."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def markdown(self) -> str:
        from remat.profiling._format import human_bytes

        base = self.batches.get("none") or 0
        lines = [
            f"Max batch for {self.model} under {human_bytes(self.budget_bytes)}:",
            "",
            "| strategy | max batch | x none | peak at that batch | batches tried |",
            "|---|---|---|---|---|",
        ]
        for s, b in self.batches.items():
            ratio = f"{b / base:.2f}" if base else "-"
            lines.append(f"| {s} | {b} | {ratio} | {human_bytes(self.peaks.get(s, 0))} | {self.tried[s]} |")
        return "\n".join(lines)
