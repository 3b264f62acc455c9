"""The house stands: no import circle between remat's modules, and no wing imports from a wing above it.

Imports are read with ``ast`` from the source (every ``import``, also inside functions and
under ``TYPE_CHECKING``, and ``importlib.import_module("remat...")``), so an import that
only runs on one path counts as much as one at the top of a module.
"""

import ast
import pathlib
import textwrap

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "remat"

#: The wings from the ground up; a module may import from its own rank or below only.
#: ``remat`` is the package's public face (``remat/__init__.py``): bench and cli use it.
WINGS = [
    ("ground", ["remat.errors"]),
    ("core", ["remat.core"]),
    ("profiling", ["remat.profiling"]),
    ("planning", ["remat.planning", "remat.distributed"]),
    ("diagnosis", ["remat.diagnosis"]),
    ("public face", ["remat"]),
    ("integrations", ["remat.integrations"]),  # training-loop callbacks, each imported only when used
    ("bench", ["remat.bench", "remat.zoo"]),  # the zoo: models for bench and cli only
    ("cli", ["remat.cli"]),
]


def modules(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of the package under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, known: dict[str, pathlib.Path]) -> str | None:
    """The module ``name`` loads (itself, or the nearest package above it), if it is one of ``known``."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (wherever in the module the import is)."""
    known = modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:  # ``from pkg import module`` imports that module
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                targets.add(str(node.args[0].value))
        graph[name] = {t for t in map(lambda t: _resolve(t, known), targets) if t and t != name}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def rank(module: str) -> int | None:
    """The wing of ``module`` (its index in WINGS), by the longest prefix that names it."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(WINGS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} ({WINGS[rank(a)][0]}) imports {b} ({WINGS[rank(b)][0]})"
        for a, targets in graph.items()
        for b in targets
        if rank(b) > rank(a)
    )


@pytest.fixture(scope="module")
def graph():
    return import_graph(SRC, "remat")


def test_every_module_is_in_a_wing(graph):
    assert [m for m in graph if rank(m) is None] == []


def test_no_import_circle(graph):
    assert find_circle(graph) is None


def test_no_wing_imports_from_a_wing_above(graph):
    assert upward(graph) == []


def test_the_checks_see_circles_and_upward_imports_inside_functions(tmp_path):
    pkg = tmp_path / "remat"
    (pkg / "core").mkdir(parents=True)
    (pkg / "cli").mkdir()
    files = {
        "__init__.py": "",
        "errors.py": "",
        "core/__init__.py": "",
        "core/a.py": "from remat.core import b\n",
        "core/b.py": "def f():\n    from remat.core.a import x\n",
        "cli/__init__.py": "",
        "cli/c.py": "import importlib\nimportlib.import_module('remat.core.a')\n",
        "core/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from remat.cli.c import y\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(textwrap.dedent(text))
    g = import_graph(pkg, "remat")
    assert g["remat.cli.c"] == {"remat.core.a"}
    assert find_circle(g) == ["remat.core.a", "remat.core.b", "remat.core.a"]
    assert upward(g) == ["remat.core.d (core) imports remat.cli.c (cli)"]


def test_no_issue_numbers_in_the_code():
    """NOTE blocks state rules and reasons; an issue number goes stale (history lives in git)."""
    import re

    pattern = re.compile(r"\b[Ii]ssue ?#?\d+|(?<![\w&])#\d{2,}\b")
    src = pathlib.Path(__file__).resolve().parents[1] / "src" / "remat"
    found = [
        f"{path.relative_to(src)}:{n}"
        for path in sorted(src.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and "torch issue" not in line and "pytorch/issues" not in line
    ]
    assert not found, found


def note_blocks(text: str) -> list[tuple[int, str]]:
    """Each NOTE [Title] block of a module: (its first line, its text). A block in comments runs while the
    lines are comments; one in a docstring runs to the next blank line or the docstring's end."""
    lines, blocks = text.splitlines(), []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped.lstrip("# ").startswith("NOTE ["):
            continue
        comment, j = stripped.startswith("#"), i + 1
        while j < len(lines) and (
            lines[j].strip().startswith("#") if comment else lines[j].strip() and '"""' not in lines[j]
        ):
            j += 1
        blocks.append((i + 1, "\n".join(lines[i:j])))
    return blocks


#: What goes stale in a NOTE block: a date, a remark on the machine's load, a session's history.
STALE = r"\b20\d\d-\d\d(-\d\d)?\b|\b(quiet|loaded) (\d-core )?(machine|CPU)\b|\bsession\b|\bbefore this change\b"


def test_note_blocks_state_rules_not_dated_measurements():
    """A NOTE states a rule and its reason; dated figures and machine remarks go to BENCHMARKS.md with their
    command (history lives in git)."""
    import re

    found = [
        f"{path.relative_to(SRC)}:{n}: {match[0]!r}"
        for path in sorted(SRC.rglob("*.py"))
        for n, block in note_blocks(path.read_text())
        for match in re.finditer(STALE, block)
    ]
    assert not found, found


def test_the_note_check_sees_a_dated_figure():
    text = '"""Doc.\n\nNOTE [A rule]\nWhy.\nOn a quiet 2-core CPU (2026-11-23): 0.2 s.\n\nAfter."""\n# NOTE [B]\n# ok\n'
    blocks = note_blocks(text)
    assert [n for n, _ in blocks] == [3, 8]
    import re

    assert [m[0] for m in re.finditer(STALE, blocks[0][1])] == ["quiet 2-core CPU", "2026-11-23"]
    assert not re.search(STALE, blocks[1][1])
