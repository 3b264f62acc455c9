"""BENCHMARKS.md is generated: every figure in it sits in a section one of benchmarks/*.py writes."""

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import _sections  # noqa: E402

#: Lines above the first section: a title and a paragraph on how the file is made, no figures.
HEADER_LINES = 12


def sections(text: str) -> tuple[list[str], list[tuple[str, str | None, list[str]]]]:
    """(the lines before the first section, each section as (script, part, its lines)); fails on anything
    outside a section below the header, on a section left open or closed by another script's marker."""
    lines = text.splitlines()
    header, found, current = [], [], None
    for number, line in enumerate(lines, start=1):
        begin, end = _sections.BEGIN.match(line), _sections.END.match(line)
        if current is None:
            assert end is None, f"line {number}: {line!r} closes no section"
            if begin:
                current = (begin[1], begin[2], [])
            elif found:
                assert not line.strip(), f"line {number} is outside every script's section: {line!r}"
            else:
                header.append(line)
        else:
            assert begin is None, f"line {number}: a section opens inside {current[0]}'s"
            if end:
                assert (end[1], end[2]) == current[:2], f"line {number}: {line!r} closes {current[:2]}'s section"
                found.append(current)
                current = None
            else:
                current[2].append(line)
    assert current is None, f"{current[0]}'s section is never closed"
    return header, found


def _calls(script: pathlib.Path) -> list[ast.Call]:
    """The calls of ``_sections``' writers in ``script``."""
    tree = ast.parse(script.read_text())
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "_sections"
        and node.func.attr in ("write", "recorded")
    ]


def test_every_figure_is_in_a_section_its_script_writes():
    header, found = sections((ROOT / "BENCHMARKS.md").read_text())
    assert found, "BENCHMARKS.md has no generated section"
    assert len(header) <= HEADER_LINES, f"the header is {len(header)} lines; figures belong in sections"
    assert not any(line.lstrip().startswith("|") for line in header), "a table in the header"
    for script, part, lines in found:
        path = ROOT / script
        assert path.is_file(), f"BENCHMARKS.md has a section of {script}, which does not exist"
        calls = _calls(path)
        assert calls, f"{script} does not write its section through benchmarks/_sections.py"
        if part is not None:
            assert any(k.arg == "part" for c in calls for k in c.keywords), f"{script} writes no part ({part})"
        text = "\n".join(lines)
        assert "Command: `" in text and "torch " in text and " on " in text, f"{script} ({part}): no command line"


def test_a_section_is_replaced_in_place_and_others_are_kept():
    first = _sections.replace("# Title\n", "## A\n1", "benchmarks/a.py")
    both = _sections.replace(first, "## B\n2", "benchmarks/b.py", "x")
    again = _sections.replace(both, "## A\n3", "benchmarks/a.py")
    header, found = sections(again)
    assert header == ["# Title", ""]
    assert [(s, p, lines) for s, p, lines in found] == [
        ("benchmarks/a.py", None, ["## A", "3"]),
        ("benchmarks/b.py", "x", ["## B", "2"]),
    ]


def test_text_outside_the_sections_is_refused():
    text = _sections.replace("# Title\n", "## A\n1", "benchmarks/a.py") + "\nhand-written figures: 1.2x\n"
    with pytest.raises(AssertionError, match="outside every script's section"):
        sections(text)


def test_a_script_writes_its_section_through_the_writer(tmp_path, monkeypatch, capsys):
    out = tmp_path / "B.md"
    out.write_text("# Title\n")
    monkeypatch.setattr(sys, "argv", ["benchmarks/x.py", "--rounds", "3"])
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with _sections.recorded("benchmarks/x.py", "X", write_to=out, part="p"):
        print("| a | b |")
    header, [(script, part, lines)] = sections(out.read_text())
    assert (script, part, lines[0]) == ("benchmarks/x.py", "p", "## X")
    assert lines[2].startswith("Command: `PYTHONPATH=src python benchmarks/x.py --rounds 3`. Run ")
    assert lines[-1] == "| a | b |" and "| a | b |" in capsys.readouterr().out
