"""remat.profile: blocks, costs, and the peak model against remat.measure."""

import inspect
import random

import pytest
import torch
from conftest import (
    SMALL,
    Interruptible,
    UntouchedByCtrlC,
    assert_state_equal,
    ctrl_c_while_restoring_rng,
    measure_assignment,
    measure_wrapped,
    residual_chain,
)
from torch import nn

import remat
from remat.core._state import capture
from remat.profiling._blocks import find_blocks
from remat.zoo import build


@pytest.fixture(scope="module")
def profiles():
    """One profile per small zoo model (profiling is the slow part; share it)."""
    out = {}
    for name, options in SMALL.items():
        zoo = build(name, **options)
        out[name] = (zoo, remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, repeat=1, warmup=0))
    return out


def _measured(zoo, assignment):
    return measure_assignment(zoo, assignment).peak_bytes


def _assignments(names):
    rng = random.Random(0)
    mixed = {n: rng.choice(["keep", "selective", "full"]) for n in names}
    mixed[names[0]], mixed[names[-1]] = "selective", "keep"  # make sure it is mixed
    return {
        "none": {},
        "all full": {n: "full" for n in names},
        "all selective": {n: "selective" for n in names},
        "mixed": mixed,
        "first full": {names[0]: "full"},
    }


@pytest.mark.parametrize("model", list(SMALL))
def test_predicted_peak_matches_measured(profiles, model):
    zoo, prof = profiles[model]
    names = [b.name for b in prof.blocks]
    for label, assignment in _assignments(names).items():
        predicted, measured = prof.predict_peak(assignment), _measured(zoo, assignment)
        # The issue asks for 5%; the composition is exact up to allocator-free ordering.
        assert abs(predicted - measured) <= 0.01 * measured, (label, predicted, measured)


def test_blocks_found_automatically():
    assert find_blocks(build("seed-cifar", batch=2).model) == ["cnn_block_1", "cnn_block_2", "head"]
    gpt2 = build("gpt2", **SMALL["gpt2"]).model
    assert find_blocks(gpt2) == [f"transformer.h.{i}" for i in range(3)]
    deep = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(10)])
    assert find_blocks(deep) == [str(i) for i in range(10)]
    stages = nn.Sequential(
        *[nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)]) for _ in range(2)]
    )
    assert find_blocks(stages, "coarse") == ["0", "1"]
    assert find_blocks(stages) == [f"{i}.{j}" for i in range(2) for j in range(3)]  # refined: < 8 coarse blocks


def test_explicit_blocks_and_bad_names():
    zoo = build("seed-cifar", batch=2)
    assert find_blocks(zoo.model, ["cnn_block_2"]) == ["cnn_block_2"]
    with pytest.raises(remat.RematError, match="not modules"):
        remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, blocks=["cnn_block_9"])
    with pytest.raises(remat.RematError, match="must not nest"):
        find_blocks(zoo.model, ["cnn_block_1", "cnn_block_1.0"])
    with pytest.raises(remat.RematError, match="found no blocks"):
        remat.profile(nn.Linear(2, 2), torch.randn(1, 2))


def test_flops_and_recompute_flops_are_exact():
    width, batch = 32, 8

    def block():
        return nn.Sequential(nn.Linear(width, width, bias=False), nn.ReLU(), nn.Linear(width, width, bias=False))

    model = nn.Sequential(*[block() for _ in range(3)])
    prof = remat.profile(model, torch.randn(batch, width), repeat=1, warmup=0)
    mm = 2 * batch * width * width
    hidden = batch * width * 4  # the ReLU output, kept for the second Linear
    for i, b in enumerate(prof.blocks):
        assert b.fwd_flops == 2 * mm
        grad_input = 0 if i == 0 else mm  # the first block's input does not require grad
        assert b.bwd_flops["keep"] == 2 * mm + mm + grad_input  # weight grads, hidden grad, input grad
        # Recomputation shows up in backward: the first matmul only, because torch stops
        # recomputing once every tensor backward needs exists (the last output is never needed).
        assert b.bwd_flops["full"] == b.bwd_flops["keep"] + mm
        assert b.bwd_flops["selective"] == b.bwd_flops["keep"]  # matmul outputs are kept, not recomputed
        assert b.saved_bytes == {"keep": hidden, "selective": hidden, "selective-ops": hidden, "full": 0}


def test_profile_restores_model_state(profiles):
    zoo = build("seed-cifar", batch=4)
    zoo.model.head.eval()
    before = capture(zoo.model)
    remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, repeat=1, warmup=0)
    assert_state_equal(before, capture(zoo.model))
    assert all(remat.is_wrapped(m) is None for m in zoo.model.modules())


def test_profile_restores_model_state_when_it_raises():
    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(2)])
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 3:  # fails in the second policy's run, after BatchNorm has updated
                raise ValueError("boom")
            for b in self.blocks:
                x = b(x)
            return x

    model = Fails()
    remat.wrap(model.blocks[1], policy="selective")  # the user's own wrapping must survive too
    x = torch.randn(3, 4)
    before = capture(model)
    with pytest.raises(
        remat.RematError,
        match=r"raised ValueError in Fails.forward \(outside every block\) during a profiled step: boom",
    ) as info:
        remat.profile(model, x, repeat=1, warmup=0)
    assert isinstance(info.value.__cause__, ValueError)
    assert_state_equal(before, capture(model))
    assert remat.is_wrapped(model.blocks[0]) is None and remat.is_wrapped(model.blocks[1]) == "selective"


def _plans_as_measured(model, x, prof, budgets):
    """(predicted, measured) of the plan for each of ``budgets(lowest)``, one level and nested; measured in the
    second step of ``remat.measure``, where a gradient left on ``x`` by the first would be alive throughout."""
    out = {}
    for nested in (False, True):
        lowest = remat.plan(prof, 1.0, nested=nested).min_peak_bytes
        for budget in budgets(lowest):
            plan = remat.plan(prof, min(max(budget, lowest), prof.baseline_peak_bytes), nested=nested)
            key = (tuple(sorted(plan.assignment.items())), repr(plan.segments))
            if key not in out:
                remat.apply(model, plan)
                try:
                    out[key] = plan.predicted_peak_bytes, remat.measure(model, x, warmup=0, repeat=1).peak_bytes
                finally:
                    remat.remove(model)
    return out


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
@pytest.mark.parametrize("stem", [False, True], ids=["blocks-first", "stem-first"])
def test_inputs_that_require_grad_are_predicted_to_the_byte(fake, stem):
    # The input's gradient is made in the first block's backward (or the stem's, in glue after it) and is
    # alive to the end of the step: each step, as each of a loop's steps on fresh inputs.
    model = residual_chain(stem=stem)
    x = torch.randn(16, 32, 32, requires_grad=True)
    prof = remat.profile(model, x, repeat=1, warmup=0, fake=fake)
    assert x.grad is None
    base = prof.baseline_peak_bytes
    rows = _plans_as_measured(model, x, prof, lambda lowest: (base, (base + lowest) // 2, lowest))
    assert len(rows) >= 4 and any(segments != "()" for _, segments in rows), rows
    assert all(predicted == measured for predicted, measured in rows.values()), rows
    assert x.grad is None


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_an_input_gradient_at_the_peak_or_held_before_is_predicted_to_the_byte(fake):
    # Weights outweigh activations: the peak is at the end of backward, where the input's gradient is alive.
    model = residual_chain(width=64, hidden=256)
    x = torch.randn(2, 8, 64, requires_grad=True)
    prof = remat.profile(model, x, repeat=1, warmup=0, fake=fake)
    rows = _plans_as_measured(model, x, prof, lambda lowest: (prof.baseline_peak_bytes, lowest))
    assert all(predicted == measured for predicted, measured in rows.values()), rows
    # A gradient the input already holds is alive through every step and accumulated into, and left as it was.
    held = x.grad = torch.randn_like(x)
    values, version = held.clone(), held._version
    prof = remat.profile(model, x, repeat=1, warmup=0, fake=fake)
    assert prof.resting_bytes == remat.measure(model, x, repeat=1).resting_bytes
    rows = _plans_as_measured(model, x, prof, lambda lowest: (prof.baseline_peak_bytes, lowest))
    assert all(predicted == measured for predicted, measured in rows.values()), rows
    assert x.grad is held and torch.equal(held, values) and held._version == version


@pytest.mark.parametrize("at", [0, 2, 7])  # the loop's first step, a traced step, a timed step
def test_ctrl_c_in_a_profiled_step_leaves_everything_as_it_was(at):
    model, x = Interruptible(at), torch.randn(4, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    untouched = UntouchedByCtrlC(model, optimizer)
    untouched.check(
        lambda: remat.profile(model, x, blocks=["blocks.0", "blocks.2"], optimizer=optimizer, warmup=1, repeat=1)
    )


def test_ctrl_c_while_profile_restores_waits_until_everything_is_back(monkeypatch):
    # From the second traced step on, each restore is hit by a Ctrl-C; the last one holds it until the
    # optimizer's state is back too.
    model, x = Interruptible(), torch.randn(4, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    untouched = UntouchedByCtrlC(model, optimizer)
    ctrl_c_while_restoring_rng(monkeypatch, start=2)
    untouched.check(
        lambda: remat.profile(model, x, blocks=["blocks.0", "blocks.2"], optimizer=optimizer, warmup=1, repeat=1)
    )


def test_json_round_trip_and_table(profiles):
    _, prof = profiles["gpt2"]
    again = remat.Profile.from_json(prof.to_json())
    names = [b.name for b in prof.blocks]
    for assignment in _assignments(names).values():
        assert again.predict_peak(assignment) == prof.predict_peak(assignment)
    assert again.blocks == prof.blocks
    table = prof.table()
    assert all(n in table for n in names) and "peak without checkpointing" in table
    with pytest.raises(remat.RematError, match="schema"):
        remat.Profile.from_json('{"schema": 99}')
    with pytest.raises(remat.RematError, match="expected a JSON object, got list"):
        remat.Profile.from_json("[1]")


def test_bad_assignment_is_an_error(profiles):
    _, prof = profiles["seed-cifar"]
    with pytest.raises(remat.RematError, match="not blocks"):
        prof.predict_peak({"nope": "full"})
    with pytest.raises(remat.RematError, match="not profiled"):
        prof.predict_peak({"cnn_block_1": "offload"})


def test_seed_cnn_peak_sits_in_the_first_blocks_backward(profiles):
    """measurements.md, point 1: no policy lowers the seed CNN's peak; the profile says so."""
    _, prof = profiles["seed-cifar"]
    assert prof.predict_peak({b.name: "full" for b in prof.blocks}) == prof.baseline_peak_bytes
    key, _, top = max(prof.timeline(), key=lambda t: t[2])
    assert key == ("bwd", "cnn_block_1", 0) and top == prof.baseline_peak_bytes


def test_autocast_weight_casts_are_freed_by_the_blocks_that_made_them():
    """Under autocast the cache keeps a checkpointed block's bf16 weight copies until forward ends;
    the copies freed there depend on every block's policy, not the last block's (the peak model's
    NOTE on autocast's weight casts)."""
    from remat.bench._gpu_truth import autocast_forward

    zoo = build("llama", layers=4, hidden=128, intermediate=344, heads=4, kv_heads=2, vocab=256, seq=64, batch=2)
    autocast_forward(zoo.model, torch.bfloat16)
    prof = remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, repeat=1, warmup=0)
    names = [b.name for b in prof.blocks]
    assert any(c.cast_release for c in prof.segments["full"].values())  # the cache did free copies
    for assignment in (
        {n: "full" for n in names[:2]},
        {n: "full" for n in names[2:]},
        {n: ("full", "keep")[i % 2] for i, n in enumerate(names)},
        {names[0]: "selective"},
    ):
        predicted, measured = prof.predict_peak(assignment), _measured(zoo, assignment)
        assert abs(predicted - measured) <= 0.01 * measured, (assignment, predicted, measured)


@pytest.mark.parametrize(("warmup", "untimed"), [(0, 0), (1, 0), (2, 1)])
@pytest.mark.parametrize("policies", [None, ("keep", "selective", "full")])
def test_the_traced_step_is_the_first_warmup(warmup, untimed, policies, caplog):
    # One traced step per policy, then (warmup - 1) untimed and ``repeat`` timed rounds: steps counted at the root.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), *(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)))
    steps = []
    model.register_forward_pre_hook(lambda *a: steps.append(1))
    options = {} if policies is None else {"policies": policies}
    with caplog.at_level("INFO", logger="remat"):
        remat.profile(model, torch.randn(4, 8), warmup=warmup, repeat=2, **options)
    # The defaults (keep, selective, selective-ops, full) learn selective's structure in selective-ops' traced
    # step; selective without selective-ops needs one more step to learn it (remat.profiling._schedule).
    policies = policies or inspect.signature(remat.profile).parameters["policies"].default
    learning = int("selective-ops" not in policies)
    random_branches = 1  # a forward without gradients (NOTE [Branches on random draws])
    assert len(steps) == len(policies) * (1 + untimed + 2) + learning + random_branches
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("remat.profile:"))
    assert ("1 learning steps" in line) == bool(learning) and f"{len(policies)} traced steps" in line
    assert f"{2 * len(policies)} timed steps" in line
    assert (f"{len(policies) * untimed} warm-up steps" in line) == (untimed > 0)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.mark.parametrize("full", [True, False])
def test_collections_during_a_profile_leave_the_heap_as_it_was(full):
    import gc
    import weakref

    from remat.profiling._schedule import young_collections

    old = _Cycle()
    gone = weakref.ref(old)
    del old  # garbage from before the profile, in a cycle
    with young_collections(full=full):
        assert gc.get_freeze_count() > 0  # the heap before the profile is not walked again
        gc.collect()  # what a traced step does: the frozen heap is not looked at
        assert (gone() is None) == full  # the full collection only where garbage may hold device memory
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None  # unfrozen, it is collected as before
    gc.freeze()  # a caller's own frozen objects stay frozen: never unfrozen here (frozen objects may still die
    unfrozen = []  # by reference counting meanwhile, so the count itself is not the check)
    original = gc.unfreeze
    try:
        gc.unfreeze = lambda: unfrozen.append(1)
        with young_collections(full=full):
            pass
        assert not unfrozen and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze = original
        gc.unfreeze()


def _relu_first_block(d: int) -> nn.Module:
    return nn.Sequential(nn.ReLU(inplace=True), nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))


def test_blocks_that_begin_with_an_in_place_relu_profile_under_every_policy():
    # Each block writes its input, the previous block's cached matmul output, in place: the profile's own
    # selective steps once raised RecomputeError. Uniform runs and mixes are predicted to the byte.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), *(_relu_first_block(16) for _ in range(3)), nn.Linear(16, 4))
    x = torch.randn(32, 16)
    prof = remat.profile(model, x, repeat=1, warmup=0, policies=("keep", "selective", "selective-ops", "full"))
    assert [b.name for b in prof.blocks] == ["1", "2", "3"]
    short = {"k": "keep", "s": "selective", "o": "selective-ops", "f": "full"}
    bad = []
    for pick in ("kkk", "sss", "ooo", "fff", "ksf", "sof", "fok", "osk"):
        assignment = {name: short[c] for name, c in zip("123", pick)}
        measured = measure_wrapped(model, x, assignment).peak_bytes
        if prof.predict_peak(assignment) != measured:
            bad.append((pick, prof.predict_peak(assignment), measured))
    assert not bad


def test_auto_blocks_do_not_refine_a_layer_into_its_experts():
    # A mixture-of-experts decoder layer (transformers 4.x Mixtral) holds a list of expert MLPs that its router
    # calls per token: with fewer than 8 layers, refining into the experts would leave the attention unplanned.
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.o = nn.Linear(4, 4), nn.Linear(4, 4)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.attention = nn.LayerNorm(4), Attention()
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)) for _ in range(3))

    model = nn.Sequential(Layer(), Layer())
    assert find_blocks(model) == ["0", "1"]
    assert find_blocks(model, "fine") == ["0", "1"]


class _Adapted(nn.Module):
    """peft's lora.Linear: a frozen linear with a low-rank update beside it."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.a, self.b = nn.Linear(d_in, 2, bias=False), nn.Linear(2, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


class _AdaptedAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (_Adapted(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = (self.q(x) @ self.k(x).transpose(1, 2)).softmax(-1)  # the scores live here, in no unit
        return self.o(scores @ self.v(x))


class _AdaptedLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attention, self.up, self.down = _AdaptedAttention(d), _Adapted(d, 4 * d), _Adapted(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        return x + self.down(nn.functional.gelu(self.up(x)))


def test_auto_blocks_refine_a_layer_only_into_what_it_calls():
    # NOTE [A block is refined into what it calls]: LoRA on every linear made the wrappers the units, 28 for a
    # 4-layer Llama, and the scores inside each attention's own code could not be checkpointed. Now each layer
    # is refined into what it calls: its attention (which holds four wrappers) and its two wrappers.
    torch.manual_seed(0)
    model, x = nn.Sequential(*(_AdaptedLayer(16) for _ in range(4))), torch.randn(8, 64, 16)
    assert find_blocks(model) == [f"{i}.{n}" for i in range(4) for n in ("attention", "up", "down")]
    wrappers = [f"{i}.{n}" for i in range(4) for n in ("attention.q", "attention.k", "attention.v", "attention.o")]
    wrappers += [f"{i}.{n}" for i in range(4) for n in ("up", "down")]
    floors = {}
    for units in (find_blocks(model), wrappers):
        prof = remat.profile(model, x, blocks=units, repeat=1, warmup=0)
        floors[len(units)] = remat.plan(prof, strategy="none").min_peak_bytes / prof.baseline_peak_bytes
    assert floors[12] < 0.8 * floors[24], floors
    # a stage that runs its layers through a plain Sequential calls them itself: it is refined into them
    stages = nn.Sequential(*(_Stage() for _ in range(2)))
    assert find_blocks(stages) == [f"{i}.layers.{j}" for i in range(2) for j in range(3)]
    # a stage of one block is refined into what that block calls
    single = nn.Sequential(*(nn.Sequential(_AdaptedLayer(8)) for _ in range(2)))
    assert find_blocks(single) == [f"{i}.0.{n}" for i in range(2) for n in ("attention", "up", "down")]


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(_AdaptedLayer(8) for _ in range(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
