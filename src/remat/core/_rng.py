"""Random streams under selective checkpointing.

NOTE [A saved random op must still advance the generator]
A selective policy keeps some ops' outputs and recomputes the rest. When a kept op
draws random numbers (on CUDA, SDPA with ``dropout_p > 0`` is one fused kernel that
draws from the Philox generator; so is a Triton or flash-attention kernel with dropout,
or a custom op that calls ``torch.rand`` inside), recompute returns the saved output
without running it, the generator is not advanced, and every later random op of the
block draws a different mask than the forward did. Gradients are then computed for a
forward that never happened (measured on an H100: 2.9e-2 on GPT-2 with SDPA dropout;
on CPU, a custom op drawing inside one kernel followed by dropout: 10.4; torch's own
selective checkpointing has the same flaw). On CPU, SDPA with dropout takes the math
path (a separate, recomputed dropout op), which is why no CPU test of SDPA sees it.

torch restores the generators at the start of recompute, so recompute draws what the
forward drew, op for op, up to the first skipped draw. The ledger records, in forward,
the states of the generators a kept op moved, right after it ran; in recompute a
dispatch mode sets them again right after the cached output is returned: the stream
goes on exactly as if the op had run, and saving the op keeps its speed. It applies to
every selective policy remat runs, user-given op lists and functions included. The
mode is entered only in recomputations of calls where a kept op moved a generator, and
puts the generators back as it found them on leaving (a device torch did not fork).

NOTE [Random draws are seen, not named]
Which kept ops draw is observed, not looked up by name: nothing in a custom op's name
or tags tells that it draws inside (a ``torch.library.custom_op`` calling ``torch.rand``,
a Triton or flash-attention kernel with dropout). After each such op the policy keeps,
the ledger reads the default generators in use (the CPU one's Mersenne Twister state; a
CUDA one's Philox seed and offset, which a kernel launch moves on the host) and compares
them with the states it last read: moved means drawn. torch's own ops declare their
draws: every aten overload that takes a generator, and each attention kernel with
dropout, is tagged ``nondeterministic_seeded`` (a test checks it on the installed torch),
so a kept aten op is read only when tagged, and a kept matmul costs nothing. Ops the
policy recomputes are never read: they draw again by themselves in recompute. A draw by
a recomputed op since the last read is thus blamed on the next kept op read; setting
the state it left is harmless (recompute has drawn the same by then), it only costs the
dispatch mode in that call's recompute.
Where a kept op that is known to draw meets a generator whose state cannot be read
(CUDA graph capture), the draw cannot be replayed and the call is refused with a
RematError.

torch before ``SelectiveCheckpointContext(op_output=...)`` asks the policy before it
runs the op; the ledger then reads the states at the next policy call, which comes right
after the op ran (a kept op last in the forward leaves nothing to replay for).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from remat.errors import RematError

Policy = Callable[..., Any]
SAVE_DECISIONS = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE, True)
#: torch asks the policy right after running the op (NOTE [Random draws are seen, not named]).
POLICY_AFTER_OP = "op_output" in inspect.signature(SelectiveCheckpointContext).parameters


def draws_random(func: Any) -> bool:
    """True for an op that consumes an RNG (its schema is tagged ``nondeterministic_seeded``)."""
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def declares_draws(func: Any) -> bool:
    """True for an op whose randomness its tags tell (torch's own aten ops); others are observed."""
    return getattr(func, "namespace", None) == "aten"


_WATCHED: dict[Any, bool] = {}


def _watched(func: Any) -> bool:
    """Whether the ledger follows ``func``'s calls: it draws, or it may (NOTE [Random draws are seen, not named])."""
    watched = _WATCHED.get(func)
    if watched is None:
        watched = _WATCHED[func] = draws_random(func) or not declares_draws(func)
    return watched


def _default_generator(device: torch.device) -> torch.Generator | None:
    if device.type == "cpu":
        return torch.default_generator
    backend = getattr(torch, device.type, None)
    generators = getattr(backend, "default_generators", ()) if backend is not None else ()
    if not generators:  # meta, fake or uninitialised devices draw nothing real
        return None
    index = device.index if device.index is not None else backend.current_device()
    return generators[index] if index < len(generators) else None


def generators_in_use() -> list[torch.Generator]:
    """The default generators an op can draw from: the CPU one, and the current device's of each
    accelerator already initialised (one that is not has drawn nothing and has no state to keep)."""
    found = [torch.default_generator]
    for name in ("cuda", "xpu"):
        backend = getattr(torch, name, None)
        initialised = getattr(backend, "is_initialized", None)
        if backend is not None and initialised is not None and initialised():
            generator = _default_generator(torch.device(name, backend.current_device()))
            if generator is not None:
                found.append(generator)
    return found


def read_state(generator: torch.Generator) -> tuple[torch.Tensor, bytes] | None:
    """(state, its bytes to compare) of ``generator``; None where it cannot be read (CUDA graph capture).
    Read with Python dispatch off: under a fake-tensor profile the state would be made a fake tensor."""
    with torch._C._DisableTorchDispatch():
        try:
            state = generator.get_state()
        except RuntimeError:
            return None
        return state, state.numpy().tobytes()


def fingerprint() -> tuple[bytes | None, ...]:
    """The states of :func:`generators_in_use`, to compare: unequal means something drew."""
    return tuple(None if s is None else s[1] for s in map(read_state, generators_in_use()))


def _tensors(values: tuple) -> Iterator[torch.Tensor]:
    """The tensors among an op's arguments (a schema's are flat: Tensor, Tensor[], Tensor?[]); cheaper than pytree."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (t for t in value if isinstance(t, torch.Tensor))


class RngLedger:
    """Generator states right after each kept op that moved them, in one checkpointed forward."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.calls: defaultdict[Any, int] = defaultdict(int)
        """Calls so far of each op that may draw: the k-th call of an op in forward is its k-th in recompute."""
        self.states: dict[tuple[Any, int], list[tuple[torch.Generator, torch.Tensor]]] = {}
        self._last: list[list[Any]] = []
        """[generator, bytes of its state last read] (the call starts before its forward)."""
        for generator in generators_in_use():
            state = read_state(generator)
            self._last.append([generator, None if state is None else state[1]])
        self._pending: tuple[Any, int] | None = None

    def decide(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        """The user's policy, noting the generators' states after each kept op (NOTE above)."""
        decision = self.policy(ctx, func, *args, **kwargs)
        if ctx.is_recompute:
            return decision
        if self._pending is not None:  # torch asked before the op: it has run now
            self._observe(*self._pending)
            self._pending = None
        if not _watched(func) or torch.compiler.is_compiling():
            return decision  # the hot path: torch's own ops that draw nothing
        index = self.calls[func]
        self.calls[func] = index + 1
        if decision in SAVE_DECISIONS:
            self._follow(args, kwargs)
            if POLICY_AFTER_OP:
                self._observe(func, index)
            else:
                self._pending = (func, index)
        return decision

    def _follow(self, args: tuple, kwargs: dict) -> None:
        """Also read the generators of the devices a kept op's tensors are on (a device not current). One first
        seen now has no earlier state: its first read counts as moved, which is harmless (NOTE above)."""
        for device in {t.device for t in _tensors((*args, *kwargs.values()))}:
            generator = _default_generator(device)
            if generator is not None and all(entry[0] is not generator for entry in self._last):
                self._last.append([generator, None])

    def _observe(self, func: Any, index: int) -> None:
        """Record the generators' states after the kept ``func`` where they moved since the last read."""
        moved = []
        for entry in self._last:
            state = read_state(entry[0])
            if state is None:
                if draws_random(func):
                    raise _unreplayable(func, entry[0])
                continue
            if state[1] != entry[1]:
                entry[1] = state[1]
                moved.append((entry[0], state[0]))
        if moved:
            self.states[(func, index)] = moved

    def replay(self) -> _Replay | None:
        """A mode that advances the generators past each kept op that drew, in recompute (None: nothing to do)."""
        return _Replay(self) if self.states else None


def _unreplayable(func: Any, generator: torch.Generator) -> RematError:
    return RematError(
        f"remat.checkpoint: the policy keeps {func}, which draws random numbers, but the state of the "
        f"{generator.device} generator cannot be read here (CUDA graph capture?), so recompute cannot advance it "
        "past the kept op and every later random op of the call would draw different numbers. Leave the op out "
        "of the policy (it is then recomputed and draws the same numbers again), or checkpoint outside the capture."
    )


class _Replay(TorchDispatchMode):
    """In recompute, sets the generators after a kept op that drew as the forward left them."""

    def __init__(self, ledger: RngLedger) -> None:
        super().__init__()
        self.ledger = ledger
        self.funcs = {func for func, _ in ledger.states}
        self.calls: defaultdict[Any, int] = defaultdict(int)
        self._found: list[tuple[torch.Generator, torch.Tensor]] = []

    def _generators(self) -> Iterator[torch.Generator]:
        seen: set[int] = set()
        for moved in self.ledger.states.values():
            for generator, _ in moved:
                if id(generator) not in seen:
                    seen.add(id(generator))
                    yield generator

    def __enter__(self) -> _Replay:
        self.calls.clear()  # each recomputation (retain_graph) replays from the start
        found = ((g, read_state(g)) for g in self._generators())
        self._found = [(g, state[0]) for g, state in found if state is not None]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for generator, state in self._found:
                generator.set_state(state)

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
