"""The seed systems (nnstat, the Chainer monitor, Taiyi) used as their users use them, round 2:
each check compares tandv with numpy computed from the seed system's own definition."""

from __future__ import annotations

import pandas as pd
import pytest

import tandv
from tandv.analysis import STEP_PHASES, computation_order, first_nonfinite

# -- 1. the first NaN, in the order of the step's computation --------------------------------


def _nan_run(tmp_path, track_updates: bool = True) -> pd.DataFrame:
    """A 3-step SGD run whose input holds a NaN at step 1 (``track_updates=True``)."""
    torch = pytest.importorskip("torch")
    from tandv.track.torch import track

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with track(
        model, opt, out=tmp_path / "log", track_updates=track_updates, verbose=False
    ) as tracker:
        for step in range(3):
            x = torch.randn(5, 4)
            if step == 1:
                x[0, 0] = float("nan")
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            tracker.step()
    return tandv.read_log(tmp_path / "log")


def test_first_nonfinite_names_the_activation_not_the_update_row(tmp_path):
    df = _nan_run(tmp_path)
    first = first_nonfinite(df)
    # the NaN came in with the input: fc1's (module "0") output is the first tensor holding it
    assert first.loc[0, ["name", "tensor_type", "step"]].tolist() == ["0", "Activation", 1]
    # every update row comes after its parameter's gradient and optimizer state
    pos = {(n, t): i for i, (n, t) in enumerate(zip(first["name"], first["tensor_type"]))}
    for p in ("0.weight", "0.bias", "2.weight", "2.bias"):
        upd = pos[(f"{p}.update", "Weight")]
        assert pos[(p, "Gradient")] < upd
        assert pos[(f"{p}.momentum_buffer", "Optimiser_State")] < upd
        assert pos[("0", "Activation")] < upd
    # the HTML report's banner says the same
    from tandv.viz.report import render_report

    html = render_report(df, "nan run")
    assert "First NaN/inf at step 1 in Activation 0 (6 NaN, 0 inf)" in html


def test_computation_order_against_a_hand_ordered_log():
    # rows of two steps written out of order; the expected order written by hand
    rows = [
        ("w.update", "Weight", 1),
        ("w.exp_avg", "Optimiser_State", 1),
        ("fc2", "Gradient", 1),
        ("fc1", "Gradient", 1),
        ("fc1", "Activation", 1),
        ("fc2", "Activation", 1),
        ("w", "Weight", 1),
        ("w", "Weight", 0),
    ]
    df = pd.concat(
        [
            pd.DataFrame(rows, columns=["name", "tensor_type", "step"]),
            pd.DataFrame({"nan_count": [1] * len(rows), "inf_count": [0] * len(rows)}),
        ],
        axis=1,
        keys=["metadata", "scalar_stats"],
    )
    order = computation_order(df)
    assert order.tolist() == [7, 6, 4, 5, 2, 3, 1, 0]
    assert STEP_PHASES[-1] == "update"
    first = first_nonfinite(df)
    assert list(zip(first["name"], first["tensor_type"])) == [
        ("w", "Weight"),
        ("fc1", "Activation"),
        ("fc2", "Activation"),
        ("fc2", "Gradient"),
        ("fc1", "Gradient"),
        ("w.exp_avg", "Optimiser_State"),
        ("w.update", "Weight"),
    ]
    assert first["step"].tolist() == [0, 1, 1, 1, 1, 1, 1]
    assert computation_order(df.iloc[:0]).tolist() == []
