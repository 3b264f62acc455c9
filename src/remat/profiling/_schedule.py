"""Which steps a profile runs, in what order, and what each phase costs (``remat profile -v``)."""

from __future__ import annotations

import gc
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from torch import nn

from remat.core._costs import spent
from remat.core._policy_registry import SELECTIVE, SELECTIVE_OPS
from remat.core._step import LossFn, training_step

if TYPE_CHECKING:
    from remat.profiling._types import Profile

log = logging.getLogger("remat")


@contextmanager
def young_collections(*, full: bool) -> Iterator[None]:
    """Let the garbage collections before every traced step look only at what the profile itself made;
    with ``full``, collect everything once first.

    NOTE [A garbage collection per traced step]
    Each traced step starts with ``gc.collect()`` so that cyclic garbage of the previous step is gone
    before counting (and a collection is less likely to fire inside the step). On a process that
    imported ``transformers`` a full collection walks millions of objects, as long as a training step
    of a small GPT. Freezing the heap that existed before the profile makes the later ones walk only
    the objects made since, a thousandth of that. Left alone when the caller froze objects of its
    own, which unfreezing would release.

    The one full collection before the freeze (``full``) matters only where the heap's garbage can
    hold the memory the steps need: a model on a GPU, whose old cyclic garbage (the frames of a step
    that ran out of memory) may hold device memory. On the CPU the steps are counted by the storages
    they make, and fake tensors hold nothing, so garbage from before the call costs them nothing and
    the collection (150 ms in such a process, 2-13 steps of the zoo models on this CPU) is skipped;
    what was frozen goes back to the oldest generation afterwards, to be collected as it would have been.
    """
    if full:
        with spent("garbage collections"):
            gc.collect()
    if gc.get_freeze_count() > 0:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class Phases:
    """Seconds and steps per phase of a profile, logged at INFO (``remat profile -v``)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps: dict[str, int] = defaultdict(int)

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with spent(f"real {phase} steps"):  # NOTE [Where the time goes]
                yield
        finally:
            self.seconds[phase] += time.perf_counter() - start
            self.steps[phase] += 1

    def log(self, step_s: float) -> None:
        total = time.perf_counter() - self.start
        parts = ", ".join(f"{self.steps[p]} {p} steps {s:.2f} s" for p, s in self.seconds.items())
        log.info(
            "remat.profile: %s; %.2f s in all, %.1f training steps without checkpointing (%.3f s each)",
            parts,
            total,
            total / step_s if step_s > 0 else float("nan"),
            step_s,
        )


# NOTE [selective-ops traces selective's learning]
# A block's first "selective" call runs op-level, as every "selective-ops" call does (the same policy
# function, so the same ops saved and the same recomputation; the structure recorder beside it holds no
# tensor), and learns the block's cheap submodules on the side (NOTE [Selective by module] in
# remat.core._by_module). Later calls take the fast path, and the traced step of "selective" must be one
# of those, as every step of an applied plan is. When both policies are profiled, selective-ops' traced
# step runs the blocks under "selective" on their first call: it measures selective-ops and learns, and
# selective's traced step needs no learning step before it: one training step less per profile. What the
# blocks learned earlier (another profile, training) is forgotten first, so that first call is op-level.
def trace_schedule(policies: Sequence[str]) -> list[tuple[str, str, bool]]:
    """Per traced step, in order: (the policy it profiles, the policy its blocks run, whether one untraced
    step learns selective's structure before it)."""
    both = SELECTIVE in policies and SELECTIVE_OPS in policies
    out = []
    for policy in policies:
        if both and policy == SELECTIVE_OPS:
            continue
        if both and policy == SELECTIVE:
            out += [(SELECTIVE_OPS, SELECTIVE, False), (SELECTIVE, SELECTIVE, False)]
        else:
            out.append((policy, policy, policy == SELECTIVE))
    return out


def learn_structure(model: nn.Module, inputs: Any, loss_fn: LossFn | None) -> None:
    """Run one untraced step, so that the "selective" blocks' next call is their fast path.

    A block's first selective call learns its cheap submodules op-level and later calls take the fast path
    (NOTE [Selective by module] in remat.core._by_module): the traced step must be a later call, as every
    step of the applied plan is, or the profile would predict the op-level policy's memory. A forward would
    be enough to learn, but a whole step leaves the model as steps do (FSDP keeps the root's parameters
    unsharded after a forward alone, and the snapshot holds sharded ones); the caller restores what it
    changed (parameters, gradients, buffers, RNG).
    """
    training_step(model, inputs, loss_fn)
    model.zero_grad(set_to_none=True)


# NOTE [A policy traced only when wanted]
# auto's fake profile (NOTE [Within the budget] in remat.planning._within) may need full-fine, which lowers the
# floor, but only for budgets the other policies cannot reach (NOTE [Finer only when needed] in
# remat.planning.apply). Tracing it for every budget costs a fifth of the fake profile; tracing it after the
# fact would trace every policy again. So while auto asks for it here, the fake profile traces that policy last,
# with the same fake weights and inputs, and only if the profile of the policies before it says the plan needs it.
_ONLY_IF: ContextVar[tuple[str, Callable[[Profile], bool]] | None] = ContextVar("remat_traced_only_if", default=None)


@contextmanager
def traced_only_if(policy: str, wanted: Callable[[Profile], bool]) -> Iterator[None]:
    """While it lasts, a fake profile traces ``policy`` last, and only if ``wanted(the profile of the others)``."""
    token = _ONLY_IF.set((policy, wanted))
    try:
        yield
    finally:
        _ONLY_IF.reset(token)


def traced_if() -> tuple[str, Callable[[Profile], bool]] | None:
    """The policy a fake profile traces only when wanted, and the test, while :func:`traced_only_if` lasts."""
    return _ONLY_IF.get()
