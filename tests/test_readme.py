"""The README stays true: its example runs and its commands exist."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs():
    text = README.read_text()
    example = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["m"].grads_ok


def test_readme_first_commands_are_the_two_make_targets():
    first_block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
    assert [line.split()[:2] for line in first_block.strip().splitlines()] == [["make", "demo"], ["make", "test"]]
    makefile = (README.parent / "Makefile").read_text()
    assert "\ndemo:" in makefile and "\ntest:" in makefile
    assert "make test" in (README.parent / ".ci" / "run").read_text()


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    root = README.parent
    pages = [README, *sorted((root / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name}: link to {target} does not resolve"


def test_docs_pages_exist_and_architecture_points_to_them():
    docs = README.parent / "docs"
    architecture = (docs / "architecture.md").read_text()
    for page in ("checkpoint", "profiling", "planning", "compile", "integrations", "cli", "benchmarks"):
        assert (docs / f"{page}.md").exists()
        assert f"({page}.md)" in architecture, page
