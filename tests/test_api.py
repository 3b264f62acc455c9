"""The public face of remat: ``remat.__all__`` exactly, the public modules, the entry point."""

import inspect
import subprocess
import sys
import tomllib
import types
from importlib.metadata import entry_points
from pathlib import Path

import remat

PUBLIC = [
    "POLICIES",
    "SAVE_OPS",
    "DoctorReport",
    "Finding",
    "BlockProfile",
    "Measurement",
    "Plan",
    "Profile",
    "RecomputeError",
    "RematError",
    "apply",
    "auto",
    "checkpoint",
    "distributed",
    "doctor",
    "is_recomputing",
    "is_wrapped",
    "measure",
    "parse_budget",
    "plan",
    "profile",
    "remove",
    "unwrap",
    "wrap",
]


def test_all_is_pinned():
    assert remat.__all__ == PUBLIC


def test_every_public_name_is_what_it_was():
    for name in PUBLIC:
        assert hasattr(remat, name), name
    # The wings do not shadow the functions of the same name.
    for name in (
        "apply",
        "auto",
        "checkpoint",
        "doctor",
        "is_recomputing",
        "is_wrapped",
        "measure",
        "parse_budget",
        "plan",
        "profile",
        "remove",
        "unwrap",
        "wrap",
    ):
        assert inspect.isfunction(getattr(remat, name)), name
    for name in ("DoctorReport", "Finding", "BlockProfile", "Measurement", "Plan", "Profile", "RematError"):
        assert inspect.isclass(getattr(remat, name)), name
    assert isinstance(remat.distributed, types.ModuleType) and callable(remat.distributed.auto)
    assert remat.__version__ == "0.1.0"


def test_public_modules_import_by_their_names():
    import remat.bench
    import remat.cli
    import remat.distributed
    import remat.zoo
    from remat.zoo import SeedCifarCNN, ZooModel, build, names, options

    assert callable(build) and callable(names) and callable(options) and inspect.isclass(ZooModel)
    assert inspect.isclass(SeedCifarCNN)
    assert callable(remat.cli.main)
    assert set(remat.bench.__all__) == {
        "BenchReport",
        "BenchRow",
        "MaxBatchResult",
        "bench_model",
        "max_batch",
        "plot_timeline",
        "run_bench",
        "search_max",
        "QUICK",
    }
    assert all(hasattr(remat.bench, n) for n in remat.bench.__all__)
    import remat.integrations

    assert remat.integrations.__all__ == []  # one module per framework, imported by its own name


def test_entry_point_is_remat_cli_main():
    import remat.cli

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == {"remat": "remat.cli:main"}
    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "remat"]
    assert ep.load() is remat.cli.main


def test_import_remat_stays_light():
    code = (
        "import sys, remat; heavy = [m for m in sys.modules if m.split('.')[0] in ('transformers', 'rich', "
        "'matplotlib', 'lightning', 'pytorch_lightning', 'accelerate') "
        "or m.startswith(('remat.cli', 'remat.bench', 'remat.zoo', 'remat.integrations'))]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
