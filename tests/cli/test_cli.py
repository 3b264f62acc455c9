"""The command line, run as users run it: a subprocess.

Memory figures are deterministic, so ``--json`` output is compared with the Python API
on the same small model; times differ from run to run and are only checked for shape.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import remat
from remat.zoo import build

GPT2 = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--vocab", "256"]
GPT2_KW = dict(layers=2, hidden=64, heads=4, seq=32, batch=2, vocab=256)
FAST = ["--repeat", "1"]  # one timed step per policy: memory does not depend on it


# The remat these tests imported, also when it comes from a relative PYTHONPATH and cwd changes.
_SRC = os.path.dirname(os.path.dirname(os.path.abspath(remat.__file__)))
_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_SRC, os.environ.get("PYTHONPATH")]))}


def run_cli(*args, timeout=600, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "remat.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=_ENV,
    )


def ok_json(proc):
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stdout)  # stdout holds the JSON document and nothing else


def one_error_line(proc, *needles):
    """Bad input: exit 2, one line on stderr, no traceback, nothing on stdout."""
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("remat: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def gpt2_profiles():
    """The API's own real and fake (h100) profiles of the small GPT-2 the CLI tests build."""
    zoo = build("gpt2", **GPT2_KW)
    real = remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, repeat=1)
    fake = remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, fake=True, target="h100")
    return real, fake


MODELS = '''
    import torch
    import torch.nn.functional as F
    import torch.utils.checkpoint
    from torch import nn

    import remat


    class CIFAR10Model(nn.Module):
        """Seed 000's CNN (narrower) as the forum user checkpointed it: use_reentrant left unset."""

        def __init__(self):
            super().__init__()
            self.cnn_block_1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
            self.dropout_1 = nn.Dropout(0.25)
            self.cnn_block_2 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
            self.out = nn.Linear(8 * 8 * 8, 10)

        def forward(self, X):
            X = torch.utils.checkpoint.checkpoint(self.cnn_block_1, X)
            X = self.dropout_1(X)
            X = torch.utils.checkpoint.checkpoint(self.cnn_block_2, X)
            return self.out(torch.flatten(X, 1))


    def seed000(batch=4):
        torch.manual_seed(0)
        images, labels = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
        return CIFAR10Model(), images, lambda logits: F.cross_entropy(logits, labels)


    def mlp(batch=8):
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)]), torch.randn(batch, 32)


    def wrapped(batch=8):
        model, x = mlp(batch)
        for block in model[:-1]:
            remat.wrap(block)
        return model, x


    class Reentrant(nn.Module):
        """Reentrant checkpoint on a block whose input requires grad: trains right, still risky."""

        def __init__(self):
            super().__init__()
            self.first, self.block = nn.Linear(32, 32), nn.Sequential(nn.Linear(32, 32), nn.Tanh())

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.block, self.first(x), use_reentrant=True)


    def reentrant():
        torch.manual_seed(0)
        return Reentrant(), torch.randn(8, 32)


    def not_a_model():
        return nn.Linear(2, 2)


    class Broken(nn.Module):
        """Its third block fails on every call, as a user's bug would."""

        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))

        def forward(self, x):
            for i, block in enumerate(self.blocks):
                x = block(x)
                if i == 2:
                    x = x.view(5, -1)  # 4 rows: cannot be viewed as 5
            return x


    def broken():
        torch.manual_seed(0)
        return Broken(), torch.randn(4, 8)


    class Host(nn.Module):
        """Reads a value back to the host in forward (.item()), which fake tensors cannot answer."""

        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x / (1.0 + x.detach().abs().max().item())


    def host():
        torch.manual_seed(0)
        return Host(), torch.randn(64, 32)
'''


@pytest.fixture
def models(tmp_path):
    (tmp_path / "models.py").write_text(textwrap.dedent(MODELS))
    return tmp_path


# --- profile ---------------------------------------------------------------------------------------


def test_profile_table_fake_for_h100_and_out_file(tmp_path):
    out = tmp_path / "profile.json"
    proc = run_cli("profile", "seed-cifar", "--batch", "4", "--fake", "--target", "h100", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for block in ("cnn_block_1", "cnn_block_2", "head"):
        assert block in text
    assert "times modelled for h100" in text and "Peak without checkpointing" in text and "MiB" in text
    prof = remat.Profile.from_json(out.read_text())
    assert prof.fake and prof.target == "h100"
    assert [b.name for b in prof.blocks] == ["cnn_block_1", "cnn_block_2", "head"]
    zoo = build("seed-cifar", batch=4)  # the CLI built it on the meta device: same bytes
    assert (
        prof.baseline_peak_bytes
        == remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, fake=True, target="h100").baseline_peak_bytes
    )


def test_profile_json_matches_the_api(gpt2_profiles):
    api = gpt2_profiles[0]
    data = ok_json(run_cli("profile", "gpt2", *GPT2, *FAST, "--json"))
    assert data["options"] == GPT2_KW and data["model"] == "GPT2LMHeadModel" and not data["fake"]
    for key in ("baseline_peak_bytes", "resting_bytes", "param_bytes", "grad_bytes"):
        assert data[key] == getattr(api, key), key
    assert data["min_peak_bytes"] == remat.plan(api, strategy="none").min_peak_bytes
    assert [b["name"] for b in data["blocks"]] == [b.name for b in api.blocks]
    for got, want in zip(data["blocks"], api.blocks):
        assert got["saved_bytes"] == want.saved_bytes and got["input_bytes"] == want.input_bytes
        assert got["peak_if_full_bytes"] == api.predict_peak({want.name: "full"})
        assert got["fwd_time_s"] > 0 and set(got["extra_time_s"]) == set(want.extra_time_s)


def test_profile_verbose_says_where_the_time_went():
    proc = run_cli("profile", "gpt2", *GPT2, "--repeat", "2", "-v")
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stderr.splitlines() if "remat.profile:" in ln)
    # One traced step per policy (also the warm-up), then the timed steps asked for: 2 per policy
    # (keep, selective, selective-ops, full).
    assert "4 traced steps" in line and "8 timed steps" in line and "warm-up" not in line
    assert "s in all" in line and "training steps without checkpointing" in line


# --- plan -------------------------------------------------------------------------------------------


def test_plan_json_matches_the_api_and_out_file_loads(tmp_path, gpt2_profiles):
    api = gpt2_profiles[0]
    out, png = tmp_path / "plan.json", tmp_path / "timeline.png"
    data = ok_json(
        run_cli("plan", "gpt2", *GPT2, *FAST, "--budget", "0.9", "--out", str(out), "--plot", str(png), "--json")
    )
    assert png.read_bytes()[:4] == b"\x89PNG"  # the timeline (its figures: tests/bench/test_timeline.py)
    plan = remat.Plan.from_json(out.read_text())
    assert data == json.loads(plan.to_json())  # --json prints exactly the plan file
    want = remat.plan(api, "0.9")
    assert (data["baseline_peak_bytes"], data["min_peak_bytes"], data["budget_bytes"]) == (
        want.baseline_peak_bytes,
        want.min_peak_bytes,
        want.budget_bytes,
    )
    # The solver's choice may follow timings; the peak of whatever it chose is the API's own figure.
    assert data["predicted_peak_bytes"] == api.predict_peak(plan.assignment) <= data["budget_bytes"]
    assert set(plan.assignment) == {b.name for b in api.blocks}


def test_plan_table_then_doctor_checks_the_plan_applied(tmp_path):
    plan = tmp_path / "plan.json"
    proc = run_cli("plan", "seed-cifar", "--batch", "4", *FAST, "--strategy", "all", "--out", str(plan))
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "cnn_block_1 full" in text and "head full" in text and "all plan" in text and "Predicted peak" in text
    data = ok_json(run_cli("doctor", "seed-cifar", "--batch", "4", "--plan", str(plan), "--no-measure", "--json"))
    assert data["ok"] and {c["target"] for c in data["checkpoints"]} == {"cnn_block_1", "cnn_block_2", "head"}


def test_doctor_plot_draws_the_timeline_with_the_measured_peaks(tmp_path):
    plan, png = tmp_path / "plan.json", tmp_path / "doctor.png"
    assert run_cli("plan", "seed-cifar", "--batch", "4", *FAST, "--strategy", "all", "--out", str(plan)).returncode == 0
    data = ok_json(
        run_cli(
            "doctor", "seed-cifar", "--batch", "4", "--plan", str(plan), "--repeat", "1", "--plot", str(png), "--json"
        )
    )
    # The whole-model plan on this tiny CNN pays nothing (warnings), but trains correctly (no errors).
    assert not [f for f in data["findings"] if f["severity"] == "error"]
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5000


def test_profile_plot_draws_the_timeline_and_budget_needs_plot(tmp_path):
    png = tmp_path / "timeline.png"
    data = ok_json(run_cli("profile", "gpt2", *GPT2, "--fake", "--plot", str(png), "--budget", "0.9", "--json"))
    assert png.stat().st_size > 5000 and data["baseline_peak_bytes"] > 0
    one_error_line(run_cli("profile", "gpt2", *GPT2, "--budget", "0.9"), "--budget only draws a plan on --plot")


def test_plan_fake_for_h100_matches_the_api(gpt2_profiles):
    api = gpt2_profiles[1]
    # A fixed budget fraction would mostly measure the h100 target's 66 MiB of library workspace
    # on this tiny model: ask for halfway between its lowest reachable peak and no checkpointing.
    budget = (remat.plan(api, strategy="all").min_peak_bytes + api.baseline_peak_bytes) // 2
    data = ok_json(run_cli("plan", "gpt2", *GPT2, "--budget", str(budget), "--fake", "--target", "h100", "--json"))
    assert data["baseline_peak_bytes"] == api.baseline_peak_bytes  # built on the meta device, same bytes
    assert data["predicted_peak_bytes"] == api.predict_peak(data["assignment"])


# --- doctor -----------------------------------------------------------------------------------------


def test_doctor_finds_seed_000s_frozen_blocks_and_exits_1(models):
    proc = run_cli("doctor", "models.py:seed000", "--no-measure", cwd=models)
    assert proc.returncode == 1, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "ERROR frozen-by-checkpoint (cnn_block_1, cnn_block_2)" in text
    assert "fix: Use remat.checkpoint" in text and "models.py:" in text
    assert "1 error(s)" in text


def test_doctor_json_on_correct_checkpointing_exits_0(models):
    data = ok_json(run_cli("doctor", "models.py:wrapped", "--batch", "16", "--no-measure", "--json", cwd=models))
    assert data["ok"] and data["findings"] == [] and len(data["checkpoints"]) == 3
    assert data["loss_checkpointed"] == data["loss_reference"]


def test_doctor_warnings_alone_exit_0(models):
    proc = run_cli("doctor", "models.py:reentrant", "--no-measure", cwd=models)
    assert proc.returncode == 0, proc.stderr
    assert "WARNING risky-call" in proc.stdout and "ERROR" not in proc.stdout


# --- demo -------------------------------------------------------------------------------------------


def test_demo_runs_and_shows_the_seed_bug():
    proc = run_cli("demo", "--batch", "16", "--steps", "3", "--rounds", "2")
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "step time: median of 2 interleaved rounds" in out
    assert "loss sequence bit-equal to no checkpointing: yes" in out
    assert "8 parameters never trained" in out


def test_demo_json_is_one_document_with_the_variants():
    data = ok_json(run_cli("demo", "--batch", "8", "--steps", "2", "--rounds", "1", "--no-plan", "--json"))
    names = [v["name"] for v in data["variants"]]
    assert len(names) == 3 and data["plan_demo"] is None
    assert data["variants"][1]["losses_equal_reference"] and not data["variants"][1]["frozen"]
    assert len(data["variants"][2]["frozen"]) == 8  # the reentrant checkpoint's frozen parameters
    assert all(v["measurement"]["peak_bytes"] > 0 for v in data["variants"])


# --- bench and max-batch (remat.bench; its own tests cover the numbers) -------------------------------


def test_max_batch_json():
    data = ok_json(
        run_cli("max-batch", "seed-cifar", "--budget", "1GiB", "--limit", "4", "--strategies", "none", "--json")
    )
    assert data["batches"] == {"none": 4} and data["budget_bytes"] == 2**30


class _Report:
    def to_dict(self):
        return {"rows": [{"model": "gpt2", "setup": "none", "peak_bytes": 1}]}

    def markdown(self):
        return "| model | setup |\n|---|---|\n| gpt2 | none |"


def test_bench_passes_options_per_model(tmp_path, monkeypatch, capsys):
    """The wiring only (in process, remat.bench.run_bench stubbed): running benchmarks is remat.bench's tests' job."""
    import remat.bench
    from remat.cli import main

    seen = {}

    def run_bench(models, **kwargs):
        kwargs.pop("progress")("profiling", 0, len(models))
        seen.update(models=models, **kwargs)
        return _Report()

    monkeypatch.setattr(remat.bench, "run_bench", run_bench)
    md = tmp_path / "bench.md"
    code = main(
        [
            "bench",
            "gpt2",
            "seed-cifar",
            "--quick",
            "--layers",
            "2",
            "--batch",
            "4",
            "--budgets",
            "0.5,6GiB,min",
            "--markdown",
            str(md),
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out) == _Report().to_dict() and "| gpt2 | none |" in md.read_text()
    assert seen["models"] == ["gpt2", "seed-cifar"] and seen["quick"] and seen["budgets"] == (0.5, "6GiB", "min")
    assert seen["options"] == {"gpt2": {"layers": 2, "batch": 4}, "seed-cifar": {"batch": 4}}
    assert seen["command"].startswith("remat bench gpt2 seed-cifar --quick")


# --- bad input: one line, exit 2 ------------------------------------------------------------------------


BAD = {
    "unknown-model": (["profile", "gpt3"], ["unknown model 'gpt3'", "known models: gpt2, llama"]),
    "missing-file": (["profile", "nope.py:make"], ["'nope.py' does not exist"]),
    "missing-factory": (["profile", "models.py:nope"], ["no function 'nope'", "seed000"]),
    "wrong-return": (["profile", "models.py:not_a_model"], ["returned a Linear", "(model, inputs)"]),
    "bad-budget": (["plan", "seed-cifar", "--budget", "5lbs"], ["budget='5lbs' cannot be read"]),
}

# The same checks, in process (no interpreter start-up): input the command line validates itself.
BAD_IN_PROCESS = {
    "no-factory-named": (["profile", "models.py"], ["names no factory"]),
    "factory-option": (["profile", "models.py:seed000", "--layers", "3"], ["does not take the options ['layers']"]),
    "zoo-option": (["profile", "seed-cifar", "--layers", "3"], ["bad options for 'seed-cifar': layers"]),
    "opt-syntax": (["profile", "seed-cifar", "--opt", "batch"], ["is not KEY=VALUE"]),
    "no-budget": (["plan", "seed-cifar"], ["give --budget"]),
    "target-without-fake": (["profile", "seed-cifar", "--target", "h100"], ["add --fake"]),
    "fake-with-device": (["plan", "seed-cifar", "--fake", "--device", "cpu", "--budget", "1"], ["drop --device"]),
    "bad-device": (["profile", "seed-cifar", "--device", "tpu"], ["is not a device"]),
    "fraction-for-max-batch": (["max-batch", "seed-cifar", "--budget", "0.5"], ["is a fraction"]),
    "factory-for-bench": (["bench", "models.py:seed000"], ["zoo models only"]),
    "bench-option-no-model-takes": (
        ["bench", "seed-cifar", "--layers", "2"],
        ["no model among seed-cifar takes layers"],
    ),
    "bench-compile-budget": (["bench", "seed-cifar", "--compile", "1,fast"], ["budgets between 0 and 1"]),
    "bench-compile-range": (["bench", "seed-cifar", "--compile", "2"], ["budgets between 0 and 1"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_exit_2(case, models):
    args, needles = BAD[case]
    one_error_line(run_cli(*args, cwd=models), *needles)


@pytest.mark.parametrize("case", list(BAD_IN_PROCESS))
def test_more_bad_input_in_process(case, models, monkeypatch, capsys):
    from remat.cli import main

    monkeypatch.chdir(models)
    monkeypatch.setattr(sys, "path", list(sys.path))  # loading models.py puts its folder first
    args, needles = BAD_IN_PROCESS[case]
    code = main(args)
    proc = subprocess.CompletedProcess(args, code, *capsys.readouterr())
    one_error_line(proc, *needles)


def test_infeasible_budget_names_the_minimum():
    line = one_error_line(run_cli("plan", "seed-cifar", "--batch", "4", *FAST, "--budget", "0.5"))
    assert "below the lowest peak any plan reaches" in line and "MiB" in line and "bytes" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    one_error_line(run_cli("profile", "seed-cifar", "--device", "cuda"), "CUDA is not available")


def test_unknown_command_is_a_usage_error(capsys):
    from remat.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["frobnicate"])
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_an_error_in_the_users_model_is_one_line_naming_it(models, monkeypatch, capsys):
    from remat.cli import main

    monkeypatch.chdir(models)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for command in (["profile", "models.py:broken"], ["plan", "models.py:broken", "--budget", "0.5"]):
        code = main([*command, *FAST])
        line = one_error_line(subprocess.CompletedProcess(command, code, *capsys.readouterr()))
        assert "remat.profile: the training step raised RuntimeError" in line and "during a profiled step" in line
        assert "view size is not compatible" in line or "shape '[5, -1]' is invalid" in line


def test_the_users_traceback_on_request(models):
    proc = run_cli("profile", "models.py:broken", *FAST, cwd=models)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    env = {**_ENV, "REMAT_TRACEBACK": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "remat.cli", "profile", "models.py:broken", *FAST],
        cwd=models,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 2
    assert "x = x.view(5, -1)" in proc.stderr and proc.stderr.strip().splitlines()[-1].startswith("remat: error:")


@pytest.mark.parametrize("out, needle", [("nowhere/plan.json", "does not exist"), (".", "is a folder")])
def test_unwritable_out_fails_before_profiling(models, monkeypatch, capsys, out, needle):
    from remat.cli import main

    monkeypatch.chdir(models)
    monkeypatch.setattr(sys, "path", list(sys.path))
    # the broken model would fail in profiling: the --out error comes first, so nothing ran
    for command in (["profile", "models.py:broken"], ["plan", "models.py:broken", "--budget", "0.5"]):
        code = main([*command, "--out", out])
        one_error_line(subprocess.CompletedProcess(command, code, *capsys.readouterr()), f"--out {out!r}", needle)


def test_hand_made_plan_over_the_budget_is_said(models, monkeypatch, capsys):
    from remat.cli import main

    monkeypatch.chdir(models)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code = main(["plan", "models.py:mlp", "--strategy", "all", "--budget", "0.01", *FAST, "--json"])
    out, err = capsys.readouterr()
    assert code == 0
    plan = remat.Plan.from_json(out)
    assert plan.predicted_peak_bytes > plan.budget_bytes
    warning = [line for line in err.splitlines() if line.startswith("remat: warning:")]
    assert len(warning) == 1 and "over the budget" in warning[0] and str(plan.predicted_peak_bytes) in warning[0]


def _plan_in_process(monkeypatch, capsys, models, *command):
    """``remat plan`` run by ``main`` here: (the plan it printed, stderr, whether each profile was fake)."""
    from remat.cli import main

    monkeypatch.chdir(models)
    monkeypatch.setattr(sys, "path", list(sys.path))
    kinds, profile = [], remat.profile
    monkeypatch.setattr(remat, "profile", lambda *a, **k: kinds.append(bool(k.get("fake"))) or profile(*a, **k))
    code = main(["plan", *command, *FAST, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return remat.Plan.from_json(out), err, kinds


def test_plan_budget_profiles_for_real_a_model_fake_tensors_cannot_run(models, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(models))
    from models import host

    model, x = host()
    with pytest.raises(remat.RematError, match=r"reads a tensor's value at models\.py:\d+ "):
        remat.profile(model, x, fake=True)
    api = remat.profile(model, x, repeat=1)
    budget = (remat.plan(api, strategy="none").min_peak_bytes + api.baseline_peak_bytes) // 2
    plan, _, kinds = _plan_in_process(monkeypatch, capsys, models, "models.py:host", "--budget", f"{budget}B")
    assert kinds == [True, False]  # the fake profile failed; the real one was made and planned on
    assert plan.budget_bytes == budget and plan.checkpointed
    assert plan.min_peak_bytes == remat.plan(api, strategy="none").min_peak_bytes
    assert plan.predicted_peak_bytes <= plan.budget_bytes


def test_plan_budget_stays_on_fake_tensors_when_the_real_profile_runs_out(models, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(models))
    from models import mlp

    profile = remat.profile

    def real_out_of_memory(*args, **kwargs):
        if not kwargs.get("fake"):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return profile(*args, **kwargs)

    monkeypatch.setattr(remat, "profile", real_out_of_memory)
    plan, err, kinds = _plan_in_process(monkeypatch, capsys, models, "models.py:mlp", "--budget", "1.0")
    model, x = mlp()
    fake = profile(model, x, fake=True)
    # a budget of the whole peak profiles for real first (it fits); out of memory, it plans on fake tensors
    assert kinds == [False, True] and not plan.checkpointed
    assert plan.budget_bytes == fake.baseline_peak_bytes
    assert plan.min_peak_bytes == remat.plan(fake, strategy="none").min_peak_bytes
    said = " ".join(err.split())
    assert "The real profile ran out of device memory (budget" in said and "profiled on fake tensors" in said


def test_policies_option_profiles_the_policies_asked_for():
    data = ok_json(
        run_cli("profile", "gpt2", *GPT2, "--fake", "--policies", "keep,selective-ops,full,full-fine", "--json")
    )
    assert data["policies"] == ["keep", "selective-ops", "full", "full-fine"]
    assert all(set(b["extra_time_s"]) == {"keep", "selective-ops", "full", "full-fine"} for b in data["blocks"])
    proc = run_cli("profile", "gpt2", *GPT2, "--fake", "--policies", "keep,half")
    assert proc.returncode == 2 and "unknown policies ['half']" in proc.stderr, proc.stderr


def test_optimizer_and_accumulation_options_plan_the_loops_step():
    data = ok_json(
        run_cli(
            "plan",
            "gpt2",
            *GPT2,
            "--fake",
            "--budget",
            "0.9",
            "--optimizer",
            "adamw",
            "--accumulation-steps",
            "2",
            "--json",
        )
    )
    assert data["loop"] == "AdamW's state and step and gradients accumulated over 2 backward passes"
    zoo = build("gpt2", **GPT2_KW)
    api = remat.profile(
        zoo.model,
        zoo.inputs,
        zoo.loss_fn,
        fake=True,
        accumulation_steps=2,
        optimizer=torch.optim.AdamW(zoo.model.parameters()),
    )
    assert data["baseline_peak_bytes"] == api.baseline_peak_bytes
    proc = run_cli("plan", "gpt2", *GPT2, "--fake", "--budget", "0.9", "--accumulation-steps", "0")
    assert proc.returncode == 2 and "accumulation_steps must be an integer >= 1" in proc.stderr, proc.stderr
