"""remat.bench: the harness runs end to end (smoke test, no timing assertions) and its search loop."""

import pytest

import remat
from remat._bench_report import plot, targets
from remat.bench import QUICK, bench_model, max_batch, run_bench, search_max
from remat.zoo import build


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
