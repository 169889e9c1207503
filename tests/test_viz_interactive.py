"""The interactive view: widgets drive the figures, clicks link heatmap, histogram and
training curve. Mouse clicks are fed to matplotlib as the ipympl frontend would."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from matplotlib.backend_bases import MouseEvent
from viz_logs import LAYERS, log_from_arrays, training_log

from tandv import viz
from tandv.schema import EXPONENT_COUNTS
from tandv.viz import interact as interactive_module


@pytest.fixture(scope="module")
def df() -> pd.DataFrame:
    return training_log(steps=6)


@pytest.fixture
def notebook(monkeypatch):
    """Pretend to run inside a Jupyter kernel."""
    monkeypatch.setattr(interactive_module, "_in_notebook", lambda: True)


def click(fig, ax, x: float, y: float) -> None:
    """A left click at data coordinates (x, y) of ``ax``, delivered to the figure's handlers."""
    fig.canvas.draw()
    px, py = ax.transData.transform((x, y))
    event = MouseEvent("button_press_event", fig.canvas, px, py, button=1)
    fig.canvas.callbacks.process("button_press_event", event)


def counts_at(df, name, tt, step) -> pd.Series:
    m = (
        (df[("metadata", "name")] == name)
        & (df[("metadata", "tensor_type")] == tt)
        & (df[("metadata", "step")] == step)
    )
    return df[m].iloc[0][EXPONENT_COUNTS]


def bar_heights(ax) -> dict[int, float]:
    (c,) = [c for c in ax.containers if c.get_label() == "exponent counts"]
    return {round(p.get_x() + p.get_width() / 2): p.get_height() for p in c.patches}


def test_outside_a_notebook_it_raises_a_clear_error(df):
    with pytest.raises(viz.NotInNotebookError, match="needs a Jupyter kernel.*VS Code"):
        viz.interactive(viz.exp_hist, df=df, layer="head", tt="Activation", step=0)


def test_bad_function_or_arguments_fail_before_any_widget(df, notebook):
    with pytest.raises(
        viz.VizArgumentError, match="expected one of.*'exp_hist'.*'percentile_bands'"
    ):
        viz.interactive(print, df=df)
    with pytest.raises(viz.VizArgumentError, match="layer='nope' matches no tensor"):
        viz.interactive(viz.exp_hist, df=df, layer="nope", tt="Activation", step=0)
    with pytest.raises(viz.VizArgumentError, match=r"'step' column.*\['epoch', 'loss'\]"):
        viz.interactive(
            viz.scalar_line,
            df=df,
            train_stats=pd.DataFrame({"epoch": [0], "loss": [1.0]}),
            layer="head",
            tt="Weight",
            scalar_metric="rm2",
        )


def test_view_displays_as_a_widget(df, notebook):
    view = viz.interactive(
        viz.scalar_line,
        df=df,
        layer="layers.0",
        tt="Weight",
        scalar_metric=["rm2", "std"],
        col_wrap=2,
    )
    bundle = view._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert set(view.controls) == {"tt", "layer", "step", "scalar_metric"}
    assert view.controls["layer"].value == ("layers.0.attn", "layers.0.mlp")
    assert view.controls["scalar_metric"].value == ("rm2", "std")


def test_exp_hist_controls_redraw_with_the_log_values(df, notebook):
    view = viz.interactive(viz.exp_hist, df=df, layer="head", tt="Activation", step=0)
    assert view.controls["step"].options == tuple(range(6))
    view.controls["step"].value = 4
    (ax,) = view.figure.axes
    assert view.figure.get_suptitle() == "Exponent histogram at step 4"
    expected = counts_at(df, "head", "Activation", 4)
    assert all(h == expected[e] for e, h in bar_heights(ax).items())
    view.controls["tt"].value = ("Gradient", "Weight")
    assert [a.get_title() for a in view.figure.axes] == ["head (Gradient)", "head (Weight)"]
    view.controls["layer"].value = ("embed",)
    assert [a.get_title() for a in view.figure.axes] == ["embed (Gradient)", "embed (Weight)"]
    view.controls["dtype_annotation"].value = "float8_e5m2"
    lines = {l.get_gid(): l.get_xdata()[0] for l in view.figure.axes[0].get_lines() if l.get_gid()}
    assert lines["marker:max"] == 15  # float8_e5m2 max 57344 = 1.75 * 2**15


def test_a_step_the_layer_lacks_shows_a_message_not_a_crash(notebook):
    x = np.ones(4, np.float32)
    log = log_from_arrays({("a", "Weight", 0): x, ("b", "Weight", 0): x, ("a", "Weight", 1): x})
    view = viz.interactive(viz.exp_hist, df=log, layer="b", tt="Weight", step=0)
    before = view.figure
    view.controls["step"].value = 1
    assert "step=1" in view.message.value and "logged steps: 0" in view.message.value
    assert view.figure is before


def test_clicking_a_heatmap_cell_opens_that_histogram(df, notebook):
    view = viz.interactive(
        viz.scalar_global_heatmap, df=df, tt=["Activation", "Gradient"], scalar_metric="rm2", inc=2
    )
    assert view.detail_figure is None
    panel = view.panels[1]
    assert panel.tt == "Gradient" and panel.steps == [0, 2, 4]
    click(view.figure, panel.ax, 1.5, 3.5)  # column 1 = step 2, row 3 = the fourth layer
    assert view.selected == ("Gradient", LAYERS[3], 2)
    (ax,) = view.detail_figure.axes
    assert ax.get_title() == f"{LAYERS[3]} (Gradient)"
    assert view.detail_figure.get_suptitle() == "Exponent histogram at step 2"
    expected = counts_at(df, LAYERS[3], "Gradient", 2)
    assert all(h == expected[e] for e, h in bar_heights(ax).items())
    (outline,) = [p for p in panel.ax.patches if p.get_gid() == "selected"]
    assert outline.get_xy() == (1, 3)
    click(view.figure, view.panels[0].ax, 0.5, 0.5)  # the Activation panel's first cell
    assert view.selected == ("Activation", LAYERS[0], 0)
    assert view.detail_figure.axes[0].get_title() == f"{LAYERS[0]} (Activation)"
    assert not [p for p in panel.ax.patches if p.get_gid() == "selected"]


def test_training_curve_click_sets_the_step(df, notebook):
    stats = pd.DataFrame({"step": range(6), "loss": np.linspace(3, 1, 6)})
    view = viz.interactive(
        viz.exp_hist, df=df, train_stats=stats, layer="embed", tt="Weight", step=0
    )
    (line,) = [l for l in view.stats_figure.axes[0].get_lines() if l.get_label() == "loss"]
    np.testing.assert_array_equal(line.get_ydata(), stats["loss"])
    click(view.stats_figure, view.stats_figure.axes[0], 3.8, 2.0)
    assert view.controls["step"].value == 4 and view.step == 4
    assert view.figure.get_suptitle() == "Exponent histogram at step 4"
    (cross,) = [l for l in view.stats_figure.axes[0].get_lines() if l.get_gid() == "crosshair"]
    assert cross.get_xdata()[0] == 4


def test_crosshair_spans_every_line_plot(df, notebook):
    stats = pd.DataFrame(
        {"loss": [2.0, 1.5, 1.0, 0.9, 0.8, 0.7]}, index=pd.Index(range(6), name="step")
    )
    view = viz.interactive(
        viz.scalar_line,
        df=df,
        train_stats=stats,
        layer="layers",
        tt="Gradient",
        scalar_metric="rm2",
        col_wrap=2,
    )
    click(view.stats_figure, view.stats_figure.axes[0], 2.2, 1.0)
    assert view.step == 2
    panels = view.figure.axes
    assert len(panels) == 4
    for ax in panels:
        (cross,) = [l for l in ax.get_lines() if l.get_gid() == "crosshair"]
        assert cross.get_xdata()[0] == 2
    # A redraw from a control keeps the crosshair.
    view.controls["scalar_metric"].value = ("std",)
    assert all(
        [l.get_xdata()[0] for l in ax.get_lines() if l.get_gid() == "crosshair"] == [2]
        for ax in view.figure.axes
    )


def test_percentile_bands_switch_between_whole_model_and_layers(df, notebook):
    view = viz.interactive(viz.percentile_bands, df=df, tt="Weight")
    assert view.controls["layer"].value == ()
    assert [a.get_title() for a in view.figure.axes] == ["whole model (Weight)"]
    view.controls["layer"].value = ("head", "embed")
    assert [a.get_title() for a in view.figure.axes] == ["embed (Weight)", "head (Weight)"]
    view.controls["layer"].value = ()
    assert [a.get_title() for a in view.figure.axes] == ["whole model (Weight)"]
    view.controls["inc"].value = 2
    (median,) = [l for l in view.figure.axes[0].get_lines() if l.get_gid() == "line:50"]
    assert list(median.get_xdata()) == [0, 2, 4]


def test_heatmap_step_control_moves_the_crosshair_and_the_open_histogram(df, notebook):
    view = viz.interactive(viz.scalar_global_heatmap, df=df, tt="Weight", scalar_metric="std")
    (panel,) = view.panels
    click(view.figure, panel.ax, 2.5, 1.5)
    assert view.selected == ("Weight", LAYERS[1], 2)
    view.controls["step"].value = 5
    (cross,) = [l for l in panel.ax.get_lines() if l.get_gid() == "crosshair"]
    assert cross.get_xdata()[0] == 5.5  # the middle of column 5 (step 5)
    assert view.selected == ("Weight", LAYERS[1], 5)
    assert view.detail_figure.get_suptitle() == "Exponent histogram at step 5"
    (outline,) = [p for p in panel.ax.patches if p.get_gid() == "selected"]
    assert outline.get_xy() == (5, 1)


def test_clicking_the_current_step_still_draws_the_crosshair(df, notebook):
    stats = pd.DataFrame({"step": range(6), "loss": np.linspace(3, 1, 6)})
    view = viz.interactive(viz.percentile_bands, df=df, train_stats=stats, tt="Gradient")
    assert view.controls["step"].value == 0 and view.step is None
    click(view.stats_figure, view.stats_figure.axes[0], 0.2, 2.0)
    for ax in (view.stats_figure.axes[0], view.figure.axes[0]):
        (cross,) = [l for l in ax.get_lines() if l.get_gid() == "crosshair"]
        assert cross.get_xdata()[0] == 0
