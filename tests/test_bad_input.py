"""Bad input, tried as a demanding new user would: every case is a RematError (the CLI's are
in tests/cli) whose message says what was given and how to fix it, and the model is exactly
as it was afterwards (``conftest.Untouched``: parameters, buffers, flags, RNG, state_dict keys)."""

import functools
import json

import pytest
import torch
import torch.utils.checkpoint as tuc
from conftest import Untouched
from torch import nn

import remat


class Net(nn.Module):
    """Three blocks with BatchNorm and Dropout (a step changes buffers and RNG), in training mode."""

    def __init__(self, fail_in=None, output="tensor"):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.1), nn.Tanh()) for _ in range(3)
        )
        self.fail_in, self.output = fail_in, output

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == self.fail_in:
                x = x.view(5, -1)  # a user's bug inside block i: 4 rows cannot be viewed as 5
        return {"tensor": x, "none": None, "ints": x.argmax(-1)}[self.output]


def _net(**kwargs):
    torch.manual_seed(0)
    return Net(**kwargs).train()


X = torch.randn(4, 8)
PROFILE = dict(repeat=1, warmup=0)


@functools.cache
def _plan_json():
    return remat.plan(remat.profile(_net(), X, **PROFILE), strategy="all").to_json()


def _plan():
    """Net's plan, read back (made once, before any case snapshots the RNG)."""
    return remat.Plan.from_json(_plan_json())


def _edited(**fields):
    data = json.loads(_plan_json())
    data.update(fields)
    return json.dumps(data)


class Other(nn.Module):
    """Net's block names, another class."""

    def __init__(self):
        super().__init__()
        self.blocks = _net().blocks


def _apply_to_submodule(model):
    remat.apply(model.blocks, _plan())


# name -> (model factory, what the user does, substrings of the message: what was given, how to fix)
CASES = {
    # torch.utils.checkpoint options
    "an option of torch's remat does not know": (
        _net,
        lambda m: remat.checkpoint(m, X, policy="selective", respect_saved_tensors_hooks="yes"),
        ["respect_saved_tensors_hooks", "'yes'", "True, False or None"],
    ),
    "determinism_check typo": (
        _net,
        lambda m: remat.checkpoint(m, X, determinism_check="defualt"),
        ["'defualt'", "('default', 'none')"],
    ),
    "context_fn not callable": (
        _net,
        lambda m: remat.checkpoint(m, X, context_fn=("a", "b")),
        ["got tuple", "create_selective_checkpoint_contexts"],
    ),
    "policy and selective context_fn": (
        _net,
        lambda m: remat.checkpoint(
            m,
            X,
            policy="selective",
            context_fn=functools.partial(tuc.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default]),
        ),
        ["policy='selective'", "Pass one"],
    ),
    "early_stop not a bool": (_net, lambda m: remat.checkpoint(m, X, early_stop="no"), ["'no'", "True, False or None"]),
    "checkpoint a non-callable": (_net, lambda m: remat.checkpoint(m.state_dict(), X), ["callable", "OrderedDict"]),
    "unknown policy": (_net, lambda m: remat.checkpoint(m, X, policy="most"), ["'most'", "'selective'"]),
    # budgets
    **{
        f"budget {b!r}": (_net, functools.partial(lambda b, m: remat.auto(m, X, b, **PROFILE), b), [repr(b), "'50%'"])
        for b in (
            1.5,
            "1.5",
            2,
            "2",
            -1,
            0,
            float("nan"),
            float("inf"),
            "-0.5",
            "20GiBs",
            "80 percent",
            "0.5.1",
            "",
            "101%",
            True,
            None,
            [0.5],
            "1/2",
        )
    },
    # plans read from JSON
    "from_json(None)": (_net, lambda m: remat.Plan.from_json(None), ["NoneType", "read_text"]),
    "from_json of a dict": (_net, lambda m: remat.Plan.from_json(json.loads(_plan_json())), ["dict", "JSON text"]),
    "assignment as a list": (
        _net,
        lambda m: remat.Plan.from_json(_edited(assignment=["blocks.0"])),
        ["'assignment'", "['blocks.0']", "block name -> policy"],
    ),
    "bytes as words": (
        _net,
        lambda m: remat.Plan.from_json(_edited(predicted_peak_bytes="lots")),
        ["'predicted_peak_bytes'", "'lots'", "non-negative an integer"],
    ),
    "negative bytes": (_net, lambda m: remat.Plan.from_json(_edited(min_peak_bytes=-3)), ["'min_peak_bytes'", "-3"]),
    "null overhead": (
        _net,
        lambda m: remat.Plan.from_json(_edited(predicted_overhead=None)),
        ["'predicted_overhead'", "None", "a number"],
    ),
    "training as text": (
        _net,
        lambda m: remat.Plan.from_json(_edited(training="yes")),
        ["'training'", "'yes'", "true or false or null"],
    ),
    "segments as a word": (
        _net,
        lambda m: remat.Plan.from_json(_edited(segments="all")),
        ["'segments'", "'all'", "[first block, last block]"],
    ),
    "execution unknown": (
        _net,
        lambda m: remat.Plan.from_json(_edited(execution="jit")),
        ["'execution'", "'jit'", '"compiled"'],
    ),
    "unknown policy in a plan": (
        _net,
        lambda m: remat.Plan.from_json(_edited(assignment={"blocks.0": "half"})),
        ["'half'", "keep, selective, selective-ops, full or full-fine"],
    ),
    "plan names the root": (
        _net,
        lambda m: remat.Plan.from_json(_edited(assignment={"": "full"})),
        ["root module ''", "Name the blocks"],
    ),
    "plan nests blocks": (
        _net,
        lambda m: remat.Plan.from_json(_edited(assignment={"blocks.0": "full", "blocks.0.0": "keep"})),
        ["'blocks.0.0' is inside block 'blocks.0'", "Name either"],
    ),
    "missing field": (
        _net,
        lambda m: remat.Plan.from_json(_edited(model=None).replace('"model": null,', "")),
        ["missing ['model']"],
    ),
    # plans put on models
    "plan for another class": (
        lambda: Other().train(),
        lambda m: remat.apply(m, _plan()),
        ["made for a Net", "this model is a Other", "plan again"],
    ),
    "plan for another size": (lambda: nn.Sequential(), lambda m: remat.apply(m, _plan()), ["made for a Net"]),
    "plan applied to a part": (_net, _apply_to_submodule, ["made for a Net", "ModuleList", "not to a part of it"]),
    "plan for another configuration": (
        _net,
        lambda m: remat.apply(m, remat.Plan.from_json(_edited(parameters=7))),
        ["7 parameters", f"this one has {3 * (8 * 8 + 8 + 2 * 8)}", "plan again"],
    ),
    "plan names a lone Linear": (
        _net,
        lambda m: remat.apply(
            m, remat.Plan.from_json(_edited(assignment={"blocks.0.0": "full", "blocks.1": "keep", "blocks.2": "keep"}))
        ),
        ["'blocks.0.0' is a lone Linear", "saves nothing", "('blocks.0')"],
    ),
    "apply something else": (_net, lambda m: remat.apply(m, json.loads(_plan_json())), ["got dict", "remat.plan"]),
    "profile blocks a lone layer": (
        _net,
        lambda m: remat.profile(m, X, blocks=["blocks.1.1"], **PROFILE),
        ["'blocks.1.1' is a lone BatchNorm1d", "Name the module that contains it"],
    ),
    "profile nested blocks": (
        _net,
        lambda m: remat.profile(m, X, blocks=["blocks", "blocks.1"], **PROFILE),
        ["'blocks.1' is inside block 'blocks'"],
    ),
    "plan of a non-profile": (_net, lambda m: remat.plan(m, 0.5), ["got Net", "remat.profile"]),
    # models and inputs
    "profile a function": (_net, lambda m: remat.profile(m.forward, X), ["got method", "wrap it in an nn.Module"]),
    "measure a state_dict": (_net, lambda m: remat.measure(m.state_dict(), X), ["OrderedDict", "torch.nn.Module"]),
    "auto a lambda": (_net, lambda m: remat.auto(lambda x: m(x), X, 0.5), ["got function", "nn.Module"]),
    "wrap a function": (_net, lambda m: remat.wrap(m.forward), ["expected an nn.Module", "method"]),
    "inputs on another device": (
        _net,
        lambda m: remat.profile(m, X.to("meta"), **PROFILE),
        ["parameters are on cpu", "input tensor is on meta", ".to('cpu')"],
    ),
    "measure inputs on another device": (_net, lambda m: remat.measure(m, (X.to("meta"),)), ["on meta"]),
    "forward returns None": (lambda: _net(output="none"), lambda m: remat.measure(m, X), ["got NoneType", "loss_fn="]),
    "forward returns integers": (
        lambda: _net(output="ints"),
        lambda m: remat.profile(m, X, **PROFILE),
        ["no floating-point tensor", "loss_fn="],
    ),
    "loss_fn not a scalar": (_net, lambda m: remat.measure(m, X, loss_fn=lambda out: out), ["got (4, 8)", ".mean()"]),
    "error in block 1 (profile)": (
        lambda: _net(fail_in=1),
        lambda m: remat.profile(m, X, **PROFILE),
        ["raised RuntimeError", "during a profiled step", "The model was restored"],
    ),
    "error in block 1 (auto)": (
        lambda: _net(fail_in=1),
        lambda m: remat.auto(m, X, 0.9, **PROFILE),
        ["remat.auto (profiling the step): the training step raised RuntimeError", "during a profiled step"],
    ),
    "error in a wrapped block (measure)": (
        lambda: _wrapped(_net(fail_in=None)),
        lambda m: remat.measure(m, X),
        ["in block 'blocks.1'", "module 'blocks.1.0'", "raised ValueError", ": bad weights"],
    ),
    "no blocks, no trace": (
        lambda: _Unitless(),
        lambda m: remat.profile(m, {"x": X}, **PROFILE),
        ["found no blocks in _Unitless", "takes *args or **kwargs", "blocks=[...]"],
    ),
    "doctor a function": (_net, lambda m: remat.doctor(m.forward, X), ["nn.Module", "method"]),
}

IDS = torch.randint(0, 64, (2, 8))


class _Unitless(nn.Module):
    """Layers called once each, in no chain or list, and a forward of ``**batch``, which a trace cannot bind."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, **batch):
        return self.head(torch.tanh(self.body(batch["x"])))


class _FailsInRecompute(nn.Linear):
    def forward(self, x):
        if remat.is_recomputing():
            raise KeyError("cache entry gone")
        return super().forward(x)


def test_a_failure_in_recomputation_names_step_and_block_and_is_a_runtime_error():
    model = _net()
    model.blocks[2][0] = _FailsInRecompute(8, 8)
    remat.wrap(model.blocks[2])
    untouched = Untouched(model)
    with pytest.raises(RuntimeError) as info:
        remat.measure(model, X)
    assert isinstance(info.value, remat.RecomputeError) and isinstance(info.value.__cause__, KeyError)
    message = str(info.value)
    assert message.startswith(
        "remat.measure: recomputation in block 'blocks.2' (module 'blocks.2.0') failed during "
        "a measured step: remat.checkpoint: Sequential.forward failed when rerun"
    ), message
    assert "remat.is_recomputing()" in message
    untouched.check()


class _RunsOutInRecompute(nn.Linear):
    def forward(self, x):
        if remat.is_recomputing():
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().forward(x)


def test_running_out_of_memory_in_recomputation_is_out_of_memory_not_another_function():
    # Recomputation is where a checkpointed step peaks: the device being full there must reach auto as
    # "this plan is over the budget" (NOTE [Out of memory is an answer]), not as a recomputation that computed
    # something else.
    model = _net()
    model.blocks[2][0] = _RunsOutInRecompute(8, 8)
    remat.wrap(model.blocks[2])
    untouched = Untouched(model)
    with pytest.raises(torch.OutOfMemoryError) as info:
        remat.measure(model, X)
    assert isinstance(info.value, remat.errors.OutOfMemory) and not isinstance(info.value, remat.RecomputeError)
    assert "ran out of device memory (CUDA out of memory (simulated))" in str(info.value)
    untouched.check()
    with pytest.raises(torch.OutOfMemoryError):  # torch's own, through remat.checkpoint alone
        model(X).square().mean().backward()


class _BadLinear(nn.Linear):
    def forward(self, x):
        raise ValueError("bad weights")


def _wrapped(model):
    """Block 1 wrapped by the user, its first layer raising."""
    bad = _BadLinear(8, 8)
    bad.load_state_dict(model.blocks[1][0].state_dict())
    model.blocks[1][0] = bad
    remat.wrap(model.blocks[1])
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_a_clear_error_and_leaves_the_model_untouched(case):
    make, action, needles = CASES[case]
    _plan_json()  # seeds and profiles once, before the snapshot
    model = make()
    untouched = Untouched(model)
    with pytest.raises(remat.RematError) as info:
        action(model)
    message = str(info.value)
    assert message.startswith("remat"), message
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"
    untouched.check()


def test_a_model_error_keeps_the_original_as_cause():
    model = _net(fail_in=2)
    with pytest.raises(
        remat.RematError, match=r"in Net.forward \(outside every block\) during a profiled step"
    ) as info:
        remat.profile(model, X, **PROFILE)
    assert isinstance(info.value.__cause__, RuntimeError) and "[5, -1]" in str(info.value.__cause__)


@pytest.mark.parametrize("change", ["buffer", "training", "rng", "wrap", "requires_grad"])
def test_untouched_sees_each_kind_of_change(change):
    model = _net()
    untouched = Untouched(model)
    if change == "buffer":
        model.blocks[0][1].running_mean.add_(1)
    elif change == "training":
        model.blocks[2].eval()
    elif change == "rng":
        torch.rand(1)
    elif change == "wrap":
        remat.wrap(model.blocks[0])
    else:
        model.blocks[1][0].bias.requires_grad_(False)
    with pytest.raises(AssertionError):
        untouched.check()


def test_plans_that_fit_are_applied():
    # The checks refuse only what does not fit: the plan's own model, its FSDP2 class name
    # (fully_shard makes FSDP<Name>), and a plan from before parameters were recorded.
    data = json.loads(_plan_json())
    for fields in ({}, {"model": "FSDPNet"}, {"parameters": None}):
        model = _net()
        remat.apply(model, remat.Plan.from_json(json.dumps({**data, **fields})))
        assert [remat.is_wrapped(b) for b in model.blocks] == ["full"] * 3
