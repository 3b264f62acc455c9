"""remat.profiling._schedule: selective-ops' traced step is where selective learns its structure."""

import pytest
import remat
from remat.core._step import training_step
from remat.core.checkpoint import _STRUCTURES
from remat.profiling._schedule import trace_schedule
from remat.zoo import build


def test_schedule_learns_in_selective_ops_trace_only_when_both_are_profiled():
    assert trace_schedule(("keep", "selective", "selective-ops", "full")) == [
        ("keep", "keep", False), ("selective-ops", "selective", False), ("selective", "selective", False),
        ("full", "full", False)]
    assert trace_schedule(("keep", "selective-ops", "selective")) == [
        ("keep", "keep", False), ("selective-ops", "selective", False), ("selective", "selective", False)]
    assert trace_schedule(("keep", "selective", "full")) == [
        ("keep", "keep", False), ("selective", "selective", True), ("full", "full", False)]
    assert trace_schedule(("keep", "selective-ops")) == [("keep", "keep", False), ("selective-ops", "selective-ops", False)]


def _costs(prof, policy):
    return ([(b.name, b.saved_bytes[policy], b.bwd_flops[policy]) for b in prof.blocks],
            prof.predict_peak({b.name: policy for b in prof.blocks}))


@pytest.mark.parametrize("trained_before", [False, True])
def test_one_profile_of_both_selective_policies_equals_a_profile_of_each(trained_before):
    # GPT-2's blocks have cheap submodules (LayerNorm, GELU): by module and op-level keep different bytes.
    zoo = build("gpt2", layers=2, hidden=64, heads=2, seq=32, batch=2, vocab=128)
    if trained_before:  # the blocks learned their structure in training: the profile learns it again
        blocks = [m for n, m in zoo.model.named_modules() if n in ("transformer.h.0", "transformer.h.1")]
        for m in blocks:
            remat.wrap(m, policy="selective")
        for _ in range(2):
            training_step(zoo.model, zoo.inputs, zoo.loss_fn)
        assert all(m in _STRUCTURES for m in blocks)
        for m in blocks:
            remat.unwrap(m)
        zoo.model.zero_grad(set_to_none=True)
    both = remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, warmup=0, repeat=1,
                         policies=("keep", "selective", "selective-ops", "full"))
    alone = {p: remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, warmup=0, repeat=1, policies=("keep", p))
             for p in ("selective", "selective-ops")}
    for policy, prof in alone.items():
        assert _costs(both, policy) == _costs(prof, policy), policy
    assert _costs(both, "selective") != _costs(both, "selective-ops")  # the test can tell them apart
