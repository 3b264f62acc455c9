"""Blocks recomputed outside their own backward in the nested walk (``remat.planning._nested_early``): a block
that returns an auxiliary loss is recomputed at the start of the backward, under the plan's policy."""

from __future__ import annotations

from dataclasses import replace

import pytest
from _by_hand import measured_plan, measured_step, step_grads
from _generated import build, spec

import remat
from remat.planning._nested import Node, costs_of, simulate

AUX_THIRD = spec([{}, {}, {"aux": True}, {}])


def _predicted_and_measured(policies: tuple[str, ...], segment: bool) -> tuple[int, int, int]:
    """(walk, measured peak, the walk with the recomputations of the runs as they were) of the plan: blocks 0-1 a
    segment (``segment``) or under their policies, the others under theirs; its gradients are the model's."""

    def shape(c, p):  # noqa: ANN001, ANN202
        head = (Node(0, end=2, children=(Node(0, p(policies[0])),)),) if segment else (Node(0, p(policies[0])),)
        return (*head, *(Node(k, p(q)) for k, q in enumerate(policies) if k >= len(head) + segment))

    found = measured_plan(*build(AUX_THIRD), shape)
    return found.predicted, found.measured, simulate(replace(found.costs, early=()), found.nodes)


@pytest.mark.parametrize(
    ("policies", "segment"),
    [
        (("full", "full", "full", "selective"), True),  # the generated models' bug 21: 24,576 B under before
        (("full", "full", "full", "keep"), True),  # 15,812 B under before
        (("full", "full", "selective", "full"), True),  # 24,576 B over before
        (("keep", "keep", "selective", "full"), False),
        (("full", "keep", "full", "keep"), False),
    ],
    ids=lambda v: "-".join(v) if isinstance(v, tuple) else ("segment" if v else "flat"),
)
def test_a_block_recomputed_at_the_start_of_the_backward_is_predicted_under_its_own_policy(policies, segment):
    predicted, measured, runs_as_they_were = _predicted_and_measured(policies, segment)
    assert measured == predicted
    # the step hosting the recomputation is taken from the last block's run, not the aux block's
    assert runs_as_they_were != predicted


def test_the_profile_places_the_early_recomputation_in_the_last_blocks_backward():
    model, x = build(AUX_THIRD)
    c = costs_of(remat.profile(model, x, repeat=1, warmup=0))
    (early,) = c.early
    full = c.full
    assert early.block == 2 and early.at[full] == ("bwd", 3)
    assert early.kept[full] > 0 and (full, c.chain.policies.index("keep")) in early.swap


def test_the_nested_floor_checkpoints_a_block_returning_an_aux_loss_where_that_walks_lower():
    # NOTE [Aux blocks in the descent]: the DP keeps such blocks; the descent, judged by the walk, moves them
    model, x = build(spec([{}, {"aux": True}, {}, {}, {"aux": True}, {}]))
    start = {n: b.clone() for n, b in model.named_buffers()}
    reference = step_grads(model, x, start)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    one_level = remat.plan(prof, strategy="none", nested=False).min_peak_bytes
    plan = remat.plan(prof, remat.plan(prof, strategy="none").min_peak_bytes)
    assert plan.segments and plan.predicted_peak_bytes < one_level
    assert {plan.assignment["blocks.1"], plan.assignment["blocks.4"]} != {"keep"}
    assert measured_step(model, x, plan, start, reference) <= plan.predicted_peak_bytes
