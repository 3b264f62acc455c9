"""remat beside rotor v1.0 on rotor's own input: flat ``nn.Sequential`` chains, in one run.

Two chains, each one flat ``nn.Sequential`` that rotor's ``Checkpointable`` takes as it is:

* ``conv``: a conv chain of single layers (a stem, then Conv2d, BatchNorm2d, ReLU per block), the
  ``conv-flat`` chain of ``benchmarks/nested.py`` at smaller sizes;
* ``gpt``: a GPT-2-like stack written by this script, fed the embedding output: per layer a causal
  attention half (LayerNorm, attention, residual) and an MLP half (LayerNorm, Linear, GELU, Linear,
  residual), each one module with one tensor in and out, then a final LayerNorm and the head. The
  residuals make a half the smallest piece a chain can hold; no ``transformers`` model is used.

Per chain: the peak without checkpointing; rotor's floor (the lowest ``mem_limit`` its ``persistent``
schedule accepts, found by bisection) and remat's floor (``remat.plan(prof, strategy="none")``), both
measured; then at rotor's measured peak for a few ``mem_limit`` values (its floor and points between it
and no checkpointing) the step time of rotor's schedule and of ``remat.plan(prof, that peak)``, medians
of interleaved rounds after a warm-up round, as ratios to the step without checkpointing (min-max over
rounds), with both measured peaks. Every peak is ``remat.measure``'s (the storage tracker), the same
counter for both. Both steps take the input with ``requires_grad=True``: rotor's autograd function
needs a differentiable input, so the un-checkpointed and remat's steps take the same.

Rotor is not part of remat and is not installed: ``--rotor DIR`` names a directory holding rotor v1.0's
``rotor/`` package, extracted from the rockmate repository (tag ``v1.0``), e.g.

    git --git-dir=ROCKMATE.git archive v1.0 rotor | tar -x -C /work/rotor-v1.0
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/rotor_side.py --rotor /work/rotor-v1.0 [--rounds 5] [--write]

Without it the script says so and exits with status 2.

NOTE [How rotor is run on a CPU here]
Rotor v1.0 runs as released, with two changes made from this script at run time (``_patch_rotor``):
its memory meter (``rotor.memory.MeasureMemory``) reads, off CUDA, the process RSS, which allocator
caching makes meaningless for one layer's tensors; it is patched to read remat's storage tracker
(``remat.core._memtrack.StorageTracker``) instead, one tracker running through rotor's whole
per-layer measurement (``rotor.inspection.measure_everything``), so that frees of earlier layers'
tensors count as on CUDA's ``memory_allocated``. Its timer on CPU is already ``time.perf_counter``
(``TimerSys``); ``make_timer`` is pinned to it. Its C dynamic program is not built: schedules come
from its Python one (``force_python=True``), the same tables. The tracker's per-op cost is inside
rotor's layer times (remat's profile times its blocks the same way).
"""

from __future__ import annotations

import argparse
import importlib
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _sections
import torch
from torch import nn
from torch.nn import functional as F

import remat
from remat.core._memtrack import StorageTracker
from remat.errors import RematError

MiB = 2**20


class AttentionHalf(nn.Module):
    """x + attention(LayerNorm(x)), causal."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLPHalf(nn.Module):
    """x + Linear(GELU(Linear(LayerNorm(x))))."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.act(self.fc(self.ln(x))))


def conv_chain(channels: int, blocks: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1)]
    for _ in range(blocks):
        layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
    return nn.Sequential(*layers)


def gpt_chain(dim: int, heads: int, layers: int, vocab: int) -> nn.Sequential:
    halves: list[nn.Module] = []
    for _ in range(layers):
        halves += [AttentionHalf(dim, heads), MLPHalf(dim)]
    return nn.Sequential(*halves, nn.LayerNorm(dim), nn.Linear(dim, vocab))


def _setup(name: str) -> tuple[str, nn.Sequential, torch.Tensor, Any]:
    torch.manual_seed(0)
    if name == "conv":
        model = conv_chain(channels=32, blocks=8)
        x = torch.randn(8, 3, 32, 32, requires_grad=True)
        return "conv chain (25 single layers, 32 ch, 32x32, batch 8)", model, x, None
    dim, seq, batch, vocab = 128, 128, 4, 512
    model = gpt_chain(dim, heads=4, layers=4, vocab=vocab)
    x = torch.randn(batch, seq, dim, requires_grad=True)  # the embedding output
    targets = torch.randint(vocab, (batch * seq,))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab), targets)

    title = f"GPT-2-like chain (4 layers as 8 residual halves + LayerNorm + head, dim {dim}, seq {seq}, batch {batch})"
    return title, model, x, loss_fn


def _load_rotor(path: Path | None) -> Any:
    if path is None or not (path / "rotor" / "rotor.py").is_file():
        where = "no --rotor given" if path is None else f"{path}/rotor/rotor.py does not exist"
        print(
            f"rotor_side.py: rotor v1.0 is not available ({where}). Extract its package from the rockmate "
            "repository (git archive v1.0 rotor | tar -x -C DIR) and pass --rotor DIR.",
            file=sys.stderr,
        )
        sys.exit(2)
    sys.path.insert(0, str(path))
    rotor = importlib.import_module("rotor")
    _patch_rotor(rotor)
    return rotor


_TRACKERS: list[StorageTracker] = []


def _patch_rotor(rotor: Any) -> None:
    """NOTE [How rotor is run on a CPU here]."""
    memory, inspection, timing = rotor.memory, rotor.inspection, rotor.timing
    meter, measure_everything = memory.MeasureMemory, inspection.measure_everything
    cuda_current, cuda_max, cuda_reset = meter.currentValue, meter.maximumValue, meter.resetMax

    def tracker() -> StorageTracker:
        if not _TRACKERS:
            raise RuntimeError("rotor measured memory outside measure_everything; this script has no tracker there")
        return _TRACKERS[-1]

    def current(self: Any) -> int:
        return cuda_current(self) if self.cuda else tracker().current

    def maximum(self: Any) -> Any:
        return cuda_max(self) if self.cuda else memory.MemSize(tracker().peak)

    def reset(self: Any) -> None:
        if self.cuda:
            cuda_reset(self)
        else:
            t = tracker()
            t.peak = t.current

    def tracked(named_modules: list, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        known = [t for _, m in named_modules for t in (*m.parameters(), *m.buffers())] + [x]
        with StorageTracker(known=known) as t:
            _TRACKERS.append(t)
            try:
                return measure_everything(named_modules, x, *args, **kwargs)
            finally:
                _TRACKERS.pop()

    meter.currentValue, meter.maximumValue, meter.resetMax = current, maximum, reset
    inspection.measure_everything = tracked
    timing.make_timer = lambda device: timing.TimerSys()


def _rotor_sequence(ckpt: Any, limit: int) -> Any | None:
    """Rotor's persistent schedule within ``limit`` bytes of activations, or None where it has none."""
    try:
        ckpt.compute_sequence(mem_limit=limit, force_python=True)
    except ValueError:
        return None
    return ckpt.sequence


def _rotor_floor(ckpt: Any, top: int) -> int:
    """The lowest ``mem_limit`` (to 0.5% of ``top``) rotor finds a schedule within."""
    lo, hi = 0, top
    while hi - lo > top // 200:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _rotor_sequence(ckpt, mid) is not None else (mid, hi)
    return hi


def _peak(module: nn.Module, x: torch.Tensor, loss_fn: Any) -> int:
    return remat.measure(module, x, loss_fn, repeat=1, warmup=1).peak_bytes


def _step(module: nn.Module, model: nn.Module, x: torch.Tensor, loss_fn: Any) -> float:
    start = time.perf_counter()
    out = module(x)
    (loss_fn(out) if loss_fn is not None else out.sum()).backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    x.grad = None
    return seconds


def _grads(module: nn.Module, model: nn.Module, x: torch.Tensor, loss_fn: Any) -> list[torch.Tensor]:
    """The gradients of one step (parameters', then the input's); the model's are cleared again."""
    out = module(x)
    (loss_fn(out) if loss_fn is not None else out.sum()).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    grads.append(x.grad.clone())
    model.zero_grad(set_to_none=True)
    x.grad = None
    return grads


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def _side(name: str, rotor: Any, rounds: int, points: int) -> None:
    title, model, x, loss_fn = _setup(name)
    model.train()
    base = _peak(model, x, loss_fn)
    start = time.perf_counter()
    prof = remat.profile(model, x, loss_fn)
    profiled = time.perf_counter() - start
    start = time.perf_counter()
    ckpt = rotor.Checkpointable(model, x, force_python=True)
    measured = time.perf_counter() - start
    ckpt.compute_pytorch_sequence()
    top = ckpt.get_expected_memory()  # rotor's activation bytes without checkpointing
    floor_limit = _rotor_floor(ckpt, top)
    limits = [floor_limit + (top - floor_limit) * i // points for i in range(points)]
    print(
        f"{title}: {len(ckpt.functions)} layers for rotor, {len(prof.blocks)} units for remat; remat profiled in "
        f"{profiled:.1f} s, rotor measured in {measured:.1f} s. Peak without checkpointing {base / MiB:.2f} MiB."
    )
    lowest = remat.plan(prof, strategy="none")
    remat.apply(model, remat.plan(prof, lowest.min_peak_bytes))
    remat_floor = _peak(model, x, loss_fn)
    remat.remove(model)
    runs: list[tuple[int, Any, int, remat.Plan | None, int | None]] = []
    reference, exact = _grads(model, model, x, loss_fn), {"rotor": True, "remat": True}
    for limit in limits:
        ckpt.sequence = _rotor_sequence(ckpt, limit)
        if ckpt.sequence is None:  # its memory grid is coarser at some limits than at others
            continue
        rotor_peak = _peak(ckpt, x, loss_fn)
        exact["rotor"] &= _same(_grads(ckpt, model, x, loss_fn), reference)
        try:
            plan: remat.Plan | None = remat.plan(prof, rotor_peak)
        except RematError:
            plan = None
        remat_peak = None
        if plan is not None:
            remat.apply(model, plan)
            remat_peak = _peak(model, x, loss_fn)
            exact["remat"] &= _same(_grads(model, model, x, loss_fn), reference)
            remat.remove(model)
        runs.append((limit, ckpt.sequence, rotor_peak, plan, remat_peak))
    print(
        f"Floors: rotor {runs[0][2] / MiB:.2f} MiB ({runs[0][2] / base:.3f} of the peak; mem_limit "
        f"{floor_limit / MiB:.2f} MiB of activations), remat {remat_floor / MiB:.2f} MiB ({remat_floor / base:.3f};"
        f" predicted {lowest.min_peak_bytes / MiB:.2f} MiB). Gradients (parameters' and the input's) torch.equal"
        f" to no checkpointing at every point below: rotor {_yes(exact['rotor'])}, remat {_yes(exact['remat'])}."
    )
    print()
    _timed(model, ckpt, x, loss_fn, runs, base, rounds)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _timed(model: nn.Module, ckpt: Any, x: torch.Tensor, loss_fn: Any, runs: list, base: int, rounds: int) -> None:
    times: dict[tuple[str, int], list[float]] = {}
    order = random.Random(0)
    contenders = [(("none", 0), model, None)] + [
        item for i, run in enumerate(runs) for item in _contenders(i, run, model, ckpt)
    ]
    for r in range(rounds + 1):  # round 0 warms up; every round times each setup once, in a shuffled order
        order.shuffle(contenders)
        for key, module, setup in contenders:
            remat.remove(model)
            if setup is not None:
                setup()
            seconds = _step(module, model, x, loss_fn)
            if r:
                times.setdefault(key, []).append(seconds)
    remat.remove(model)
    plain = times[("none", 0)]
    ref = statistics.median(plain)
    print(f"Step without checkpointing: {ref * 1000:.1f} ms (median of {rounds}).")
    print()
    print(
        "| rotor mem_limit MiB | rotor peak MiB (of peak) | rotor time | remat peak MiB (of peak) | remat time "
        "| remat / rotor time |"
    )
    print("|---|---|---|---|---|---|")

    def ratio(key: tuple[str, int]) -> str:
        if key not in times:
            return "no plan"
        r = [a / b for a, b in zip(times[key], plain)]
        return f"{statistics.median(times[key]) / ref:.2f}x ({min(r):.2f}-{max(r):.2f})"

    def versus(i: int) -> str:
        if ("remat", i) not in times:
            return "-"
        r = [a / b for a, b in zip(times[("remat", i)], times[("rotor", i)])]
        return f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})"

    for i, (limit, _, rotor_peak, _, remat_peak) in enumerate(runs):
        remat_text = "over rotor's peak" if remat_peak is None else f"{remat_peak / MiB:.2f} ({remat_peak / base:.3f})"
        print(
            f"| {limit / MiB:.2f} | {rotor_peak / MiB:.2f} ({rotor_peak / base:.3f}) | {ratio(('rotor', i))} | "
            f"{remat_text} | {ratio(('remat', i))} | {versus(i)} |"
        )


def _contenders(i: int, run: tuple, model: nn.Module, ckpt: Any) -> list:
    _, sequence, _, plan, _ = run

    def rotor_setup() -> None:
        ckpt.sequence = sequence

    out = [(("rotor", i), ckpt, rotor_setup)]
    if plan is not None:
        out.append((("remat", i), model, lambda: remat.apply(model, plan)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rotor", type=Path, help="a directory holding rotor v1.0's rotor/ package")
    ap.add_argument("--models", default="conv,gpt", help="comma-separated: conv, gpt")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--points", type=int, default=4, help="rotor's mem_limits: its floor, then steps of 1/POINTS up")
    _sections.add_write_option(ap)
    args = ap.parse_args()
    rotor = _load_rotor(args.rotor)
    with _sections.recorded(__file__, "remat beside rotor v1.0 on flat Sequential chains", write_to=args.write):
        for name in args.models.split(","):
            _side(name, rotor, args.rounds, args.points)
            print()


if __name__ == "__main__":
    main()
