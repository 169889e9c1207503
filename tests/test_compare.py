"""Two runs side by side: ``tandv.compare``, ``tandv.first_divergence``, ``tandv diff`` and the
HTML report's two-run view, on real PyTorch runs with a known perturbation."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import tandv
from tandv.cli import main
from tandv.compare import most_different, relative_difference
from tandv.schema import read_log

PERTURBED = 5  # the step at which one layer's activation is perturbed
STEPS = 8


def torch_run(out, perturb_step=None, layer=2, eps=1e-2):
    """Train a seeded MLP for STEPS steps, tracked; with ``perturb_step``, ``model[layer]``'s
    output gets ``+eps`` at that step (a user hook, registered before tandv's)."""
    import torch
    from torch import nn

    from tandv.track.torch import track

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    state = {"step": 0}

    def perturb(module, inputs, output):
        return output + eps if state["step"] == perturb_step else None

    model[layer].register_forward_hook(perturb)
    with track(model, opt, out=out, verbose=False) as tracker:
        for step in range(STEPS):
            state["step"] = step
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            tracker.step()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    return {
        "a": torch_run(tmp / "a"),
        "same": torch_run(tmp / "same"),
        "perturbed": torch_run(tmp / "perturbed", perturb_step=PERTURBED),
    }


def test_identical_seeded_runs_compare_as_equal(runs):
    assert tandv.first_divergence(runs["a"], runs["same"]) is None
    table = tandv.compare(runs["a"], runs["same"])
    assert (table["present"] == "both").all()
    assert len(table) == len(read_log(runs["a"]))
    assert (table[["rm2_rel", "max_abs_rel"]].to_numpy() == 0).all()
    assert (table["rm2_a"] == table["rm2_b"]).all()


def test_perturbed_activation_is_the_first_divergence(runs):
    first = tandv.first_divergence(runs["a"], runs["perturbed"])
    assert first is not None
    assert (int(first["step"]), first["tensor_type"], first["name"]) == (
        PERTURBED,
        "Activation",
        "2",
    )
    # later layers (3, 4) and the gradients also differ at step 5; the order puts "2" first
    table = tandv.compare(runs["a"], runs["perturbed"])
    at5 = table[(table["step"] == PERTURBED) & (table["rm2_rel"] > 1e-3)]
    assert {"3", "4"} <= set(at5.loc[at5["tensor_type"] == "Activation", "name"])
    assert (at5["tensor_type"] == "Gradient").any()
    # nothing before step 5 differs at all
    assert (table.loc[table["step"] < PERTURBED, ["rm2_rel", "max_abs_rel"]].to_numpy() == 0).all()
    # both values are the logs' own, and rel is their relative difference
    a, b = read_log(runs["a"]), read_log(runs["perturbed"])

    def value(df, stat):
        m = df["metadata"]
        sel = (m["name"] == "2") & (m["tensor_type"] == "Activation") & (m["step"] == PERTURBED)
        return float(df.loc[sel, ("scalar_stats", stat)].iloc[0])

    for stat in ("rm2", "max_abs"):
        va, vb = value(a, stat), value(b, stat)
        assert first[f"{stat}_a"] == va and first[f"{stat}_b"] == vb
        assert first[f"{stat}_rel"] == pytest.approx(abs(va - vb) / max(abs(va), abs(vb)))
    # a tolerance above every difference finds none
    assert tandv.first_divergence(runs["a"], runs["perturbed"], rtol=10.0) is None


def test_rows_of_one_run_only_are_listed(runs):
    a = read_log(runs["a"])
    m = a["metadata"]
    b = a[~((m["step"] == 7) | ((m["name"] == "4") & (m["tensor_type"] == "Activation")))]
    table = tandv.compare(a, b.reset_index(drop=True), stats="rm2")
    only = table[table["present"] == "a only"]
    expected = a[(m["step"] == 7) | ((m["name"] == "4") & (m["tensor_type"] == "Activation"))]
    assert len(only) == len(expected)
    assert only["rm2_b"].isna().all() and only["rm2_rel"].isna().all()
    assert only["rm2_a"].notna().all()
    assert (table["present"] == "b only").sum() == 0
    back = tandv.compare(b.reset_index(drop=True), a, stats="rm2")
    assert (back["present"] == "b only").sum() == len(expected)
    assert len(back) == len(a)
    assert tandv.first_divergence(a, b.reset_index(drop=True)) is None


def test_relative_difference_by_hand():
    a = np.array([1.0, 0.0, np.nan, np.nan, np.inf, np.inf, 2.0, -1.0])
    b = np.array([1.5, 0.0, np.nan, 1.0, np.inf, -np.inf, 2.0, 1.0])
    np.testing.assert_array_equal(
        relative_difference(a, b), [0.5 / 1.5, 0.0, 0.0, np.inf, 0.0, np.inf, 0.0, 2.0]
    )


def test_compare_errors_name_the_problem(runs):
    with pytest.raises(ValueError, match="no statistic \\['nope'\\]"):
        tandv.compare(runs["a"], runs["same"], stats=("rm2", "nope"))
    with pytest.raises(TypeError, match="must be a log"):
        tandv.compare(3, runs["same"])
    with pytest.raises(ValueError, match="rtol"):
        tandv.first_divergence(runs["a"], runs["same"], rtol=-1)


def test_most_different_names_each_tensor_once():
    table = pd.DataFrame(
        {
            "tensor_type": ["Weight", "Weight", "Activation", "Activation"],
            "name": ["w", "w", "x", "y"],
            "step": [0, 1, 0, 0],
            "present": ["both"] * 4,
            "rm2_a": [1.0, 1.0, 1.0, 1.0],
            "rm2_b": [1.1, 2.0, 1.0, 1.5],
            "rm2_rel": relative_difference([1.0] * 4, [1.1, 2.0, 1.0, 1.5]),
        }
    )
    top = most_different(table)
    assert list(zip(top["name"], top["step"])) == [("w", 1), ("y", 0)]  # x never differs
    assert top["rel"].tolist() == [0.5, pytest.approx(0.5 / 1.5)]


def test_cli_diff(runs, capsys):
    assert main(["diff", str(runs["a"]), str(runs["perturbed"])]) == 0
    out = capsys.readouterr().out
    first = tandv.first_divergence(runs["a"], runs["perturbed"])
    assert f"first divergence: step {PERTURBED}, Activation '2': rm2 {first['rm2_a']:.6g}" in out
    assert "most different tensors" in out
    assert main(["diff", str(runs["a"]), str(runs["same"])]) == 0
    assert "no divergence" in capsys.readouterr().out
    assert main(["diff", str(runs["a"]), str(runs["same"]), "--stats", "bogus"]) == 1
    assert "no statistic ['bogus']" in capsys.readouterr().err
    assert main(["diff", str(runs["a"]), "missing"]) == 1


# ----------------------------------------------------------------------------- report


def _section(text: str, sid: str) -> str:
    start = text.index(f'<section id="{sid}">')
    return text[start : text.index("</section>", start)]


def _rm2_over_steps(path, name, tensor_type):
    df = read_log(path)
    m = df["metadata"]
    sel = df[(m["name"] == name) & (m["tensor_type"] == tensor_type)]
    order = np.argsort(sel[("metadata", "step")].to_numpy(), kind="stable")
    return (
        sel[("metadata", "step")].to_numpy()[order],
        sel[("scalar_stats", "rm2")].to_numpy()[order],
    )


def test_report_against_overlays_both_runs(runs):
    """The two-run section (the whole report is written once, by the CLI test below)."""
    from tandv.viz.report import _against, overlay_figure

    a, b = read_log(runs["a"]), read_log(runs["perturbed"])
    view = _against(a, b, "the perturbed run")
    assert "run B is the perturbed run" in view
    assert f"First divergence at step {PERTURBED} in Activation 2 " in view
    # one overlay figure, and the table of the tensors that differ most
    assert view.count("<img") == 1
    assert "Tensors that differ most" in view
    # the overlay draws each run's own values per layer: A solid, B dashed, same color
    layers = {"Weight": ["0.weight"], "Activation": ["2", "0"]}
    fig = overlay_figure(tandv.compare(a, b), "rm2", layers)
    weights, acts = fig.axes[:2]
    assert acts.get_title() == "Activation: rm2"
    for i, name in enumerate(["2", "0"]):
        pair = acts.lines[2 * i : 2 * i + 2]
        for line, run in zip(pair, ("a", "perturbed")):
            steps, rm2 = _rm2_over_steps(runs[run], name, "Activation")
            np.testing.assert_array_equal(line.get_xdata(), steps)
            np.testing.assert_array_equal(line.get_ydata(), rm2)
        assert [line.get_linestyle() for line in pair] == ["-", "--"]
        assert pair[0].get_color() == pair[1].get_color()
    assert list(acts.lines[4].get_xdata()) == [PERTURBED, PERTURBED]  # where "2" departs
    # the weights move apart by less than AGAINST_RTOL (1e-3 of rm2) in this run: no marker
    assert len(weights.lines) == 2


def test_report_against_identical_run_says_they_agree(runs):
    from tandv.viz.report import _against

    view = _against(read_log(runs["a"]), read_log(runs["same"]), "B")
    assert "The runs agree" in view and "Tensors that differ most" not in view


def test_nothing_shared_is_not_agreement(runs, tmp_path, capsys):
    from tandv.track.common import StepRecorder
    from tandv.viz.report import _against

    StepRecorder(tmp_path / "empty", verbose=False).close()  # a run with no step
    empty = read_log(tmp_path / "empty")
    a = read_log(runs["a"])
    table = tandv.compare(a, empty)
    assert (table["present"] == "a only").all() and len(table) == len(a)
    assert tandv.first_divergence(a, empty) is None
    view = _against(a, empty, "B")
    assert "share no (tensor, step)" in view and "agree" not in view
    assert f"Not compared: {len(a)} rows only in run A" in view
    assert main(["diff", str(runs["a"]), str(tmp_path / "empty")]) == 0
    out = capsys.readouterr().out
    assert "nothing to compare" in out and "no divergence" not in out


def test_cli_report_against(runs, tmp_path, capsys):
    out = tmp_path / "two.html"
    argv = ["report", str(runs["a"]), "--against", str(runs["perturbed"]), "-o", str(out)]
    assert main(argv) == 0
    text = out.read_text()
    nav = text[text.index("<nav>") : text.index("</nav>")]
    assert 'href="#against"' in nav
    assert f"First divergence at step {PERTURBED} in Activation 2 " in _section(text, "against")
    assert "a against perturbed" in text  # the default title names both runs
    assert main(["report", str(runs["a"]), "--against", str(tmp_path / "nope")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_pickle_logs_are_compared_only_with_trust(runs, tmp_path):
    """A pickle path runs code when read: compare refuses it as read_log does, and reads it
    with trust_pickle=True, giving what the parquet log of the same run gives."""
    pkl = tmp_path / "a.pkl"
    read_log(runs["a"]).to_pickle(pkl)
    with pytest.raises(ValueError, match="trust_pickle=True"):
        tandv.compare(pkl, runs["same"])
    table = tandv.compare(pkl, runs["perturbed"], trust_pickle=True)
    pd.testing.assert_frame_equal(table, tandv.compare(runs["a"], runs["perturbed"]))
    row = tandv.first_divergence(pkl, runs["perturbed"], trust_pickle=True)
    assert row is not None and row["step"] == PERTURBED
