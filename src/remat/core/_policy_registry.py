"""The checkpoint policies, each defined once: its name, what it means, eager and under compile.

Every other module names a policy through the constants here (``KEEP``, ``FULL``, ...) or asks
this registry (:func:`policy`, :data:`NAMES`); ``tests/core/test_policies.py`` fails on a policy
name written as a string literal anywhere else in ``src/remat``, and checks that the table in
``docs/policies.md`` is the one :func:`markdown_table` writes.

NOTE [One word, one policy]
A policy is named and described only here, each of its behaviours beside its name: what it does
on a module, on a function or an op list, and under compile. One name runs differently in those
places ("selective" goes by module on a module, op by op on a function, and keeps random ops
under compile), so code that asks "is this selective?" and the page that tells the user what it
does must read the same definition, not copies that drift apart.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from remat.errors import RematError

__all__ = [
    "FULL",
    "FULL_FINE",
    "KEEP",
    "NAMES",
    "POLICIES",
    "REGISTRY",
    "SELECTIVE",
    "SELECTIVE_OPS",
    "SELECTIVES",
    "Policy",
    "markdown_table",
    "policy",
    "with_table",
    "write_page",
]

KEEP = "keep"
SELECTIVE = "selective"
SELECTIVE_OPS = "selective-ops"
FULL = "full"
FULL_FINE = "full-fine"


@dataclass(frozen=True)
class Policy:
    """One checkpoint policy a block (or a call of ``remat.checkpoint``) can have."""

    name: str
    """What users write: ``policy="full"``, a plan's assignment, a profile's policies."""
    meaning: str
    """One line: what the policy is for."""
    eager: str
    """What it saves and recomputes in eager execution."""
    compiled: str
    """What it saves and recomputes under ``torch.compile``."""
    by_module: bool
    """On a module, it learns the module's structure and recomputes cheap submodules as regions
    (NOTE [Selective by module] in ``remat.core._by_module``) instead of running op by op."""
    on_function: bool
    """``remat.checkpoint(fn, policy=name)`` and ``remat.wrap(module, policy=name)`` take it; False for
    policies only a plan puts on a block."""
    short: str
    """The column title in profile tables."""


#: Every policy, from the one that keeps most to the one that keeps least.
REGISTRY: tuple[Policy, ...] = (
    Policy(
        name=KEEP,
        meaning="no checkpointing: the block runs as it would without remat",
        eager="keeps every activation; nothing is recomputed",
        compiled="as eager",
        by_module=False,
        on_function=True,
        short=KEEP,
    ),
    Policy(
        name=SELECTIVE,
        meaning="keep the outputs of matmuls, convolutions and attention; recompute the cheap ops",
        eager=(
            "on a module, by module: the first call runs op by op and learns the cheap submodules, later calls "
            "recompute only those, each as a region, and keep what random submodules make; on a function or an "
            "op list, op by op as `selective-ops`"
        ),
        compiled="torch's op-level selective checkpoint keeping `remat.SAVE_OPS` and the outputs of random ops",
        by_module=True,
        on_function=True,
        short="sel",
    ),
    Policy(
        name=SELECTIVE_OPS,
        meaning="`selective` op by op on every call (a Python hook on every op)",
        eager="keeps the outputs of `remat.SAVE_OPS`, recomputes every other op (random ones draw the same numbers)",
        compiled="as `selective`",
        by_module=False,
        on_function=True,
        short="sel-ops",
    ),
    Policy(
        name=FULL,
        meaning="recompute the whole block in backward",
        eager="keeps only the block's inputs; its forward runs again in backward",
        compiled="as eager, through torch's checkpoint operator",
        by_module=False,
        on_function=True,
        short=FULL,
    ),
    Policy(
        name=FULL_FINE,
        meaning="`full`, and the block's container sub-layers checkpointed inside its recomputation",
        eager=(
            "keeps the block's inputs; its recomputation keeps only its sub-layers' inputs, each sub-layer "
            "recomputed once more in turn (a block without sub-layers is `full`)"
        ),
        compiled="as eager, regions inside a region (`remat.auto(compiled=...)` does not pick it)",
        by_module=False,
        on_function=False,
        short=FULL_FINE,
    ),
)

#: Every policy name, in :data:`REGISTRY`'s order (what a plan may assign).
NAMES: tuple[str, ...] = tuple(p.name for p in REGISTRY)
#: The policies ``remat.checkpoint`` and ``remat.wrap`` take (``remat.POLICIES``).
POLICIES: tuple[str, ...] = tuple(p.name for p in REGISTRY if p.on_function)
#: The policies that keep ``remat.SAVE_OPS``' outputs, however they run.
SELECTIVES: tuple[str, ...] = (SELECTIVE, SELECTIVE_OPS)

_BY_NAME = {p.name: p for p in REGISTRY}


def policy(name: str) -> Policy:
    """The policy called ``name``; a :class:`~remat.errors.RematError` naming the valid ones otherwise."""
    found = _BY_NAME.get(name) if isinstance(name, str) else None
    if found is None:
        raise RematError(f"remat: unknown policy {name!r}; the policies are {', '.join(map(repr, NAMES))}.")
    return found


BEGIN = "<!-- remat.core._policy_registry writes from here -->"
END = "<!-- remat.core._policy_registry wrote up to here -->"


def markdown_table() -> str:
    """The table of :data:`REGISTRY` that ``docs/policies.md`` holds between :data:`BEGIN` and :data:`END`."""
    rows = [
        "| policy | meaning | eager | under `torch.compile` | by module on a module | `checkpoint` / `wrap` |",
        "|---|---|---|---|---|---|",
    ]
    for p in REGISTRY:
        flags = ("yes" if p.by_module else "no", "yes" if p.on_function else "no (plans only)")
        rows.append(f"| `{p.name}` | {p.meaning} | {p.eager} | {p.compiled} | {flags[0]} | {flags[1]} |")
    return "\n".join(rows) + "\n"


def with_table(page: str) -> str:
    """``page`` with the text between its markers replaced by :func:`markdown_table`."""
    if BEGIN not in page or END not in page:
        raise RematError(f"remat: the page has no markers {BEGIN!r} ... {END!r} to write the policy table between.")
    head, rest = page.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{BEGIN}\n{markdown_table()}{END}{tail}"


def write_page(path: str | pathlib.Path) -> None:
    """Rewrite the policy table in the page at ``path`` (``docs/policies.md``) from :data:`REGISTRY`."""
    page = pathlib.Path(path)
    page.write_text(with_table(page.read_text()))
