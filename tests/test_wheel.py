"""The wheel users install: built from this tree, installed into a fresh venv beside the torch already there.

``pip wheel . --no-deps --no-build-isolation`` builds what ``python -m build`` builds (setuptools, the same
metadata) without fetching a build environment, so the check runs offline in seconds. The fresh venv sees
this interpreter's packages (torch, numpy, rich) through a ``.pth`` file placed after its own site-packages,
as a user's venv with ``--system-site-packages`` sees their CUDA torch: remat itself must come from the wheel.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wheel_installs_into_a_fresh_venv_and_the_cli_runs(tmp_path):
    # Built from a copy: setuptools leaves build/ and egg-info behind, and a stale build/ would go into the wheel.
    tree, out = tmp_path / "tree", tmp_path / "dist"
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = out.glob("remat-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "remat/integrations/lightning.py" in names and "remat/cli/_main.py" in names
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (pathlib.Path(site) / "zz_host_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
        env=env,
    )
    where = subprocess.run(
        [str(python), "-c", "import remat; print(remat.__file__)"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    ).stdout
    assert where.startswith(str(env_dir)), where
    cli = subprocess.run(
        [str(env_dir / "bin" / "remat"), "--help"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert cli.returncode == 0, cli.stderr
    assert "profile" in cli.stdout and "plan" in cli.stdout
