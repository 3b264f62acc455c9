"""``remat.cli``, the command-line wing: the ``remat`` entry point (``remat.cli:main``).

``_main`` builds the parser and runs a command; ``_commands`` (profile, plan, and what
the commands share), ``_doctor`` (doctor) and ``_bench`` (bench, max-batch) are the
commands, ``_model`` loads MODEL, ``_ui`` writes to the terminal and ``_demo`` is
``remat demo``.
"""

from remat.cli._main import build_parser, main

__all__ = ["build_parser", "main"]
