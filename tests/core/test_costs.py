"""Where a remat call's time goes (NOTE [Where the time goes] in remat.core._costs)."""

import logging

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

import remat
from remat.core._costs import costs, spent
from remat.core._memtrack import op_tensors


def test_a_phase_is_charged_only_its_own_time():
    with costs("remat.test") as ledger:
        with spent("outer"):
            with spent("inner"):
                sum(range(10_000))
            with spent("inner"):
                pass
    assert ledger.counts == {"outer": 1, "inner": 2}
    assert all(s >= 0 for s in ledger.seconds.values())
    assert sum(ledger.seconds.values()) <= ledger.total()


def test_nothing_is_recorded_outside_a_call_and_an_inner_call_adds_to_the_outer_one():
    with spent("alone"):
        pass
    with costs("remat.outer") as outer:
        with costs("remat.inner") as inner, spent("phase"):
            pass
    assert inner is outer and outer.counts == {"phase": 1}


def test_auto_logs_where_its_time_goes(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)))
    x = torch.randn(64, 32)
    with caplog.at_level(logging.INFO, logger="remat"):
        plan = remat.auto(model, x, 0.8, repeat=1, warmup=0)
    remat.remove(model)
    assert plan.checkpointed
    (line,) = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("remat.auto: ") and " s: " in r.getMessage()
    ]
    # below the peak without checkpointing: a fake profile, then real steps that verify
    for phase in ("fake traced steps", "verification steps", "planning", "other"):
        assert phase in line


def test_op_tensors_finds_what_pytree_finds_in_op_arguments():
    a, b, c = torch.zeros(1), torch.ones(2), torch.zeros(3)
    value = ((a, [b, 3, None], {"out": c}), {"dim": 1, "xs": (b,)}, torch.Size([2]))
    assert op_tensors(value) == [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
