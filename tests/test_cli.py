"""The command line, run as users run it: a subprocess."""

import subprocess
import sys


def run_cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "remat.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_demo_runs_and_shows_the_seed_bug():
    proc = run_cli("demo", "--batch", "16", "--steps", "3")
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "loss sequence bit-equal to no checkpointing: yes" in out
    assert "8 parameters never trained" in out


def test_unknown_command_is_a_usage_error():
    proc = run_cli("frobnicate")
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr
