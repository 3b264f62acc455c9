"""Random streams under selective checkpointing.

NOTE [A saved random op must still advance the generator]
A selective policy keeps some ops' outputs and recomputes the rest. When a kept op
draws random numbers (on CUDA, SDPA with ``dropout_p > 0`` is one fused kernel that
draws from the Philox generator; ``native_dropout``, ``bernoulli``, ``rand*``, any op
tagged ``nondeterministic_seeded``), recompute returns the saved output without running
it, the generator is not advanced, and every later random op of the block draws a
different mask than the forward did. Gradients are then computed for a forward that
never happened (measured on an H100: 2.9e-2 on GPT-2 with SDPA dropout; torch's own
selective checkpointing has the same flaw). On CPU, SDPA with dropout takes the math
path (a separate, recomputed dropout op), which is why no CPU test saw it.

torch restores the generators at the start of recompute, so the k-th call of a random
op in recompute starts from the state its k-th call in forward started from. The ledger
records, in forward, the states of the generators a kept random op used right after it
ran (the policy function is called right after the op), and in recompute sets them again
right after the cached output is returned: the stream goes on exactly as if the op had
run, on CPU and CUDA generators alike, and saving the op keeps its speed. It applies to
every selective policy remat runs, user-given op lists and functions included.

A custom op that draws random numbers is seen as random when it is defined with
``tags=(torch.Tag.nondeterministic_seeded,)``, as torch's own random ops are.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy

Policy = Callable[..., Any]
SAVE_DECISIONS = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE, True)


def draws_random(func: Any) -> bool:
    """True for an op that consumes an RNG (its schema is tagged ``nondeterministic_seeded``)."""
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def _default_generator(device: torch.device) -> torch.Generator | None:
    if device.type == "cpu":
        return torch.default_generator
    backend = getattr(torch, device.type, None)
    generators = getattr(backend, "default_generators", ()) if backend is not None else ()
    if not generators:  # meta, fake or uninitialised devices draw nothing real
        return None
    index = device.index if device.index is not None else backend.current_device()
    return generators[index] if index < len(generators) else None


def generators_of(args: tuple, kwargs: dict) -> list[torch.Generator]:
    """The generators an op called with ``args``/``kwargs`` draws from."""
    explicit = kwargs.get("generator")
    if isinstance(explicit, torch.Generator):
        return [explicit]
    leaves, _ = tree_flatten((args, kwargs))
    devices = {t.device: None for t in leaves if isinstance(t, torch.Tensor)}
    if kwargs.get("device") is not None:
        devices[torch.device(kwargs["device"])] = None
    if not devices:  # a factory op without a device argument
        devices[torch.empty(0).device] = None
    found = (_default_generator(d) for d in devices)
    return [g for g in found if g is not None]


class RngLedger:
    """Generator states right after each kept random op of one checkpointed forward."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.calls: defaultdict[Any, int] = defaultdict(int)
        self.states: dict[tuple[Any, int], list[tuple[torch.Generator, torch.Tensor]]] = {}

    def decide(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        """The user's policy, noting the generators' states when it keeps a random op."""
        decision = self.policy(ctx, func, *args, **kwargs)
        if draws_random(func) and not ctx.is_recompute and not torch.compiler.is_compiling():
            index = self.calls[func]
            self.calls[func] = index + 1
            if decision in SAVE_DECISIONS:
                self.states[(func, index)] = [(g, g.get_state()) for g in generators_of(args, kwargs)]
        return decision

    def replay(self) -> _Replay | None:
        """A mode that advances the generators past each kept random op in recompute (None: nothing to do)."""
        return _Replay(self) if self.states else None


class _Replay(TorchDispatchMode):
    """In recompute, sets the generators after a kept random op as the forward left them."""

    def __init__(self, ledger: RngLedger) -> None:
        super().__init__()
        self.ledger = ledger
        self.funcs = {func for func, _ in ledger.states}
        self.calls: defaultdict[Any, int] = defaultdict(int)

    def __enter__(self) -> _Replay:
        self.calls.clear()  # each recomputation (retain_graph) replays from the start
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func in self.funcs:
            index = self.calls[func]
            self.calls[func] = index + 1
            for generator, state in self.ledger.states.get((func, index), ()):
                generator.set_state(state)
        return out


class ReplayContext:
    """Entered in every recomputation, above the selective-checkpoint cache: see the NOTE above."""

    def __init__(self, ledger: RngLedger) -> None:
        self.ledger = ledger
        self._modes: list[_Replay | None] = []

    def __enter__(self) -> None:
        mode = self.ledger.replay()
        if mode is not None:
            mode.__enter__()
        self._modes.append(mode)

    def __exit__(self, *exc: Any) -> None:
        mode = self._modes.pop()
        if mode is not None:
            mode.__exit__(*exc)
