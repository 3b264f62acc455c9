"""The data of ``remat.profile``: what each block keeps for backward, what recomputing it costs,
and a model of the step's peak for any mix of policies.

NOTE [The peak model]
Measurements show the peak of a training step often sits in backward, not at
the end of forward (measurements.md, point 1), so bytes saved for backward alone
mislead. The profiler runs one traced step per policy with every block under
that policy, cut into segments (``remat.profiling._trace``). For each segment it keeps
the change in live bytes (delta) and the most above its start (excess). The live
bytes of any assignment are composed by walking the forward segments, then the
backward segments, each taken from the run of its block's policy; glue takes the
policy of the block before it. The peak is the largest ``live + excess`` on the walk.
That alone is exact only where a segment depends on its own block's policy; storages
whose lifetime depends on other blocks' policies (a mask given to every block, a
block output the loss also reads) and recomputations that run outside their block's
backward are moved to where the assignment puts them (NOTE [Storages across blocks]
in ``remat.profiling._crossing``). Uniform assignments reproduce their own run
exactly; mixed ones are tested against measurement: to the byte on the zoo, never
under on generated DAGs (``tests/planning/test_dataflow_properties.py``). Autocast's cached weight casts
are freed where the autocast region ends, by the amount the composed step's own
segments made (NOTE [Autocast's weight casts outlive their block] in
``remat.profiling._trace``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from remat.core._loop import describe_loop
from remat.core._policy_registry import FULL, KEEP, REGISTRY
from remat.errors import RematError
from remat.profiling._crossing import Crossing, Recompute, corrections
from remat.profiling._format import human_bytes, load_versioned, render

__all__ = ["BlockProfile", "Profile", "SegmentCost"]

SCHEMA_VERSION = 1

Key = tuple[str, "str | None", int]


@dataclass(frozen=True)
class BlockProfile:
    """Costs of one block (summed over its calls), per policy where they differ."""

    name: str
    """Qualified module name."""
    input_bytes: int
    """Bytes of the tensors it is called with."""
    output_bytes: int
    """Bytes of the tensors it returns."""
    saved_bytes: dict[str, int]
    """Per policy: bytes it keeps alive for backward beyond its output, at the end of its forward."""
    fwd_time_s: float
    """Forward time without checkpointing."""
    bwd_time_s: float
    """Backward time without checkpointing."""
    extra_time_s: dict[str, float]
    """Per policy: extra step time against keeping everything (recomputation, bookkeeping)."""
    fwd_flops: int
    """FLOPs of its forward."""
    bwd_flops: dict[str, int]
    """Per policy: FLOPs of its backward segment, recomputation included."""
    calls: int = 1
    """Times it runs per step."""
    writes_input: bool = False
    """Its forward writes in place to a tensor it was called with (an in-place ReLU first): nested plans leave
    it and the block before it out of segments (NOTE [Inputs written in place inside a segment] in
    ``remat.planning._nested``)."""
    buffer_copies: dict[str, int] = field(default_factory=dict)
    """Per policy: bytes of the copies of buffers its forward writes (BatchNorm's running statistics) that its
    region holds from its forward to its backward; empty in older profiles (NOTE [Buffers a region keeps for its
    recomputation] in ``remat.planning._nested_copies``)."""
    buffer_snapshots: int = 0
    """Bytes of the small buffers (up to 64 KiB each) of the modules under it that its forward does not write (a
    rotary ``inv_freq``): a checkpointed region copies them on a later call and drops them at the end of its
    forward (NOTE [Buffers a segment copies and drops] in ``remat.planning._nested_copies``); 0 in older profiles."""
    views_input: bool = False
    """Its output shares storage with the tensor it is called with (a Flatten, a reshape): a segment's forward
    holds that storage until the block after it has run (NOTE [A block whose output is a view of its input] in
    ``remat.planning._nested_views``)."""
    without_grad: bool = False
    """Every forward of it in the step ran with gradients off (under the parent's ``torch.no_grad``, inside an
    autograd Function's forward): every plan keeps it (NOTE [A block run without gradients is kept] in
    ``remat.planning._solve``)."""
    single_op: bool = False
    """A lone single-op torch layer (a Linear, a LayerNorm): kept one level deep, checkpointed only inside a
    nested segment (NOTE [A lone layer is kept one level deep] in ``remat.planning._solve``)."""


@dataclass(frozen=True)
class SegmentCost:
    """One segment of the step under one policy (see NOTE [The peak model])."""

    delta: int
    excess: int
    seconds: float
    cast_cache: int = 0
    """Autocast weight casts made here that the autocast cache frees later in forward."""
    cast_release: int = 0
    """Such casts freed here, in this policy's run (included in ``delta``)."""
    excess_released: int = 0
    """Most above the start after the release, as if nothing had been released."""


@dataclass
class Profile:
    """Everything the planner needs about one model, batch and device."""

    model: str
    """Class name of the profiled model."""
    device: str
    """Device the step ran on (or the target device for fake profiles)."""
    blocks: tuple[BlockProfile, ...]
    """The blocks, in execution order."""
    resting_bytes: int
    """Parameters, buffers and inputs (with gradients they already hold), and what the training loop keeps alive:
    alive for the whole step."""
    param_bytes: int
    """Bytes of all parameters."""
    grad_bytes: int
    """Bytes of the gradients of the trainable parameters."""
    step_time_s: float
    """Median step time without checkpointing."""
    policies: tuple[str, ...]
    """Policies profiled; ``keep`` is always among them."""
    fwd_order: list[Key]
    """Forward segments in execution order."""
    bwd_order: list[Key]
    """Backward segments in execution order."""
    segments: dict[str, dict[Key, SegmentCost]]
    """Per policy: the cost of every segment in the run with all blocks under that policy."""
    fake: bool = False
    """True when profiled on fake tensors (times from the target's cost model)."""
    target: str | None = None
    """Cost-model target for fake profiles (``h100``, ``a100``, ``cpu``)."""
    notes: list[str] = field(default_factory=list)
    """Anything the user should know about this profile."""
    training: bool | None = None
    """The mode the step was profiled in (True: training); None in profiles saved before remat recorded it."""
    crossings: list[Crossing] = field(default_factory=list)
    """Storages blocks receive from outside them, whose lifetime depends on other blocks' policies
    (NOTE [Storages across blocks] in ``remat.profiling._crossing``)."""
    recomputes: list[Recompute] = field(default_factory=list)
    """Where each block's recomputation ran in each policy's run, and what it added to live bytes."""
    unchained: tuple[str, ...] = ()
    """Blocks whose output the forward reads other than as the next block's input (no nested segment runs
    past them: NOTE [What the parent does with a block's output] in remat.planning._nested)."""
    new_arguments: tuple[str, ...] = ()
    """Blocks called with other arguments than tensors (their number, keywords, values) than the block before them:
    no nested segment holds both (NOTE [Arguments a segment hands on] in remat.planning._nested_costs)."""
    skips_layers: tuple[str, ...] = ()
    """The model's LayerDrop probabilities above 0 (``"Wav2Vec2Config.layerdrop = 0.1"``): a later step may skip any
    layer, so no nested segment is planned (NOTE [LayerDrop and nested segments] in remat.core._hf)."""
    random_branches: tuple[str, ...] = ()
    """Where the forward reads a random draw into Python (``file.py:line (function)``): a later step may take
    another path than the profiled one (NOTE [Branches on random draws] in remat.profiling._random_branches)."""
    parameters: int | None = None
    """Parameter elements of the profiled model: the plan's fingerprint of it (None in older profiles)."""
    optimizer: str | None = None
    """Class name of the optimizer stepped after each backward (NOTE [The step a loop repeats]); None: none."""
    optimizer_bytes: int = 0
    """Bytes of the optimizer's state, part of ``resting_bytes``."""
    accumulation_steps: int = 1
    """Backward passes per optimizer step; from 2 on, the gradients are part of ``resting_bytes``."""

    # -- the peak model --------------------------------------------------------
    def _check(self, assignment: Mapping[str, str] | Any | None) -> dict[str, str]:
        if assignment is None:
            return {}
        if hasattr(assignment, "assignment"):
            assignment = assignment.assignment
        names = {b.name for b in self.blocks}
        unknown = sorted(set(assignment) - names)
        if unknown:
            raise RematError(f"remat.Profile: {unknown} are not blocks of this profile; blocks: {sorted(names)}.")
        bad = {b: p for b, p in assignment.items() if p not in self.policies}
        if bad:
            raise RematError(f"remat.Profile: policies {bad} were not profiled; profiled: {list(self.policies)}.")
        return dict(assignment)

    def _segment_policies(self, assignment: Mapping[str, str]) -> list[tuple[Key, str]]:
        # Glue takes the policy of the block before it in forward: that block's
        # policy decides who holds the tensors the glue receives.
        steps, previous = [], None
        for key in self.fwd_order:
            previous = key[1] or previous
            steps.append((key, assignment.get(previous, KEEP) if previous else KEEP))
        for key in self.bwd_order:
            owner = key[1] or previous
            steps.append((key, assignment.get(owner, KEEP) if owner else KEEP))
        return steps

    def timeline(self, assignment: Mapping[str, str] | Any | None = None) -> list[tuple[Key, int, int]]:
        """(segment, live bytes at its start, most live inside it) along the composed step."""
        # NOTE [A block run without gradients is kept] in remat.planning._solve: predicted as kept
        kept = {b.name for b in self.blocks if b.without_grad}
        assignment = {b: p for b, p in self._check(assignment).items() if b not in kept}
        steps = self._segment_policies(assignment)
        fixes = corrections(self.crossings, self.recomputes, steps, assignment)
        releases = {k for segs in self.segments.values() for k, c in segs.items() if c.cast_release}
        live, pending, out = self.resting_bytes, 0, []
        for i, (key, policy) in enumerate(steps):
            cost = self.segments[policy][key]
            added, at_least, extra, replaced = fixes.get(i, (0, 0, 0, None))
            top = live + max(cost.excess if replaced is None else replaced, at_least) + extra
            if key in releases:  # free the casts this composed step made, not those of the run
                if cost.cast_release:
                    top = max(top, live + cost.excess_released - pending + extra)
                out.append((key, live, top))
                live += cost.delta + added + cost.cast_release - pending
                pending = 0
            else:
                out.append((key, live, top))
                live += cost.delta + added
            pending += cost.cast_cache
        return out

    def predict_peak(self, assignment: Mapping[str, str] | Any | None = None) -> int:
        """Predicted peak bytes of a training step with ``assignment`` (block name -> policy; default keep)."""
        return max((top for _, _, top in self.timeline(assignment)), default=self.resting_bytes)

    def predict_time(self, assignment: Mapping[str, str] | Any | None = None) -> float:
        """Predicted step time in seconds with ``assignment``."""
        assignment = self._check(assignment)
        by_name = {b.name: b for b in self.blocks}
        return self.step_time_s + sum(by_name[n].extra_time_s[p] for n, p in assignment.items())

    @property
    def loop(self) -> str:
        """What the profiled step holds beyond forward and backward (NOTE [The step a loop repeats]); "" if nothing."""
        return describe_loop(self.optimizer, self.accumulation_steps)

    def held_by_loop(self) -> str:
        """For messages about floors: what of the resting bytes the training loop keeps alive ("" if nothing)."""
        parts = [f"{self.optimizer}'s state {human_bytes(self.optimizer_bytes)}"] if self.optimizer else []
        if self.accumulation_steps > 1:
            parts.append(
                f"gradients {human_bytes(self.grad_bytes)} (accumulated over {self.accumulation_steps} backward passes)"
            )
        return (
            (
                f" Of the resting {human_bytes(self.resting_bytes)}, the training loop keeps {' and '.join(parts)} "
                "alive through every step: no checkpointing plan lowers that."
            )
            if parts
            else ""
        )

    @property
    def baseline_peak_bytes(self) -> int:
        """Peak without any checkpointing."""
        return self.predict_peak({})

    # -- rendering ---------------------------------------------------------------
    def table(self) -> str:
        """A readable per-block table (plain text)."""
        return profile_table(self)

    def to_json(self) -> str:
        """Serialise (schema-versioned)."""
        data = asdict(self)
        data["schema"] = SCHEMA_VERSION
        data["segments"] = {p: [[list(k), asdict(c)] for k, c in segs.items()] for p, segs in self.segments.items()}
        data["fwd_order"] = [list(k) for k in self.fwd_order]
        data["bwd_order"] = [list(k) for k in self.bwd_order]
        data["crossings"] = [c.to_json() for c in self.crossings]
        data["recomputes"] = [r.to_json() for r in self.recomputes]
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """Load what :meth:`to_json` wrote; refuses unknown schema versions."""
        data = load_versioned(text, what="remat.Profile.from_json", schema=SCHEMA_VERSION)
        data["blocks"] = tuple(BlockProfile(**b) for b in data["blocks"])
        data["policies"] = tuple(data["policies"])
        data["fwd_order"] = [tuple(k) for k in data["fwd_order"]]
        data["bwd_order"] = [tuple(k) for k in data["bwd_order"]]
        data["segments"] = {p: {tuple(k): SegmentCost(**c) for k, c in segs} for p, segs in data["segments"].items()}
        data["crossings"] = [Crossing.from_json(c) for c in data.get("crossings", [])]
        data["recomputes"] = [Recompute.from_json(r) for r in data.get("recomputes", [])]
        data["unchained"] = tuple(data.get("unchained", ()))
        data["new_arguments"] = tuple(data.get("new_arguments", ()))
        data["random_branches"] = tuple(data.get("random_branches", ()))
        data["skips_layers"] = tuple(data.get("skips_layers", ()))
        return cls(**data)


def profile_table(p: Profile) -> str:
    shown = [k for k in p.policies if k != KEEP]
    short = {q.name: q.short for q in REGISTRY}
    header = [
        "block",
        "in",
        "out",
        "saved keep",
        *(f"saved {short.get(k, k)}" for k in shown),
        "fwd ms",
        "bwd ms",
        *(f"+ms {short.get(k, k)}" for k in shown),
        "GFLOP fwd",
        "peak if full",
    ]
    base = p.baseline_peak_bytes
    rows = []
    for b in p.blocks:
        alone = p.predict_peak({b.name: FULL}) if FULL in p.policies else base
        rows.append(
            [
                b.name,
                human_bytes(b.input_bytes),
                human_bytes(b.output_bytes),
                *(human_bytes(b.saved_bytes.get(k, 0)) if k in b.saved_bytes else "-" for k in (KEEP, *shown)),
                f"{b.fwd_time_s * 1e3:.1f}",
                f"{b.bwd_time_s * 1e3:.1f}",
                *(f"{b.extra_time_s[k] * 1e3:.1f}" if k in b.extra_time_s else "-" for k in shown),
                f"{b.fwd_flops / 1e9:.2f}",
                f"{(alone - base) / base:+.1%}",
            ]
        )
    kind = f"fake tensors, times modelled for {p.target}" if p.fake else f"measured on {p.device}"
    summary = (
        f"{p.model}: {len(p.blocks)} blocks, {kind}. Resting {human_bytes(p.resting_bytes)} "
        f"(parameters {human_bytes(p.param_bytes)}), gradients {human_bytes(p.grad_bytes)}, "
        f"peak without checkpointing {human_bytes(base)}, step {p.step_time_s * 1e3:.0f} ms."
    )
    return "\n".join([summary, render(header, rows), *p.notes])
