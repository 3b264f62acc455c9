"""The memory timeline picture draws the profile's own peak model: its highest point is predict_peak."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import remat  # noqa: E402
from remat.bench import plot_timeline  # noqa: E402
from remat.bench._timeline import timeline_of  # noqa: E402


@pytest.fixture(scope="module")
def chain_profile():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)])
    return remat.profile(model, (torch.randn(256, 32),), repeat=1)


def _line(fig, label):
    (ax,) = fig.axes
    return next(line for line in ax.get_lines() if line.get_gid() == f"live:{label}")


def test_timeline_walks_the_peak_model_and_names_the_block_that_sets_the_peak(chain_profile):
    p = chain_profile
    plan = remat.plan(p, 0.9)
    for assignment in ({}, plan.assignment, {b.name: "full" for b in p.blocks}):
        t = timeline_of(p, assignment)
        assert t.peak_bytes == max(t.live) == p.predict_peak(assignment)
        walk = p.timeline(assignment)
        at = walk[int(t.peak_x)]
        assert at[2] == t.peak_bytes
        assert (t.peak_block, t.peak_phase) == (at[0][1], "forward" if at[0][0] == "fwd" else "backward") or at[0][
            1
        ] is None
    bands = timeline_of(p, None).bands
    assert [(b, ph) for b, ph, _, _ in bands] == [(b.name, "forward") for b in p.blocks] + [
        (b.name, "backward") for b in reversed(p.blocks)
    ]


def test_plot_timeline_png_shows_none_and_the_plan_with_the_budget(chain_profile, tmp_path):
    p = chain_profile
    plan = remat.plan(p, 0.9)
    path = tmp_path / "timeline.png"
    fig = plot_timeline(p, plan, path=path)
    try:
        assert path.stat().st_size > 5000 and path.read_bytes()[:4] == b"\x89PNG"
        (ax,) = fig.axes
        unit = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "B": 1}[ax.get_ylabel().split("(")[1].rstrip(")")]
        none, ours = _line(fig, "none"), _line(fig, "optimal plan")
        assert max(none.get_ydata()) * unit == pytest.approx(p.baseline_peak_bytes, rel=1e-12)
        assert max(ours.get_ydata()) * unit == pytest.approx(plan.predicted_peak_bytes, rel=1e-12)
        assert len(none.get_xdata()) == 2 * len(p.timeline({}))
        (budget,) = [line for line in ax.get_lines() if line.get_gid() == "budget"]
        assert budget.get_ydata()[0] * unit == pytest.approx(plan.budget_bytes, rel=1e-12)
        notes = [t.get_text() for t in ax.texts]
        assert f"peak: {timeline_of(p, plan).peak_block}, {timeline_of(p, plan).peak_phase}" in notes
        assert [b.name for b in p.blocks][0] in notes  # block bands are labelled
    finally:
        plt.close(fig)


def test_plot_timeline_refuses_unknown_blocks_and_nested_plans(chain_profile):
    with pytest.raises(remat.RematError, match="not blocks of this profile"):
        plot_timeline(chain_profile, {"nope": "full"})
    nested = remat.plan(chain_profile, 0.9)
    nested = type(nested)(**{**nested.__dict__, "segments": (("0", "1"),)})
    with pytest.raises(remat.RematError, match="nested segment"):
        plot_timeline(chain_profile, nested)


def test_measured_peaks_are_drawn_beside_the_walks(chain_profile):
    # What remat doctor --plot adds: the peaks of real steps, next to the peak model's walks.
    p = chain_profile
    plan = remat.plan(p, 0.9)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)])
    measured = {"none": remat.measure(model, (torch.randn(256, 32),), repeat=1, warmup=0).peak_bytes}
    fig = plot_timeline(p, plan, measured=measured)
    try:
        (ax,) = fig.axes
        unit = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "B": 1}[ax.get_ylabel().split("(")[1].rstrip(")")]
        (line,) = [ln for ln in ax.get_lines() if ln.get_gid() == "measured:none"]
        assert line.get_ydata()[0] * unit == pytest.approx(measured["none"], rel=1e-12)
        assert measured["none"] == p.baseline_peak_bytes  # the walk and the real step agree on this chain
    finally:
        plt.close(fig)
