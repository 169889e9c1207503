"""Training scalars logged beside the log (``tracker.log_scalars``), read back with
``tandv.read_scalars``, drawn by the notebook view and the report; ``first_nonfinite``."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from viz_logs import log_from_arrays

import tandv
from tandv.schema.scalars import scalars_path
from tandv.track.common import StepRecorder
from tandv.track.common.scalars import ScalarRecorder

torch = pytest.importorskip("torch")


def _train(out, out_format="parquet", steps=5, every=2):
    from tandv.track.torch import track

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with track(model, opt, out=out, out_format=out_format, every=every, verbose=False) as tracker:
        for i in range(steps):
            loss = model(torch.randn(16, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            tracker.log_scalars(loss=loss, lr=np.float32(0.1 / (i + 1)))
            if i == 3:
                tracker.log_scalars(step=3, val=1.5)
            losses.append(loss.item())
            tracker.step()
    return losses, tracker


@pytest.mark.parametrize("out_format, out", [("parquet", "log"), ("pickle", "log.pkl")])
def test_torch_scalars_round_trip_every_step_whatever_the_schedule(tmp_path, out_format, out):
    losses, tracker = _train(tmp_path / out, out_format)
    expected = pd.DataFrame(
        {
            "step": np.arange(5),
            "loss": losses,
            "lr": [np.float32(0.1 / (i + 1)) for i in range(5)],
            "val": [np.nan, np.nan, np.nan, 1.5, np.nan],
        }
    )
    by_path = tandv.read_scalars(tmp_path / out)
    pd.testing.assert_frame_equal(by_path, expected, check_dtype=False, rtol=1e-7)
    assert by_path["step"].dtype == np.int64
    df = tandv.read_log(tmp_path / out, trust_pickle=True)
    assert sorted(df[("metadata", "step")].unique()) == [
        0,
        2,
        4,
    ]  # the schedule is for tensors only
    pd.testing.assert_frame_equal(tandv.read_scalars(df), by_path)
    # where they live: inside a parquet directory, beside a pickle; never read as log parts
    where = scalars_path(tmp_path / out)
    assert where == (
        tmp_path / "log" / "scalars" if out_format == "parquet" else tmp_path / "log.scalars"
    )
    assert any(where.glob("part-*.parquet"))


def test_a_log_without_scalars_and_a_frame_without_a_source(tmp_path):
    from tandv.track.torch import track

    model = torch.nn.Linear(2, 2)
    with track(model, out=tmp_path / "log", verbose=False) as tracker:
        model(torch.ones(1, 2)).sum().backward()
        tracker.step()
    ts = tandv.read_scalars(tmp_path / "log")
    assert list(ts.columns) == ["step"] and len(ts) == 0
    built = log_from_arrays({("a", "Weight", 0): np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="pass the log's path"):
        tandv.read_scalars(built)
    with pytest.raises(FileNotFoundError, match="no log"):
        tandv.read_scalars(tmp_path / "nothing")


def test_log_scalars_errors_name_the_argument(tmp_path):
    from tandv.track.torch import track

    model = torch.nn.Linear(2, 2)
    with track(model, out=tmp_path / "log", verbose=False) as tracker:
        with pytest.raises(
            ValueError,
            match=r"log_scalars\(loss=...\): expected one number; got a tensor of shape \(2,\)",
        ):
            tracker.log_scalars(loss=torch.ones(2))
        with pytest.raises(TypeError, match=r"log_scalars\(loss=...\): expected a number"):
            tracker.log_scalars(loss="low")
        with pytest.raises(ValueError, match=r"step=-1"):
            tracker.log_scalars(step=-1, loss=1.0)
        with pytest.raises(ValueError, match="at least one scalar"):
            tracker.log_scalars()
        tracker.log_scalars(loss=torch.tensor([2.0]), grad_norm=torch.tensor(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="outside the `with track"):
        tracker.log_scalars(loss=1.0)
    assert tandv.read_scalars(tmp_path / "log").to_dict("list") == {
        "step": [0],
        "loss": [2.0],
        "grad_norm": [3.0],
    }


# no forward or backward pass runs: the tracker warns that the steps recorded no activation
# and no gradient, which is not what this test looks at
@pytest.mark.filterwarnings("ignore:tandv. step 0 recorded no:RuntimeWarning")
def test_a_cpu_tensor_is_read_when_logged(tmp_path):
    """A running total changed in place after logging keeps the logged value."""
    from tandv.track.torch import track

    model = torch.nn.Linear(2, 2)
    total = torch.zeros(())
    with track(model, out=tmp_path / "log", verbose=False) as tracker:
        for step in range(3):
            total += step + 1
            tracker.log_scalars(total=total)
            tracker.step()
    assert tandv.read_scalars(tmp_path / "log")["total"].tolist() == [1.0, 3.0, 6.0]


class _Slow:
    """A pending value that arrives when told to."""

    def __init__(self, value):
        self.value, self.arrived, self.waited = value, False, False

    def ready(self):
        return self.arrived

    def get(self):
        self.waited = not self.arrived
        return self.value


def test_scalar_recorder_writes_arrived_steps_and_waits_only_at_close(tmp_path):
    rec = ScalarRecorder(tmp_path / "log")
    slow = _Slow(7.0)
    rec.add(0, {"loss": 1.0})
    rec.add(1, {"loss": slow})
    rec.add(2, {"loss": 3.0})
    rec.flush()
    assert rec.steps_written == 1 and rec.pending_steps == 2  # stops at the value in flight
    assert tandv.read_scalars(tmp_path / "log")["step"].tolist() == [0]
    slow.arrived = True
    rec.add(1, {"lr": 0.5})  # a later call for a waiting step adds to it
    rec.flush()
    assert not slow.waited and rec.pending_steps == 0
    late = _Slow(9.0)
    rec.add(3, {"loss": late})
    rec.close()
    assert late.waited  # closing waits for what is in flight
    got = tandv.read_scalars(tmp_path / "log")
    assert got["loss"].tolist() == [1.0, 7.0, 3.0, 9.0]
    assert np.isnan(got["lr"]).tolist() == [True, False, True, True]


def test_a_step_logged_again_after_a_flush_keeps_the_last_value(tmp_path):
    rec = StepRecorder(tmp_path / "log", verbose=False)
    rec.log_scalars(None, {"loss": 1.0, "acc": 0.5}, current=4)
    rec.flush()
    rec.log_scalars(4, {"loss": 2.0}, current=5)
    rec.close()
    assert tandv.read_scalars(tmp_path / "log").to_dict("list") == {
        "step": [4],
        "loss": [2.0],
        "acc": [0.5],
    }


def test_jax_scalars(tmp_path):
    jnp = pytest.importorskip("jax.numpy")
    from tandv.track.jax import track

    params = {"w": jnp.ones((3,))}
    with track(
        params, track_gradients=False, track_activations=False, out=tmp_path / "log", verbose=False
    ) as tracker:
        for step in range(3):
            loss = jnp.sum(params["w"]) * (step + 1)
            tracker.log_scalars(loss=loss, lr=0.01)
            tracker.step(params)
        with pytest.raises(ValueError, match="expected one number"):
            tracker.log_scalars(loss=params["w"])
    got = tandv.read_scalars(tmp_path / "log")
    assert got.to_dict("list") == {"step": [0, 1, 2], "loss": [3.0, 6.0, 9.0], "lr": [0.01] * 3}


def test_report_and_notebook_view_use_the_logged_scalars(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from tandv import viz
    from tandv.viz import interact
    from tandv.viz.report import render_report

    losses, _ = _train(tmp_path / "log", steps=4, every=1)
    df = tandv.read_log(tmp_path / "log")
    html = render_report(df, "t")
    assert '<section id="scalars">' in html and "last values: loss" in html
    assert "No NaN or inf in any logged tensor." in html
    monkeypatch.setattr(interact, "_in_notebook", lambda: True)
    view = viz.interactive(
        viz.scalar_line, df=df, tt="Gradient", layer="0.weight", scalar_metric="std"
    )
    assert view.train_stats["loss"].tolist() == pytest.approx(losses)
    line = [l for l in view.stats_figure.axes[0].get_lines() if l.get_label() == "loss"][0]
    assert line.get_ydata().tolist() == pytest.approx(losses)
    assert (
        viz.interactive(
            viz.scalar_line,
            df=df,
            tt="Gradient",
            layer="0.weight",
            scalar_metric="std",
            train_stats=False,
        ).train_stats
        is None
    )


def _nonfinite_log():
    """Step 1: the weight is fine, activation ``h`` (second in forward order) goes NaN, then
    ``out`` downstream of it, then gradients; step 0 is clean; ``z`` is NaN only at step 2."""
    ok = np.ones(8, np.float32)
    bad = ok.copy()
    bad[:2] = np.nan
    inf = ok.copy()
    inf[0] = np.inf
    arrays = {}
    for step in range(3):
        arrays[("w", "Weight", step)] = ok
        arrays[("emb", "Activation", step)] = ok
        arrays[("h", "Activation", step)] = bad if step >= 1 else ok
        arrays[("out", "Activation", step)] = inf if step >= 1 else ok
        arrays[("out", "Gradient", step)] = bad if step >= 1 else ok
        arrays[("z", "Optimiser_State", step)] = bad if step == 2 else ok
    return log_from_arrays(arrays)


def test_first_nonfinite_is_the_earliest_step_then_forward_order():
    df = _nonfinite_log()
    # shuffle the tensor types within each step (a JAX log adds activations before weights):
    # the computation's order decides, then the log's order within a tensor type
    shuffled = {"Gradient": 0, "Optimiser_State": 1, "Activation": 2, "Weight": 3}
    rank = df[("metadata", "tensor_type")].map(shuffled).to_numpy()
    df = df.iloc[np.lexsort((np.arange(len(df)), rank, df[("metadata", "step")].to_numpy()))]
    assert df[("metadata", "tensor_type")].iloc[0] == "Gradient"
    first = tandv.first_nonfinite(df)
    assert list(first.itertuples(index=False, name=None)) == [
        ("h", "Activation", 1, 2, 0),
        ("out", "Activation", 1, 0, 1),
        ("out", "Gradient", 1, 2, 0),
        ("z", "Optimiser_State", 2, 2, 0),
    ]
    clean = log_from_arrays({("w", "Weight", 0): np.ones(4, np.float32)})
    assert tandv.first_nonfinite(clean).empty


def test_report_leads_with_the_first_nonfinite():
    pytest.importorskip("matplotlib")
    from tandv.viz.report import render_report

    html = render_report(_nonfinite_log(), "t")
    banner = html.index('class="banner bad"')
    assert banner < html.index("<nav>")
    assert "First NaN/inf at step 1 in Activation h (2 NaN, 0 inf); 3 more tensors" in html
