"""Static figures, checked by content: plotted values against the log's own values,
format markers against ml_dtypes, facet counts and axes."""

from __future__ import annotations

import io
import re

import matplotlib
import ml_dtypes
import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from viz_logs import LAYERS, log_from_arrays, training_log

from tandv import SchemaError, viz
from tandv.schema import EXPONENT_COUNTS, OVERFLOW, UNDERFLOW

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def df() -> pd.DataFrame:
    return training_log(steps=6)


def row(df: pd.DataFrame, name: str, tt: str, step: int) -> pd.Series:
    m = (
        (df[("metadata", "name")] == name)
        & (df[("metadata", "tensor_type")] == tt)
        & (df[("metadata", "step")] == step)
    )
    assert m.sum() == 1
    return df[m].iloc[0]


def bars(ax, label: str) -> dict[float, float]:
    """x centre -> height of the bars of the container labelled ``label``."""
    (c,) = [c for c in ax.containers if c.get_label() == label]
    return {round(p.get_x() + p.get_width() / 2, 6): p.get_height() for p in c.patches}


def exponent_of(value: float) -> int:
    """floor(log2(value)), computed independently of tandv."""
    return int(np.frexp(np.float64(value))[1]) - 1


# ------------------------------------------------------------------ exp_hist


def test_exp_hist_bars_are_the_logged_counts_with_empty_ends_trimmed(df):
    fig = viz.exp_hist(df, "layers.0.attn", "Gradient", 3, dtype_annotation=False)
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    ax = fig.axes[0]
    r = row(df, "layers.0.attn", "Gradient", 3)[EXPONENT_COUNTS]
    nonzero = [int(e) for e, c in r.items() if e not in (UNDERFLOW, OVERFLOW) and c > 0]
    heights = bars(ax, "exponent counts")
    # Exactly the exponents from the lowest to the highest non-zero one, with their counts.
    assert sorted(heights) == list(range(min(nonzero), max(nonzero) + 1))
    for e, h in heights.items():
        assert h == r[int(e)]
    assert sum(heights.values()) == r.drop([UNDERFLOW, OVERFLOW]).sum()
    # Underflow and overflow columns are drawn beyond either end.
    assert bars(ax, "underflow") == {min(nonzero) - 2: r[UNDERFLOW]}
    assert bars(ax, "overflow") == {max(nonzero) + 2: r[OVERFLOW]}
    # The x axis is labelled with powers of two.
    labels = {round(t, 6): lab.get_text() for t, lab in zip(ax.get_xticks(), ax.get_xticklabels())}
    assert labels.pop(min(nonzero) - 2) == "under" and labels.pop(max(nonzero) + 2) == "over"
    assert len(labels) >= 3
    for x, text in labels.items():
        assert x == int(x) and min(nonzero) <= x <= max(nonzero) and text == f"$2^{{{int(x)}}}$"


def test_exp_hist_underflow_and_overflow_counts_are_visible():
    fmt = "float8_e4m3fn"
    x = np.array(
        [2.0**-12, 2.0**-11, 0.5, 1.0, 1.5, 3.0, 500.0, 1000.0, np.inf, 0.0, np.nan], np.float32
    )
    log = log_from_arrays({("w", "Weight", 0): x}, fmt=fmt)
    ax = viz.exp_hist(log, "w", "Weight", 0, dtype_annotation=False).axes[0]
    # 2**-12 and 2**-11 lie below float8_e4m3fn's smallest subnormal 2**-9; 500, 1000 and
    # inf above its max 448. Zero and NaN are not counted.
    assert list(bars(ax, "underflow").values()) == [2]
    assert list(bars(ax, "overflow").values()) == [3]
    assert bars(ax, "exponent counts") == {-1.0: 1, 0.0: 2, 1.0: 1}


def test_exp_hist_markers_sit_at_the_format_exponents():
    x = np.float32(2.0) ** np.arange(-10, 9, dtype=np.float32)
    log = log_from_arrays({("a", "Activation", 0): x})
    for fmt in ("float8_e4m3fn", "float8_e5m2", "float16"):
        ax = viz.exp_hist(log, "a", "Activation", 0, dtype_annotation=fmt).axes[0]
        info = ml_dtypes.finfo(fmt)
        expected = {
            "max": exponent_of(float(info.max)),
            "smallest normal": exponent_of(float(info.smallest_normal)),
            "smallest subnormal": exponent_of(float(info.smallest_subnormal)),
        }
        lines = {
            l.get_gid(): l.get_xdata()[0]
            for l in ax.get_lines()
            if (l.get_gid() or "").startswith("marker:")
        }
        assert lines == {f"marker:{k}": v for k, v in expected.items()}, fmt
        # The axis was widened to show every marker as a line.
        lo, hi = ax.get_xlim()
        assert lo < min(expected.values()) and max(expected.values()) < hi


def test_exp_hist_far_markers_become_edge_notes(df):
    """float32's range (2**-149 .. 2**127) is far wider than the data: its markers are
    notes at the panel edges naming the exponent, not lines far off the view."""
    ax = viz.exp_hist(df, "embed", "Activation", 0).axes[0]  # default: the logged dtype
    assert not [l for l in ax.get_lines() if (l.get_gid() or "").startswith("marker:")]
    notes = {t.get_gid(): t.get_text() for t in ax.texts}
    info = ml_dtypes.finfo("float32")
    assert f"$2^{{{exponent_of(float(info.max))}}}$" in notes["marker:max"]
    assert notes["marker:max"].endswith("\u2192")
    assert (
        f"$2^{{{exponent_of(float(info.smallest_subnormal))}}}$"
        in notes["marker:smallest subnormal"]
    )
    assert notes["marker:smallest subnormal"].startswith("\u2190")


def test_exp_hist_line_kind_plots_the_counts(df):
    ax = viz.exp_hist(df, "head", "Weight", 2, kind="line", dtype_annotation=None).axes[0]
    (line,) = [l for l in ax.get_lines() if l.get_label() == "exponent counts"]
    r = row(df, "head", "Weight", 2)[EXPONENT_COUNTS]
    for e, c in zip(line.get_xdata(), line.get_ydata()):
        assert c == r[int(e)]
    assert line.get_ydata().sum() == r.drop([UNDERFLOW, OVERFLOW]).sum()


def test_exp_hist_facets_by_regex_list_and_tensor_types(df):
    fig = viz.exp_hist(df, r"^layers\.\d\.mlp$", ["Activation", "Gradient"], 1, col_wrap=3)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [
        f"{n} ({t})" for n in ("layers.0.mlp", "layers.1.mlp") for t in ("Activation", "Gradient")
    ]
    # col_wrap=3 makes a 2 x 3 grid with four panels in it.
    assert {ax.get_subplotspec().get_geometry()[:2] for ax in fig.axes} == {(2, 3)}
    fig = viz.exp_hist(df, ["head", "embed"], "Weight", 1)
    assert [ax.get_title() for ax in fig.axes] == ["embed (Weight)", "head (Weight)"]  # log order
    assert {ax.get_subplotspec().get_geometry()[:2] for ax in fig.axes} == {(1, 2)}


# ------------------------------------------------------------------ scalar_line


def test_scalar_line_plots_each_metric_over_steps(df):
    fig = viz.scalar_line(df, "layers.1", "Weight", ["rm2", "max_abs"], col_wrap=1)
    assert [ax.get_title() for ax in fig.axes] == [
        "layers.1.attn (Weight)",
        "layers.1.mlp (Weight)",
    ]
    for ax in fig.axes:
        name = ax.get_title().split(" ")[0]
        lines = {l.get_label(): l for l in ax.get_lines()}
        assert set(lines) == {"rm2", "max_abs"}
        for metric, line in lines.items():
            assert list(line.get_xdata()) == list(range(6))
            expected = [row(df, name, "Weight", s)[("scalar_stats", metric)] for s in range(6)]
            np.testing.assert_array_equal(line.get_ydata(), expected)


def test_scalar_line_several_types_scatter_and_log_scale(df):
    fig = viz.scalar_line(df, "head", ["Activation", "Gradient"], "rm2", kind="scatter")
    (ax,) = fig.axes
    offsets = {c.get_label(): c.get_offsets() for c in ax.collections}
    assert set(offsets) == {"rm2 (Activation)", "rm2 (Gradient)"}
    got = offsets["rm2 (Activation)"]
    np.testing.assert_array_equal(
        got[:, 1], [row(df, "head", "Activation", s)[("scalar_stats", "rm2")] for s in range(6)]
    )
    assert ax.get_yscale() == "log"  # head activations grow ten-fold a step
    assert viz.scalar_line(df, "embed", "Weight", "rm2").axes[0].get_yscale() == "linear"
    forced = viz.scalar_line(df, "embed", "Weight", "rm2", log_scale=True)
    assert forced.axes[0].get_yscale() == "log"
    with pytest.warns(DeprecationWarning, match="log_scale"):  # the former spelling still works
        old = viz.scalar_line(df, "embed", "Weight", "rm2", logy=True)
    assert old.axes[0].get_yscale() == "log"
    with pytest.raises(viz.VizArgumentError, match="log_scale only"):
        viz.scalar_line(df, "embed", "Weight", "rm2", logy=True, log_scale=False)


def test_figures_display_themselves_in_a_notebook_as_png(df):
    # IPython asks for _repr_png_; nothing is registered when tandv.viz is imported
    for fig in (
        viz.exp_hist(df, "head", "Activation", 0),
        viz.scalar_line(df, "head", "Activation", "rm2"),
        viz.scalar_global_heatmap(df, "Activation", "rm2"),
        viz.percentile_bands(df, "Activation"),
    ):
        png = fig._repr_png_()
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
        assert width > 100 and height > 100


def test_scalar_line_against_another_metric(df):
    (ax,) = viz.scalar_line(df, "embed", "Weight", "rm4", x="rm2").axes
    (line,) = ax.get_lines()
    w = df[(df[("metadata", "name")] == "embed") & (df[("metadata", "tensor_type")] == "Weight")]
    w = w.sort_values(("scalar_stats", "rm2"))
    np.testing.assert_array_equal(line.get_xdata(), w[("scalar_stats", "rm2")])
    np.testing.assert_array_equal(line.get_ydata(), w[("scalar_stats", "rm4")])


# ------------------------------------------------------------------ heatmap


def expected_grid(df, tt, metric, steps):
    names = list(dict.fromkeys(df.loc[df[("metadata", "tensor_type")] == tt, ("metadata", "name")]))
    out = np.full((len(names), len(steps)), np.nan)
    for i, n in enumerate(names):
        for j, s in enumerate(steps):
            m = (
                (df[("metadata", "name")] == n)
                & (df[("metadata", "tensor_type")] == tt)
                & (df[("metadata", "step")] == s)
            )
            if m.any():
                out[i, j] = df.loc[m, ("scalar_stats", metric)].iloc[0]
    return names, out


def test_heatmap_cells_are_the_logged_values_one_panel_per_type(df):
    fig = viz.scalar_global_heatmap(
        df, ["Activation", "Gradient", "Weight"], "rm2", inc=2, col_wrap=2
    )
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["Activation: rm2", "Gradient: rm2", "Weight: rm2"]
    for ax in panels:
        tt = ax.get_title().split(":")[0]
        names, grid = expected_grid(df, tt, "rm2", [0, 2, 4])
        (mesh,) = [c for c in ax.collections if c.get_gid() == "heatmap"]
        np.testing.assert_array_equal(
            np.ma.filled(mesh.get_array(), np.nan).reshape(grid.shape), grid
        )
        assert [t.get_text() for t in ax.get_yticklabels()] == names == list(LAYERS)
        assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "2", "4"]
        # Activations span decades (the head grows ten-fold a step): log colours.
        assert isinstance(mesh.norm, LogNorm) == (tt == "Activation")


def test_heatmap_blank_where_a_tensor_was_not_logged():
    x = np.ones(8, np.float32)
    log = log_from_arrays(
        {("a", "Weight", 0): x, ("b", "Weight", 0): 2 * x, ("a", "Weight", 1): 3 * x}
    )
    (ax, _) = viz.scalar_global_heatmap(log, "Weight", "max_abs").axes
    (mesh,) = ax.collections
    arr = mesh.get_array().reshape(2, 2)
    assert arr[0, 0] == 1 and arr[1, 0] == 2 and arr[0, 1] == 3 and np.ma.is_masked(arr[1, 1])


def test_heatmap_cell_lookup_maps_clicks_to_layer_and_step(df):
    from tandv.viz.scalar import heatmap_panels

    _, (panel,) = heatmap_panels(df, "Gradient", "std", inc=2)
    assert panel.cell_at(0.5, 0.5) == (LAYERS[0], 0)
    assert panel.cell_at(2.2, 5.9) == (LAYERS[5], 4)
    assert panel.cell_at(3.1, 0.5) is None and panel.cell_at(0.5, -0.1) is None


# ------------------------------------------------------------------ percentile bands


def counts_frame(rows: list[dict]) -> pd.DataFrame:
    labels = sorted({k for r in rows for k in r if k not in (UNDERFLOW, OVERFLOW)})
    return pd.DataFrame(
        [[r.get(k, 0) for k in [UNDERFLOW, *labels, OVERFLOW]] for r in rows],
        columns=[UNDERFLOW, *labels, OVERFLOW],
    )


def test_percentiles_from_counts_interpolate_within_bins():
    c = counts_frame([{3: 10}, {-2: 5, 4: 5}, {0: 0, 1: 0}, {1: 2, UNDERFLOW: 2}])
    p = viz.log2_percentiles(c, [0, 25, 50, 100])
    np.testing.assert_allclose(p[0], [3, 3.25, 3.5, 4])  # one bin: uniform in log2
    np.testing.assert_allclose(p[1], [-2, -1.5, -1, 5])  # the median at the upper edge of 2**-2
    assert np.isnan(p[2]).all()  # nothing counted
    np.testing.assert_allclose(p[3], [1, 1, 1, 2])  # underflow at the lowest non-empty bin's edge
    # Stored empty exponent columns change nothing (parquet logs drop them).
    wide = counts_frame([{1: 2, UNDERFLOW: 2, OVERFLOW: 1, -30: 0, 40: 0}])
    np.testing.assert_allclose(
        viz.log2_percentiles(wide, [0, 50, 100])[0], [1, 1.25, 2]
    )  # 2.5 of 5: a quarter into 2**1


def test_percentiles_agree_with_numpy_within_a_bin():
    rng = np.random.default_rng(3)
    x = rng.lognormal(0, 3, 20000).astype(np.float32)
    log = log_from_arrays({("w", "Weight", 0): x})
    qs = [2.28, 15.87, 50, 84.13, 97.72]
    got = viz.log2_percentiles(
        pd.DataFrame(log[EXPONENT_COUNTS].to_numpy(), columns=list(log[EXPONENT_COUNTS].columns)),
        qs,
    )[0]
    want = np.percentile(np.log2(x.astype(np.float64)), qs)
    assert np.all(np.abs(got - want) < 1.0)


def test_percentile_bands_whole_model_and_per_layer(df):
    fig = viz.percentile_bands(df, ["Activation", "Weight"])
    assert [ax.get_title() for ax in fig.axes] == [
        "whole model (Activation)",
        "whole model (Weight)",
    ]
    ax = fig.axes[1]
    (median,) = [l for l in ax.get_lines() if l.get_gid() == "line:50"]
    # The median of all Weight tensors' counts added up, per step.
    w = df[df[("metadata", "tensor_type")] == "Weight"]
    summed = w.groupby(("metadata", "step"))[
        list(w[EXPONENT_COUNTS].columns.map(lambda c: (EXPONENT_COUNTS, c)))
    ].sum()
    summed.columns = [c[1] for c in summed.columns]
    np.testing.assert_allclose(
        median.get_ydata(), np.exp2(viz.log2_percentiles(summed, [50])[:, 0])
    )
    assert list(median.get_xdata()) == list(range(6))
    assert ax.get_yscale() == "log"
    bands = [c.get_gid() for c in ax.collections]
    assert bands == ["band:0-100", "band:0.13-99.87", "band:2.28-97.72", "band:15.87-84.13"]
    # The head's gradient holds an inf from step 5: those steps are marked, nothing else.
    grad = viz.percentile_bands(df, "Gradient").axes[0]
    (marks,) = [c for c in grad.collections if c.get_gid() == "marks:+inf"]
    assert list(marks.get_offsets()[:, 0]) == [5]
    assert not [c for c in ax.collections if (c.get_gid() or "").startswith("marks:")]

    fig = viz.percentile_bands(df, tt="Gradient", layer="layers.0", percentiles=[10, 50, 90], inc=3)
    assert [ax.get_title() for ax in fig.axes] == [
        "layers.0.attn (Gradient)",
        "layers.0.mlp (Gradient)",
    ]
    (median,) = [l for l in fig.axes[0].get_lines() if l.get_gid() == "line:50"]
    assert list(median.get_xdata()) == [0, 3]


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda d: viz.exp_hist(d, "nope", "Activation", 0),
            r"layer='nope' matches no tensor.*'embed', 'layers.0.attn'",
        ),
        (
            lambda d: viz.exp_hist(d, "embed", "Activations", 0),
            r"tt='Activations' is not a tensor type.*'Optimiser_State'",
        ),
        (
            lambda d: viz.exp_hist(d, "embed", "Optimiser_State", 0),
            r"no Optimiser_State rows.*'Activation', 'Gradient', 'Weight'",
        ),
        (
            lambda d: viz.exp_hist(d, "embed", "Weight", 99),
            r"step=99.*logged steps: 0, 1, 2, 3, 4, 5",
        ),
        (
            lambda d: viz.exp_hist(d, "embed", "Weight", 0, dtype_annotation="float7"),
            r"float8_e4m3fn",
        ),
        (
            lambda d: viz.scalar_line(d, "embed", "Weight", "rms"),
            r"scalar_metric='rms' is not in the log.*'rm2'",
        ),
        (lambda d: viz.scalar_line(d, "embed", "Weight", "rm2", x="epoch"), r"x='epoch'.*'step'"),
        (lambda d: viz.scalar_global_heatmap(d, "Weight", "rm2", inc=0), r"inc=0"),
        (lambda d: viz.scalar_global_heatmap(d, "Weight", ["rm2", "std"]), r"one metric"),
        (
            lambda d: viz.percentile_bands(d, "Weight", "[unclosed"),
            r"not a valid regular expression.*'embed'",
        ),
        (lambda d: viz.percentile_bands(d, "Weight", percentiles=[50, 10]), r"ascending"),
    ],
)
def test_bad_arguments_list_what_is_available(df, call, message):
    with pytest.raises(viz.VizArgumentError, match=message):
        call(df)


def test_unvalidated_frames_are_refused(df):
    broken = df.drop(columns=[(EXPONENT_COUNTS, OVERFLOW)])
    with pytest.raises(SchemaError, match=re.escape("'+inf'")):
        viz.exp_hist(broken, "embed", "Weight", 0)
    flat = pd.DataFrame({"name": ["a"], "rm2": [1.0]})
    with pytest.raises(SchemaError, match="MultiIndex"):
        viz.scalar_line(flat, "a", "Weight", "rm2")
    with pytest.raises(viz.VizArgumentError, match="no rows"):
        viz.scalar_global_heatmap(df.iloc[:0], "Weight", "rm2")


def test_degenerate_tensors_all_nan_all_zero_or_constant():
    nan = np.full(4, np.nan, np.float32)
    log = log_from_arrays(
        {
            ("a", "Weight", 0): nan,
            ("a", "Weight", 1): nan,
            ("b", "Weight", 0): np.ones(4, np.float32),
            ("z", "Gradient", 0): np.zeros(4, np.float32),
        }
    )
    for log_scale in (None, True, False):
        fig = viz.scalar_global_heatmap(log, "Weight", "rm2", log_scale=log_scale)
        fig.savefig(io.BytesIO())  # the colorbar of a constant panel draws
        mesh = fig.axes[0].collections[0]
        arr = mesh.get_array().reshape(2, 2)
        assert arr[1, 0] == 1 and np.ma.is_masked(arr[0, 0]) and np.ma.is_masked(arr[0, 1])
    ax = viz.percentile_bands(log, "Gradient").axes[0]  # only zeros: nothing counted
    assert [t.get_text() for t in ax.texts] == ["no finite non-zero values logged"]
    ax = viz.exp_hist(log, "a", "Weight", 0, dtype_annotation=False).axes[0]
    assert sum(bars(ax, "exponent counts").values()) == 0


def test_log_scale_rule():
    from tandv.viz.scalar import spans_decades

    assert not spans_decades(np.array([1.0, 19.9]))
    assert spans_decades(np.array([1.0, 20.0]))
    assert spans_decades(np.array([np.nan, 0.01, 0.5, np.inf]))  # non-finite values are ignored
    assert spans_decades(np.array([0.0, 1.0, 100.0]))  # zeros get their own colour
    assert not spans_decades(np.array([0.0, 0.0]))
    assert not spans_decades(np.array([-1.0, 100.0]))


def test_heatmap_zeros_on_a_log_scale_take_the_under_colour():
    x = np.ones(4, np.float32)
    log = log_from_arrays(
        {
            ("bias", "Weight", 0): 0 * x,
            ("bias", "Weight", 1): 0.01 * x,
            ("w", "Weight", 0): x,
            ("w", "Weight", 1): 2 * x,
        }
    )
    fig = viz.scalar_global_heatmap(log, "Weight", "rm2")
    ax, cbar = fig.axes
    (mesh,) = ax.collections
    assert isinstance(mesh.norm, LogNorm) and (mesh.norm.vmin, mesh.norm.vmax) == (
        np.float32(0.01),
        2.0,
    )
    arr = mesh.get_array().reshape(2, 2)
    assert arr[0, 0] < mesh.norm.vmin  # the zero: below the range, drawn in the "under" grey
    np.testing.assert_allclose([arr[0, 1], arr[1, 0], arr[1, 1]], [0.01, 1, 2], rtol=1e-6)
    assert "grey = 0" in cbar.get_ylabel()


def test_many_tensors_wrap_and_heatmap_panels_size_to_their_layers():
    """23 per-layer panels wrap four to a row (they used to make one 8,800-pixel row); the
    heatmap stacks its panels, each as tall as its own layers need."""
    rng = np.random.default_rng(0)
    arrays = {
        (f"layers.{i}", tt, s): rng.standard_normal(64).astype(np.float32)
        for i in range(23)
        for tt in ("Activation",)
        for s in range(3)
    }
    arrays.update(
        {
            (f"g.{i}", "Gradient", s): rng.standard_normal(64).astype(np.float32)
            for i in range(60)
            for s in range(3)
        }
    )
    log = log_from_arrays(arrays)
    fig = viz.percentile_bands(log, "Activation", layer=r"^layers\.")
    rows = {round(ax.get_position().y0, 3) for ax in fig.axes}
    cols = {round(ax.get_position().x0, 3) for ax in fig.axes}
    assert len(fig.axes) == 23 and len(cols) == 4 and len(rows) == 6
    fig = viz.scalar_global_heatmap(log, ["Activation", "Gradient"], "rm2")
    act, grad = [ax for ax in fig.axes if any(c.get_gid() == "heatmap" for c in ax.collections)]
    assert len(grad.get_yticklabels()) == 60
    assert grad.get_position().height > 2 * act.get_position().height  # 60 rows against 23


def test_heatmap_colours_are_not_saturated_by_one_outlier():
    """One tensor far off the others (the loss's gradient) takes the end colour; the
    colour range spans the others' values, and the colorbar shows the clipping."""
    rng = np.random.default_rng(1)
    arrays = {
        (f"t{i}", "Gradient", s): (rng.standard_normal(64) * (1 + i / 10)).astype(np.float32)
        for i in range(30)
        for s in range(4)
    }
    for s in range(4):
        arrays[("root[loss]", "Gradient", s)] = np.full(64, 1e6, np.float32)
    log = log_from_arrays(arrays)
    fig = viz.scalar_global_heatmap(log, "Gradient", "rm2", log_scale=False)
    ax, cbar = fig.axes
    (mesh,) = ax.collections
    others = log[log[("metadata", "name")] != "root[loss]"][("scalar_stats", "rm2")]
    # every ordinary cell keeps its own colour; the outlier is far above the range
    assert others.max() <= mesh.norm.vmax < 1e6 / 1000 and mesh.norm.vmin <= others.min()
    assert mesh.colorbar.extend in ("max", "both")


def test_step_axes_tick_whole_steps_only():
    log = training_log(steps=4)
    for fig in (
        viz.scalar_line(log, "embed", "Weight", "rm2"),
        viz.percentile_bands(log, "Weight", layer="embed"),
    ):
        ax = fig.axes[0]
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)


def test_exp_hist_marks_the_format_a_log_was_counted_in():
    """A log counted as float8_e4m3fn (its record says so) is annotated with that format's
    markers by default, the format its underflow and overflow bars refer to, not the
    tensors' float32."""
    x = np.float32(2.0) ** np.arange(-12, 10, dtype=np.float32)
    log = log_from_arrays({("a", "Activation", 0): x}, fmt="float8_e4m3fn")
    log.attrs["tandv"] = {"number_format": "float8_e4m3fn"}
    ax = viz.exp_hist(log, "a", "Activation", 0).axes[0]
    lines = {
        l.get_gid(): l.get_xdata()[0]
        for l in ax.get_lines()
        if (l.get_gid() or "").startswith("marker:")
    }
    info = ml_dtypes.finfo("float8_e4m3fn")
    assert lines["marker:smallest subnormal"] == exponent_of(float(info.smallest_subnormal))
    assert lines["marker:max"] == exponent_of(float(info.max))
