"""remat.bench: the harness runs end to end (smoke test, no timing assertions) and its search loop."""

import pytest
import torch
from torch import nn

import remat
from remat.bench import QUICK, bench_model, max_batch, run_bench, search_max
from remat.bench._report import plot, targets
from remat.bench._run import _compiled_graphs, _peak
from remat.bench._setups import every_block, hf_checkpointing_on, no_checkpointing, torch_compile
from remat.core._step import training_step
from remat.zoo import ZooModel, build


def test_search_max_sequence_with_fake_out_of_memory():
    assert search_max(lambda n: n <= 37) == (37, [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37])
    assert search_max(lambda n: n <= 1) == (1, [1, 2])
    assert search_max(lambda n: False) == (0, [1])
    assert search_max(lambda n: True, limit=8) == (8, [1, 2, 4, 8])


def test_quick_bench_llama_rows(tmp_path):
    report = run_bench(["llama"], quick=True, budgets=(0.9, "min"), repeat=1, command="pytest")
    rows = {label: r for r in report.rows for label in r.setup.split(" = ")}
    assert {"none", "every block (torch)", "remat 0.9", "remat min"} <= set(rows)
    plans = [r for r in report.rows if r.kind == "remat"]
    assert len({r.setup for r in plans}) == len(plans)  # one row per distinct plan
    assert any(name.startswith("sqrt(n) segments") for name in rows)
    for r in report.rows:
        assert r.grads_equal, r.setup  # every setup, baselines too, trains the same
        if r.kind == "remat":
            assert abs(r.predicted_error) <= 0.05, r
            assert r.peak_bytes <= 1.02 * r.budget_bytes, r
    assert rows["remat min"].peak_bytes <= rows["remat 0.9"].peak_bytes
    text = report.markdown()
    assert "remat 0.9" in text and "largest predicted-vs-measured peak error" in text
    paths = plot(report, tmp_path)
    assert paths and all(p.stat().st_size > 1000 for p in paths)
    assert report.to_dict()["rows"][0]["setup"] == "none"


def test_batchnorm_buffers_differ_for_torch_but_not_remat():
    zoo = build("resnet50", **QUICK["resnet50"])
    rows, _ = bench_model(zoo, budgets=(0.9,), repeat=1, warmup=0)
    by = {r.setup: r for r in rows}
    assert not by["every block (torch)"].buffers_equal  # num_batches_tracked == 2
    assert all(r.buffers_equal and r.grads_equal for r in rows if r.kind == "remat")
    lines = targets(rows)
    assert any("dominated" in line for line in lines)


def test_max_batch_quick():
    zoo = build("llama", **QUICK["llama"])
    budget = remat.measure(zoo.model, zoo.inputs, zoo.loss_fn, warmup=0, repeat=1).peak_bytes
    result = max_batch("llama", budget, strategies=("none", "remat"), options=QUICK["llama"])
    assert result.batches["none"] == QUICK["llama"]["batch"]  # the budget is exactly its peak at that batch
    assert result.batches["remat"] >= result.batches["none"]
    assert result.peaks["remat"] <= budget
    assert "max batch" in result.markdown()
    with pytest.raises(remat.RematError, match="unknown strategies"):
        max_batch("llama", budget, strategies=("magic",))


def _row(setup, kind, peak, ratios, budget=None):
    from statistics import median

    from remat.bench import BenchRow

    return BenchRow(
        model="m",
        setup=setup,
        kind=kind,
        peak_bytes=peak,
        peak_ratio=peak / 100,
        time_s=1.0,
        time_ratio=median(ratios),
        grads_equal=True,
        buffers_equal=True,
        budget_bytes=budget,
        predicted_peak_bytes=peak if kind == "remat" else None,
        predicted_overhead=0.1 if kind == "remat" else None,
        round_ratios=tuple(ratios),
    )


def test_paired_difference_median_and_interval():
    from remat.bench._report import paired_difference

    a = _row("a", "remat", 50, [1.10, 1.20, 1.15, 1.30, 1.12])
    b = _row("b", "baseline", 50, [1.00, 1.10, 1.05, 1.20, 1.02])
    d, lo, hi = paired_difference(a, b)
    assert d == pytest.approx(0.10) and lo == pytest.approx(0.10) and hi == pytest.approx(0.10)
    half, _, _ = paired_difference(a, b, share=0.5)  # overhead minus half the baseline's
    assert half == pytest.approx(0.15 - 0.5 * 0.05)
    noisy = _row("n", "remat", 50, [1.3, 0.9, 1.3, 0.9, 1.3])
    d, lo, hi = paired_difference(noisy, _row("one", "baseline", 100, [1.0] * 5))
    assert lo < d <= hi and lo <= -0.05 and hi >= 0.25


def test_targets_say_matched_within_noise_and_not_matched():
    none = _row("none", "baseline", 100, [1.0] * 6)
    every = _row("every block (torch)", "baseline", 40, [1.30, 1.31, 1.29, 1.30, 1.30, 1.32])
    sac = _row("torch SAC", "baseline", 70, [1.10, 1.12, 1.08, 1.10, 1.11, 1.09])
    fast = _row("remat @ peak of torch SAC", "remat", 69, [1.05, 1.06, 1.04, 1.05, 1.06, 1.05], budget=70)
    tie = _row("remat min", "remat", 40, [1.33, 1.27, 1.36, 1.26, 1.35, 1.30], budget=40)
    text = "\n".join(targets([none, every, sac, fast, tie]))
    assert "torch SAC (0.70 peak, 1.10x): matched by remat @ peak of torch SAC" in text
    assert "every block (torch) (0.40 peak, 1.30x): within noise of remat min" in text
    slow = _row("remat min", "remat", 40, [1.50, 1.52, 1.49, 1.51, 1.50, 1.50], budget=40)
    text = "\n".join(targets([none, every, sac, fast, slow]))
    assert "every block (torch) (0.40 peak, 1.30x): **not matched** by remat min" in text
    assert "dominated by a baseline: remat min by torch SAC" not in text  # SAC's peak is higher: no domination
    worse = _row("remat 0.9", "remat", 90, [1.20, 1.21, 1.19, 1.20, 1.22, 1.20], budget=90)
    text = "\n".join(targets([none, every, sac, worse]))
    assert "remat 0.9 by torch SAC" in text and "**more than half**" in text


def test_every_block_on_hugging_face_leaves_no_hooks_behind():
    # transformers' enable adds an input-embedding hook that its disable keeps (outside PEFT).
    zoo = build("gpt2", **QUICK["gpt2"])
    every = every_block([zoo.model.get_submodule(b) for b in zoo.blocks])
    embeddings = zoo.model.get_input_embeddings()
    for _ in range(3):
        every.on(zoo.model)
        assert hf_checkpointing_on(zoo.model) and len(embeddings._forward_hooks) == 1
        every.off(zoo.model)
        assert len(embeddings._forward_hooks) == 0 and not hf_checkpointing_on(zoo.model)
    assert "_require_grads_hook" not in vars(zoo.model)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_torch_compile_setup_keeps_each_budget_apart_and_is_measured_by_the_allocator():
    torch.manual_seed(0)
    zoo = ZooModel("mlp", _Mlp(), torch.randn(512, 256), lambda out: out.square().mean(), ())
    full, low = torch_compile(1.0), torch_compile(0.0)
    eager = _peak(zoo, no_checkpointing())
    peaks = {s.name: _peak(zoo, s) for s in (full, low)}  # compiles each once
    graphs = _compiled_graphs()
    for _ in range(2):  # switching between setups and eager must not recompile
        for setup in (full, low, no_checkpointing()):
            setup.on(zoo.model)
            training_step(zoo.model, zoo.inputs, zoo.loss_fn)
            setup.off(zoo.model)
    assert _compiled_graphs() == graphs
    # Budget 0 recomputes the GELUs' inputs instead of saving them: a lower peak than budget 1,
    # which would be impossible had both budgets shared one cached graph.
    assert peaks[low.name] < peaks[full.name] <= eager, (peaks, eager)
    assert "forward" not in vars(zoo.model)


def test_compile_budget_outside_zero_one_is_an_error_before_any_work():
    zoo = build("gpt2", **QUICK["gpt2"])
    with pytest.raises(remat.RematError, match=r"outside \[0, 1\]"):
        bench_model(zoo, compile_budgets=(1.5,))


def test_max_batch_profiles_on_fake_tensors_only(monkeypatch):
    # NOTE [max-batch runs no step predicted over the budget]: each batch tried is profiled on fake
    # tensors; real steps run only for plans predicted within the budget.
    zoo = build("llama", **QUICK["llama"])
    budget = int(remat.measure(zoo.model, zoo.inputs, zoo.loss_fn, warmup=0, repeat=1).peak_bytes * 1.6)
    profiled: list[tuple[int, bool]] = []
    real_profile = remat.profile

    def counting(model, inputs, *args, **kwargs):  # noqa: ANN001, ANN202
        profiled.append((inputs["input_ids"].shape[0], bool(kwargs.get("fake"))))
        return real_profile(model, inputs, *args, **kwargs)

    monkeypatch.setattr(remat, "profile", counting)
    result = max_batch("llama", budget, strategies=("remat",), options=QUICK["llama"])
    tried = result.tried["remat"]
    assert profiled == [(b, True) for b in tried]
    assert result.peaks["remat"] <= budget and result.batches["remat"] > QUICK["llama"]["batch"]
    # The answer is the one real profiles give: one batch more does not fit with a plan made from its own profile.
    above = build("llama", **{**QUICK["llama"], "batch": result.batches["remat"] + 1})
    prof = real_profile(above.model, above.inputs, above.loss_fn, repeat=1, warmup=0)
    with pytest.raises(remat.RematError):
        remat.plan(prof, budget)
