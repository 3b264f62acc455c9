"""Units from the execution: the modules a forward calls more than once.

NOTE [Units from the execution]
Units come from the module tree first (NOTE [Units] in remat.profiling._blocks): it needs no
run, and a module called once per layer is what it finds. A model whose tree repeats nothing
but whose forward calls one module again and again (ALBERT's one layer group applied at every
layer, a weight-tied recurrence, a block looped in ``forward``) has its units in the execution
instead. When the tree gives none, one forward runs on fake tensors (no memory, no gradient)
with a pre-hook on every module that has submodules; the units are the top-most modules it
called two or more times (none inside another). Each is one block called several times, which
the profile, the planner and the checkpoint already handle (``BlockProfile.calls``): a policy
applies to every call. A forward fake tensors cannot run (it reads a tensor's values:
transformers 4.x's padding check) runs for real where the profile is real anyway, without
gradients (less than the profile's own steps hold) and with the model's state and RNG put back;
a fake profile finds none here. With none, the traced cut is tried as before (NOTE [Cutting a
traced forward] in remat.profiling._traced).

A forward that fails on real tensors is the model's own error, and the profile's steps would
raise it too: remat.profile says so (which module raised what). Once it was swallowed, and a
model whose units come from the execution alone (ALBERT given labels of the wrong batch size)
got "found no blocks" from the traced cut, which cannot bind transformers 5's ``**kwargs``
forwards. On fake tensors the failure may be their refusal of an op, so the traced cut is
still tried, and if it fails too its message says what the fake forward raised.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.core._costs import spent
from remat.core._hf import cache_disabled, fake_tensors_untraced
from remat.core._state import capture, host_rng, restoring, set_host_rng
from remat.core._step import call_model, set_training
from remat.core._typing import Inputs
from remat.core._user_errors import first_line, model_errors, where_raised
from remat.errors import RematError
from remat.profiling._blocks import is_leaf
from remat.profiling._fake import FakeWeights, fake_inputs
from remat.profiling._random_branches import HOST_RUNS, RandomBranches, branches, weight_storages
from remat.profiling._shadow import ValueShadows

__all__ = ["called_more_than_once", "random_branches", "units_from_the_execution"]


def called_more_than_once(model: nn.Module, inputs: Inputs, *, training: bool | None, real: bool = False) -> list[str]:
    """The top-most modules with submodules that one forward of ``model`` calls two or more times, in registration
    order (NOTE [Units from the execution]); [] when there are none. A forward that fails raises: on fake tensors
    (without ``real``) their refusal of an op or the model's own error, with ``real`` the model's own error on
    real tensors."""
    names = {id(m): n for n, m in model.named_modules() if n and not is_leaf(m)}
    counts: Counter[str] = Counter()
    hooks = [
        m.register_forward_pre_hook(lambda module, _args: counts.update([names[id(module)]]))
        for m in model.modules()
        if id(m) in names
    ]
    try:
        with _in_mode(model, training):
            try:
                _fake_forward(model, inputs)
            except Exception:
                if not real:
                    raise
                counts.clear()
                _real_forward(model, inputs)
    finally:
        for hook in hooks:
            hook.remove()
    repeated = [n for n in names.values() if counts[n] >= 2]
    return [n for n in repeated if not any(n.startswith(outer + ".") for outer in repeated)]


def units_from_the_execution(
    model: Any, inputs: Any, names: list[str], training: bool | None, *, real: bool
) -> tuple[list[str], str]:
    """The modules the forward calls more than once, where the tree gave no units or only single layers that all
    sit inside them (a looped cell's own layers); else ``names`` (NOTE [Units from the execution]). With what a
    forward on fake tensors raised, for a message ("" if it ran); one on real tensors raises a RematError."""
    modules = dict(model.named_modules())
    if not all(is_leaf(modules[n]) for n in names):
        return names, ""  # units with layers of their own: the tree's levels stand
    if not all("." in n for n in names):
        return names, ""  # a layer of the model itself sits inside no module but the model: nothing to run
    try:
        with model_errors(model, "remat.profile", _LOOKING) if real else contextlib.nullcontext():
            called = called_more_than_once(model, inputs, training=training, real=real)
    except RematError:
        raise
    except Exception as exc:  # fake tensors' refusal or the model's own error: the traced cut may still run
        told = first_line(exc).rstrip(".")
        where = where_raised(model, exc)
        return names, f" ({_LOOKING}, on fake tensors, raised {type(exc).__name__}{where}: {told})"
    inside = all(any(n.startswith(unit + ".") for unit in called) for n in names)
    return (called if called and inside else names), ""


_LOOKING = "a forward without gradients that finds the modules it calls more than once"


@contextlib.contextmanager
def _in_mode(model: nn.Module, training: bool | None) -> Iterator[None]:
    """``model`` in ``training`` mode (None: as it is) while inside; every module's own mode put back after."""
    modes = {m: m.training for m in model.modules()}
    try:
        set_training(model, training)  # NOTE [Training mode keeps the modules the user froze]
        yield
    finally:
        for m, mode in modes.items():
            m.training = mode


def _fake_forward(model: nn.Module, inputs: Inputs) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    shadows = ValueShadows()  # small tensors keep real values: a Hugging Face mask or position ids
    fakes = fake_inputs(mode, shadows, inputs)
    host = host_rng()  # torch's generators do not move under fake tensors; Python's and NumPy's do
    with contextlib.ExitStack() as stack:
        stack.callback(set_host_rng, host)
        stack.enter_context(FakeWeights(model, mode, None))
        stack.enter_context(cache_disabled(model))
        stack.enter_context(fake_tensors_untraced())
        stack.enter_context(mode)
        stack.enter_context(shadows)
        stack.enter_context(torch.no_grad())
        call_model(model, fakes)


def _real_forward(model: nn.Module, inputs: Inputs, *modes: Any) -> None:
    state = capture(model, "remat.profile", parameters=False)  # buffers (BatchNorm statistics), modes, RNG
    with restoring("remat.profile", state.restore), cache_disabled(model), torch.no_grad(), contextlib.ExitStack() as s:
        for mode in modes:
            s.enter_context(mode)
        call_model(model, inputs)


def _sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds FSDP2 modules: a forward without gradients leaves the root's parameters unsharded
    (its backward would reshard them), and resharding by hand leaves the next backward mixing DTensors."""
    return any(hasattr(m, "unshard") and hasattr(m, "reshard") for m in model.modules())


def random_branches(model: nn.Module, inputs: Inputs, *, training: bool | None) -> tuple[str, ...]:
    """Where ``model``'s forward branches on a random draw (NOTE [Branches on random draws]): a real forward without
    gradients, draws forced low; where it read a draw a second one, forced high; where it moved Python's or NumPy's
    generator up to ``HOST_RUNS`` more from other states of them. The model's state and RNG put back after each; ()
    also when the forward fails (the profile's step says why), and for FSDP2 models, which it would leave
    unsharded."""
    if _sharded(model):
        return ()
    weights = weight_storages(model)
    low, high = RandomBranches("low", weights=weights), RandomBranches("high", weights=weights)
    host_runs: list[RandomBranches] = []
    try:
        with _in_mode(model, training), spent("random-branch forwards"):
            _real_forward(model, inputs, low)
            if low.reads or low.unforced:  # a draw read: a second run, forced high, shows whether it branches
                _real_forward(model, inputs, high)
            for seed in range(HOST_RUNS if low.host_moved else 0):  # the forward draws from Python or NumPy
                host_runs.append(RandomBranches("low", weights=weights, host_seed=seed, reference=low))
                _real_forward(model, inputs, host_runs[-1])
                if host_runs[-1].diverged is not None:
                    break
    except Exception:
        return ()
    return branches(low, high, *host_runs)
