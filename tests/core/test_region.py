"""Watching only when needed: the first call of a callable runs under the copy-on-write
dispatch mode, later calls without it, and every step still matches no checkpointing."""

import pytest
import torch
from conftest import assert_buffers_equal, assert_grads_equal, step, twin
from torch import nn

import remat
import remat.core._region as region
from remat.core._contexts import _CopyOnWrite


@pytest.fixture
def mode_entries(monkeypatch):
    """How many times the copy-on-write dispatch mode was entered."""
    count = [0]
    enter = _CopyOnWrite.__enter__

    def counting(self):
        count[0] += 1
        return enter(self)

    monkeypatch.setattr(_CopyOnWrite, "__enter__", counting)
    return count


def _steps_match(ref, model, x, steps):
    """``steps`` training steps of both, each checked for equal gradients and buffers."""
    for seed in range(steps):
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
        step(ref, x, seed=seed)
        step(model, x, seed=seed)
        assert_grads_equal(ref, model)
        assert_buffers_equal(ref, model)


def _bn_block():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Dropout(0.2))


def _wrapped_bn_model():
    """A BatchNorm block (wrapped) before a lazy head, its twin unwrapped, and an input; lazy init run."""
    torch.manual_seed(0)
    ref = nn.Sequential(_bn_block(), nn.Flatten(), nn.LazyLinear(3))
    x = torch.randn(4, 3, 8, 8)
    ref(x)
    model = twin(ref)
    remat.wrap(model[0])
    return ref, model, x


def test_batchnorm_block_watched_once_then_copied_on_entry(mode_entries):
    ref, model, x = _wrapped_bn_model()
    _steps_match(ref, model, x, 4)  # running stats advance once per step, every step
    assert mode_entries[0] == 1
    assert int(model[0][1].num_batches_tracked) == 4 + 1  # the lazy-init call counted once


def test_eval_then_train_watches_again_for_the_new_mode(mode_entries):
    torch.manual_seed(0)
    ref = _bn_block()
    model = twin(ref)
    remat.wrap(model)
    x = torch.randn(4, 3, 8, 8)
    for m in (ref, model):
        m.eval()
    step(ref, x)
    step(model, x)
    for m in (ref, model):
        m.train()
    for seed in range(2):
        step(ref, x, seed=seed)
        step(model, x, seed=seed)
    assert_buffers_equal(ref, model)
    assert mode_entries[0] == 2  # once per training flag


class InPlaceOnInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(x.mul_(2.0))


def test_a_function_that_writes_its_input_stays_watched(mode_entries):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 6), InPlaceOnInput(), nn.Tanh())
    model = twin(ref)
    remat.wrap(model[1])
    _steps_match(ref, model, torch.randn(5, 6), 3)
    assert mode_entries[0] == 3


class Sometimes(nn.Module):
    """Writes in place to its input or to a large buffer only once told to."""

    def __init__(self, target):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("big", torch.zeros(region.SNAPSHOT_BYTES // 4 + 1))
        self.target = target
        self.write = False

    def forward(self, x):
        if self.write and self.target == "input":
            x.add_(1.0)
        elif self.write:
            self.big.add_(1.0)
        return self.lin(x)


@pytest.mark.parametrize("target", ["input", "buffer"])
def test_an_unexpected_write_is_an_error_and_the_next_call_watches(target, mode_entries):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 6), Sometimes(target))
    model = twin(ref)
    remat.wrap(model[1])
    x = torch.randn(5, 6)
    step(model, x)  # first call: watched, writes nothing
    model[1].write = ref[1].write = True
    with pytest.raises(remat.RematError, match="first call did not.*run the step again"):
        step(model, x)
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        m[1].big.zero_()
    step(ref, x)
    step(model, x)  # watched again: exact
    assert_grads_equal(ref, model)
    assert_buffers_equal(ref, model)
    assert mode_entries[0] == 2


def test_functions_without_a_stable_identity_are_always_watched(mode_entries):
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    for _ in range(3):
        remat.checkpoint(lambda t: lin(t).relu(), x).sum().backward()
    assert mode_entries[0] == 3
    for _ in range(3):
        remat.checkpoint(lin, x).sum().backward()
    assert mode_entries[0] == 4


def test_the_wrapped_modules_own_buffers_change_once():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 5), nn.BatchNorm1d(5))
    model = twin(ref)
    remat.wrap(model[1])  # the BatchNorm itself, not a container around it
    x = torch.randn(6, 5)
    for seed in range(3):
        step(ref, x, seed=seed)
        step(model, x, seed=seed)
    assert_buffers_equal(ref, model)
    assert int(model[1].num_batches_tracked) == 3


class _Switch(nn.Module):
    """A block whose BatchNorm runs only when asked: the first call never enters it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.use_bn = False

    def forward(self, x):
        y = self.lin(x)
        return self.bn(y) if self.use_bn else y


def test_later_calls_install_no_hook_on_every_submodule(monkeypatch):
    # The module-wide forward pre-hook costs host time on every submodule call (issue #16):
    # only the first call of a module's forward may install it.
    installs = [0]
    register = nn.modules.module.register_module_forward_pre_hook

    def counting(hook):
        installs[0] += 1
        return register(hook)

    monkeypatch.setattr(nn.modules.module, "register_module_forward_pre_hook", counting)
    ref, model, x = _wrapped_bn_model()
    _steps_match(ref, model, x, 3)
    assert installs[0] == 1
    assert int(model[0][1].num_batches_tracked) == 3 + 1


def test_a_buffer_first_entered_on_a_later_call_still_changes_once():
    torch.manual_seed(0)
    ref = _Switch()
    model = twin(ref)
    remat.wrap(model)
    x = torch.randn(5, 6)
    _steps_match(ref, model, x, 1)  # learns a forward that enters no module with buffers
    ref.use_bn = model.use_bn = True
    _steps_match(ref, model, x, 3)
    assert int(model.bn.num_batches_tracked) == 3


def _in_place_chain(block):
    """A stem, then three blocks made by ``block``, then a head."""
    return nn.Sequential(nn.Linear(8, 8), *(block() for _ in range(3)), nn.Linear(8, 3))


IN_PLACE_BLOCKS = {
    # its first op writes its input (the previous block's cached matmul output) in place
    "relu-first": lambda: nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)),
    # a matmul output selective caches, then written in place inside the block
    "relu-after-linear": lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8)),
    "conv-relu-first": lambda: nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8)),
}


@pytest.mark.parametrize("policy", ["full", "selective", "selective-ops"])
@pytest.mark.parametrize("kind", list(IN_PLACE_BLOCKS))
def test_blocks_that_write_in_place_train_under_every_policy(kind, policy):
    # Selective's recomputation must neither run the copy of a written input under torch's selective mode
    # (refused: "clone ... not found in storage") nor hand back a cached output written since (NOTE
    # [Cached outputs written in place] in remat.core._contexts).
    torch.manual_seed(0)
    ref = _in_place_chain(IN_PLACE_BLOCKS[kind])
    if kind.startswith("conv"):
        ref[0], ref[-1] = nn.Conv2d(8, 8, 1), nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 3))
        x = torch.randn(2, 8, 4, 4)
    else:
        x = torch.randn(5, 8)
    model = twin(ref)
    for block in model[1:4]:
        remat.wrap(block, policy=policy)
    _steps_match(ref, model, x, 3)  # selective: op-level on the first call, by module after


def test_a_version_recorded_for_an_input_counts_only_for_that_tensor():
    # NOTE [An input's version is its tensor's]: a region inside a nested segment lets go of its inputs and is
    # handed others when it recomputes; one of them at a dead input's id is another tensor, not a modified one
    first = torch.zeros(8, 8)
    r = region.Region((first,), {}, None, None)
    r.finish_forward()
    r.release_inputs()
    dead, held = id(first), []
    del first
    for _ in range(10_000):
        other = torch.zeros(8, 8).add_(1)  # version 1; the input it replaces was recorded at 0
        if id(other) == dead:
            break
        held.append(other)  # so that the next tensor is made elsewhere
    assert id(other) == dead, "no tensor took the dead input's id"
    r.restore_inputs((other,))
    (handed,), _ = r.recompute_inputs()
    assert handed is other


def test_an_input_written_after_the_call_is_still_refused():
    x = torch.zeros(8, 8)
    r = region.Region((x,), {}, None, None)
    r.finish_forward()
    x.add_(1)
    with pytest.raises(remat.RecomputeError, match=r"modified in place after the call \(version 0 -> 1"):
        r.recompute_inputs()


class _Dense(nn.Module):
    """DenseNet's layer and block in short: each layer takes the list of every earlier output, and the block
    appends the layer's output to that same list after the call (torchvision's ``_DenseBlock``)."""

    def __init__(self, width=4, growth=4, layers=3, replace=False):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width + i * growth * (not replace), growth if not replace else width), nn.Tanh())
            for i in range(layers)
        )
        self.replace = replace

    def forward(self, x):
        features = [x]
        for layer in self.layers:
            out = layer(torch.cat(features, 1) if not self.replace else features[0])
            if self.replace:
                features[0] = out  # same shape: a recomputation from the list would silently read this
            else:
                features.append(out)
        return torch.cat(features, 1).sum(1, keepdim=True)


class _ListLayer(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, features):
        self.recomputed = getattr(self, "recomputed", 0) + remat.is_recomputing()
        return self.inner(torch.cat(features, 1) if len(features) > 1 else features[0])


def _dense_pair(replace, policy):
    torch.manual_seed(0)
    ref = _Dense(replace=replace)
    model = twin(ref)
    for m in (ref, model):
        m.layers = nn.ModuleList(_ListLayer(layer) for layer in m.layers)
        m.forward = _list_forward.__get__(m)
    for layer in model.layers:
        remat.wrap(layer, policy=policy)
    return ref, model


def _list_forward(self, x):
    features = [x]
    for layer in self.layers:
        out = layer(features)
        if self.replace:
            features[0] = out
        else:
            features.append(out)
    return torch.cat(features, 1).sum(1, keepdim=True)


@pytest.mark.parametrize("policy", ["full", "selective", "selective-ops"])
@pytest.mark.parametrize("replace", [False, True], ids=["appended", "replaced"])
def test_a_list_argument_changed_after_the_call_is_recomputed_as_the_call_saw_it(replace, policy):
    # The recomputation reruns the call on the arguments as the forward was handed them: the caller's list,
    # appended to or written after the call (DenseNet), is not what the forward saw. Appended, it failed on a
    # shape; replaced with a tensor of the same shape, the gradients were silently another function's.
    ref, model = _dense_pair(replace, policy)
    x = torch.randn(5, 4, requires_grad=True)
    _steps_match(ref, model, x, 2)
    if policy == "full":  # the selective policies rerun only the cheap submodules inside, from their own inputs
        assert all(layer.recomputed == 2 for layer in model.layers)


class _Branches(nn.Module):
    """timm's HRNet ``HighResolutionModule`` in short: its forward writes each branch's output into the list it
    was handed (``x[i] = branch(x[i])``), which its caller reads on."""

    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))
        self.recomputed = 0

    def forward(self, xs):
        self.recomputed += remat.is_recomputing()
        for i, branch in enumerate(self.branches):
            xs[i] = branch(xs[i])
        return xs


class _TwoStages(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.stages = nn.Linear(4, 8), nn.ModuleList(_Branches() for _ in range(2))

    def forward(self, x):
        xs = list(self.stem(x).chunk(2, dim=1))
        for stage in self.stages:
            xs = stage(xs)
        return xs[0] * xs[1]


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_a_forward_that_writes_its_argument_list_recomputes_from_the_list_it_was_handed(policy):
    # Recomputed on the list its forward had written, each branch ran on its own output: every gradient of
    # timm's HRNet with its stages checkpointed differed from the model's, with no error.
    torch.manual_seed(0)
    ref = _TwoStages()
    model = twin(ref)
    for stage in model.stages:
        remat.wrap(stage, policy=policy)
    _steps_match(ref, model, torch.randn(5, 4), 2)
    if policy == "full":
        assert all(stage.recomputed == 2 for stage in model.stages)


class _Statistics(nn.Module):
    """Buffers only: an observer, as QAT's fake-quantize modules keep one."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running", torch.zeros(6))


class _HandsOnItsChildsBuffers(nn.Module):
    """Updates its child's statistics in place without calling it, as torch's ``FusedMovingAvgObsFakeQuantize``
    hands its observer's ``min_val``/``max_val`` to ``fused_moving_avg_obs_fake_quant``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.observer = _Statistics()

    def forward(self, x):
        with torch.no_grad():
            self.observer.running.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return self.lin(x) * (1 + self.observer.running)


def test_the_buffers_of_a_submodule_never_entered_change_once():
    # NOTE [Buffers of submodules never entered]: recomputation updated them again and read the update
    torch.manual_seed(0)
    ref = _HandsOnItsChildsBuffers()
    model = twin(ref)
    x = torch.randn(5, 6, requires_grad=True)
    for seed in range(3):
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
        step(ref, x, seed=seed)
        step(model, x, seed=seed, fn=lambda t: remat.checkpoint(lambda u: model(u), t))
        assert_grads_equal(ref, model)
        assert_buffers_equal(ref, model)
