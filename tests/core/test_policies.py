"""The policy registry: each policy defined once, every other module asking it, the docs' table written from it.

The stray-literal rule: in ``src/remat``, a string constant whose whole value is a policy name
(``"keep"``, ``"full"``, ...) may appear only in ``remat/core/_policy_registry.py``. Constants are read
with ``ast``, so comments never count, and docstrings (the first statement of a module, class or
function) and the literal text of f-strings are prose, not names, and are left out. Text that merely
contains a name (``"use 'full' or ..."``) is a message, not a name, and is allowed.
"""

import ast
import pathlib

import pytest
import torch

import remat
from remat.core import _policy_registry as registry
from remat.errors import RematError

ROOT = pathlib.Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "remat"
REGISTRY_FILE = SRC / "core" / "_policy_registry.py"
PAGE = ROOT / "docs" / "policies.md"


def _prose(tree: ast.AST) -> set[int]:
    """ids of the constants that are docstrings or literal text of f-strings."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
        elif isinstance(node, ast.JoinedStr):
            out.update(id(v) for v in node.values if isinstance(v, ast.Constant))
    return out


def stray_policy_literals(path: pathlib.Path) -> list[str]:
    """``file:line: 'name'`` for every policy name written as a string literal in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    prose = _prose(tree)
    return [
        f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in registry.NAMES and id(node) not in prose
    ]


def test_no_policy_name_is_written_outside_the_registry():
    stray = [hit for path in sorted(SRC.rglob("*.py")) if path != REGISTRY_FILE for hit in stray_policy_literals(path)]
    assert not stray, "use the constants of remat.core._policy_registry (KEEP, FULL, ...):\n" + "\n".join(stray)


def test_the_stray_literal_rule_sees_names_and_leaves_prose(tmp_path):
    source = tmp_path / "module.py"
    source.write_text(
        '"""full"""\n'
        "def f(policy):\n"
        '    """keep"""\n'
        "    # selective\n"
        '    message = f"{policy}full"\n'
        "    text = \"use 'full' or 'keep'\"\n"
        '    return policy == "selective-ops" or {"a": "full-fine"}[f"{policy!r}"]\n'
    )
    hits = [h.split(": ", 1)[1] for h in stray_policy_literals(source)]
    assert hits == ["'selective-ops'", "'full-fine'"]


def test_the_registry_names_each_policy_once_with_its_constant():
    assert registry.NAMES == ("keep", "selective", "selective-ops", "full", "full-fine")
    assert len(set(registry.NAMES)) == len(registry.REGISTRY)
    constants = (registry.KEEP, registry.SELECTIVE, registry.SELECTIVE_OPS, registry.FULL, registry.FULL_FINE)
    assert constants == registry.NAMES
    assert all(p.meaning and p.eager and p.compiled and p.short for p in registry.REGISTRY)


def test_remat_policies_are_what_checkpoint_and_wrap_take():
    assert remat.POLICIES == ("keep", "selective", "selective-ops", "full")
    assert remat.POLICIES == tuple(p.name for p in registry.REGISTRY if p.on_function)
    x = torch.randn(2, 3, requires_grad=True)
    for name in remat.POLICIES:
        remat.wrap(torch.nn.Linear(3, 3), policy=name)
        remat.checkpoint(torch.nn.Linear(3, 3), x, policy=name).sum().backward()
    with pytest.raises(RematError, match="policy must be one of"):
        remat.wrap(torch.nn.Linear(3, 3), policy=registry.FULL_FINE)


def test_only_selective_runs_by_module():
    assert [p.name for p in registry.REGISTRY if p.by_module] == [registry.SELECTIVE]
    assert registry.SELECTIVES == (registry.SELECTIVE, registry.SELECTIVE_OPS)


def test_policy_looks_a_name_up_or_lists_the_valid_ones():
    assert registry.policy("full").name == "full"
    assert registry.policy("full-fine").on_function is False
    with pytest.raises(
        RematError, match="unknown policy 'half'.*'keep', 'selective', 'selective-ops', 'full', 'full-fine'"
    ):
        registry.policy("half")
    with pytest.raises(RematError, match="unknown policy"):
        registry.policy(None)  # type: ignore[arg-type]


def test_short_names_head_the_profile_columns():
    assert [p.short for p in registry.REGISTRY] == ["keep", "sel", "sel-ops", "full", "full-fine"]


def test_the_docs_table_is_the_one_the_registry_writes():
    page = PAGE.read_text()
    assert registry.with_table(page) == page, (
        "docs/policies.md is out of date: run PYTHONPATH=src python -c "
        "\"from remat.core._policy_registry import write_page; write_page('docs/policies.md')\""
    )
    assert all(f"| `{name}` |" in page for name in registry.NAMES)


def test_the_table_is_written_between_the_markers_only(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"before\n{registry.BEGIN}\nold table\n{registry.END}\nafter\n")
    registry.write_page(page)
    assert page.read_text() == f"before\n{registry.BEGIN}\n{registry.markdown_table()}{registry.END}\nafter\n"
    page.write_text("no markers\n")
    with pytest.raises(RematError, match="no markers"):
        registry.write_page(page)
    assert page.read_text() == "no markers\n"


def test_architecture_links_the_policy_page():
    assert "(policies.md)" in (ROOT / "docs" / "architecture.md").read_text()
