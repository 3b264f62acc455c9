"""Fake profiles for ``target="h100"``, made on this CPU, against peaks measured on an H100.

``benchmarks/gpu-truth/``: GPT-2 and Llama zoo configurations, six per-block
assignments each, fp32 and bf16 autocast, torch 2.11 + CUDA 13 (see its README).
Each configuration is profiled once (fake, no allocation) and every row checked.
"""

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.bench._gpu_truth import FILES, as_measured, build_config, compare, load
from remat.profiling._workspace import Gpu, reduce_buffer

pytest.importorskip("transformers")

TOLERANCE = 0.03
# Known misses (strict: passing one fails the suite until its mark goes). None since fake profiles count the
# caching allocator's blocks (NOTE [Blocks the caching allocator hands out]): Llama 4x1024 in bf16 was -4.3%.
MISSES: set[tuple[str, str]] = set()
# Rows that no longer describe remat (strict: each must be predicted below its measurement, or the mark goes).
# fp32 Llama ran SDPA's math path, which adds the causal mask in place to the matmul output selective keeps (an
# _unsafe_view: no version change); remat then kept the written scores, and now recomputes them (NOTE [Cached
# outputs written in place]), keeping 15-40% less. To be measured again on a GPU (issue #31).
STALE = {
    ("h100.json", "llama-4x1024"): {"all-selective", "mixed"},
    ("h100.json", "llama-1b-2048"): {"all-selective", "mixed"},
}
CASES = [
    pytest.param(
        name,
        label,
        id=f"{name.removesuffix('.json')}-{label}",
        marks=[pytest.mark.xfail(strict=True, reason="see MISSES")] if (name, label) in MISSES else [],
    )
    for name in FILES
    for label in load(name)["models"]
]


def attention_calls(monkeypatch):
    """Records how the model calls SDPA: (mask given, is_causal, enable_gqa) per call."""
    calls = set()
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *args, **kwargs):
        calls.add((attn_mask is not None, is_causal, kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, attn_mask, dropout_p, is_causal, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return calls


@pytest.mark.parametrize("name,label", CASES)
def test_fake_h100_profile_predicts_measured_peaks(name, label, monkeypatch):
    truth = as_measured(load(name))
    zoo = build_config(truth, label)  # on the meta device: nothing allocated
    policies = ("keep", "selective-ops", "full")
    calls = attention_calls(monkeypatch)
    prof = remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, fake=True, target="h100", policies=policies)
    # the peaks describe one attention call (NOTE [The measured attention call]); another kernel is another model
    gqa = truth["models"][label]["zoo"] == "llama"
    assert calls == {(False, True, gqa)}, f"SDPA called as (mask, is_causal, enable_gqa) {calls}"
    rows = compare(truth, label, prof)
    assert len(rows) == 6
    stale = STALE.get((name, label), set())
    assert all(r.peak_error < -TOLERANCE for r in rows if r.assignment in stale), [r.peak_error for r in rows]
    rows = [r for r in rows if r.assignment not in stale]
    worst = max(rows, key=lambda r: abs(r.peak_error))
    report = ", ".join(f"{r.assignment} {r.peak_error:+.2%}" for r in rows)
    assert abs(worst.peak_error) <= TOLERANCE, report


def test_reduction_staging_matches_every_measured_sum():
    """The Reduce.cuh staging model reproduces each measured ``sum.dim_IntList`` maximum to the byte."""
    gpu = Gpu(sm_count=132, max_threads_per_sm=2048)
    # the largest sum of each configuration: a bias gradient (GPT-2) or an RMSNorm weight gradient (Llama)
    largest = {
        "gpt2-small-1024": [(8192, 2304), (8192, 3072), (8192, 768)],
        "gpt2-4x512": [(4096, 1536), (4096, 2048)],
        "llama-1b-2048": [(4096, 2048)],
        "llama-4x1024": [(2048, 1024)],
    }
    for name in FILES:
        for label, entry in load(name)["models"].items():
            measured = entry["hidden_workspace"]["none"]["aten.sum.dim_IntList"][1]
            model = max(reduce_buffer(gpu, torch.empty(shape, device="meta"), {0}, 4) for shape in largest[label])
            assert model == measured, (name, label, model, measured)
