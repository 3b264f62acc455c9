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
