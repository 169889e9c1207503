"""Scalar statistics over training: line plots per tensor, and the layers x steps heatmap."""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure

from ..schema import METADATA, NAME, SCALAR_STATS, STEP, TENSOR_TYPE
from ._data import (
    VizArgumentError,
    check_log,
    rows_for,
    select_layers,
    select_metrics,
    select_steps,
    select_tensor_types,
)
from ._facets import NotebookFigure, facet_grid, figure_legend, plain, step_axis

__all__ = [
    "scalar_line",
    "scalar_global_heatmap",
    "spans_decades",
    "HeatmapPanel",
    "heatmap_panels",
]

#: A metric is drawn on a log scale when its positive values span at least this ratio
#: (a bit over a decade: e.g. LayerNorm weights near 1 beside projections near 0.02).
DECADES_RATIO = 20.0


def spans_decades(values: np.ndarray) -> bool:
    """True when no finite value is negative and the largest positive one is at least
    :data:`DECADES_RATIO` times the smallest: then a log scale shows them best. Zeros
    (a bias initialised to zero) do not prevent it; the heatmap gives them their own colour."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    pos = v[v > 0]
    return bool(pos.size and not (v < 0).any() and pos.max() >= DECADES_RATIO * pos.min())


def scalar_line(
    df: pd.DataFrame,
    layer: str | re.Pattern[str] | Sequence[str] | None,
    tt: str | Sequence[str],
    scalar_metric: str | Sequence[str],
    x: str = "step",
    col_wrap: int | None = None,
    kind: Literal["line", "scatter"] = "line",
    log_scale: bool | None = None,
    figsize: tuple[float, float] | None = None,
    logy: bool | None = None,
) -> Figure:
    """One or more scalar statistics of each selected tensor over training.

    One panel per tensor name; in it one curve per (metric, tensor type), so e.g. the
    RMS of a layer's weight and of its gradient can be read off together.

    Arguments:
        df: a tandv log.
        layer: a name, a list of names, a regular expression, or ``None`` for all.
        tt: a tensor type or a list of them.
        scalar_metric: a scalar statistic (``"rm2"``) or a list of them.
        x: ``"step"`` or another scalar statistic to plot against.
        col_wrap: panels per row (default: at most four).
        kind: ``"line"`` or ``"scatter"``.
        log_scale: log-scale y axis; default when the plotted values are positive and the
            largest is :data:`DECADES_RATIO` (20) times the smallest or more (the same
            argument as the heatmaps').
        figsize: figure size in inches.
        logy: the former name of ``log_scale``, still accepted with a DeprecationWarning.

    Raises:
        tandv.SchemaError: if ``df`` is not a valid log.
        VizArgumentError: for an unknown layer, tensor type, metric or ``x``.
    """
    if logy is not None:
        if log_scale is not None:
            raise VizArgumentError("scalar_line: give log_scale only (logy is its former name)")
        warnings.warn(
            "scalar_line(logy=...) is deprecated; use log_scale=...",
            DeprecationWarning,
            stacklevel=2,
        )
        log_scale = logy
    check_log(df)
    if kind not in ("line", "scatter"):
        raise VizArgumentError(f"kind={kind!r}: expected 'line' or 'scatter'")
    tts = select_tensor_types(df, tt)
    metrics = select_metrics(df, scalar_metric)
    if x != STEP:
        try:
            select_metrics(df, x)
        except VizArgumentError as e:
            raise VizArgumentError(f"x={x!r}: expected 'step' or a scalar statistic; {e}") from None
    names = select_layers(df, layer, tts)
    sel = rows_for(df, names, tts)
    xcol = (METADATA, STEP) if x == STEP else (SCALAR_STATS, x)
    values = sel[[(SCALAR_STATS, m) for m in metrics]].to_numpy(dtype=np.float64)
    use_log = spans_decades(values) if log_scale is None else bool(log_scale)
    fig, axes = facet_grid(len(names), col_wrap, figsize=figsize)
    several_tt = len(tts) > 1
    for ax, name in zip(axes, names):
        for m_i, m in enumerate(metrics):
            for t_i, t in enumerate(tts):
                rows = sel[(sel[(METADATA, NAME)] == name) & (sel[(METADATA, TENSOR_TYPE)] == t)]
                if rows.empty:
                    continue
                rows = rows.sort_values(xcol)
                xs = rows[xcol].to_numpy()
                ys = rows[(SCALAR_STATS, m)].to_numpy(dtype=np.float64)
                label = plain(f"{m} ({t})" if several_tt else m)
                color = f"C{m_i * len(tts) + t_i}"
                if kind == "line":
                    ax.plot(xs, ys, label=label, color=color, marker="." if len(xs) < 30 else None)
                else:
                    ax.scatter(xs, ys, label=label, color=color, s=10)
        if use_log:
            ax.set_yscale("log")
        ax.set_title(plain(name if several_tt else f"{name} ({tts[0]})"), fontsize=9)
        if x == "step":
            step_axis(ax)
        else:
            ax.set_xlabel(x)
        ax.grid(True, alpha=0.3)
    figure_legend(fig, axes)
    fig.suptitle(plain(", ".join(metrics)))
    return fig


def _colour_scale(mat: np.ndarray, use_log: bool) -> tuple[Normalize, np.ma.MaskedArray, bool]:
    """The colour norm of a heatmap, its values with the cells that cannot be coloured
    masked (non-finite; negative on a log scale), and whether it has zeros on a log scale.

    Zeros on a log scale are moved below the norm's minimum so they take the colour map's
    "under" colour. A constant or empty panel gets a small range around its value so the
    colorbar stays valid."""
    finite = np.isfinite(mat)
    if use_log:
        shown = np.ma.masked_where(~finite | (mat < 0), mat)
        pos = shown.compressed()
        pos = pos[pos > 0]
        lo, hi = _robust_range(np.log10(pos)) if pos.size else (0.0, 1.0)
        lo, hi = 10.0**lo, 10.0**hi
        vmin, vmax = (lo, hi) if hi > lo else (lo / 2, hi * 2)
        norm = LogNorm(vmin, vmax)
        zeros = bool((shown == 0).any())
        # outliers take the end colours (the colorbar's arrows say so); zeros the "under" grey
        shown = np.ma.where((shown > 0) & (shown < vmin), vmin, shown)
        if zeros:
            shown = np.ma.where(shown == 0, vmin / 10, shown)
        return norm, shown, zeros
    shown = np.ma.masked_where(~finite, mat)
    vals = shown.compressed()
    lo, hi = _robust_range(vals) if vals.size else (0.0, 1.0)
    return (Normalize(lo, hi) if hi > lo else Normalize(lo - 0.5, hi + 0.5)), shown, False


#: A heatmap's colours stop at Tukey's far fences, ROBUST interquartile ranges beyond the
#: quartiles (of log10 values on a log scale), so that one tensor far off the others (the
#: loss's gradient, say) does not saturate the scale: cells beyond take the end colours.
ROBUST = 3.0


def _robust_range(vals: np.ndarray) -> tuple[float, float]:
    """The colour range of ``vals``: their full range, clipped to the far fences."""
    lo, hi = float(vals.min()), float(vals.max())
    q1, q3 = (float(v) for v in np.percentile(vals, [25.0, 75.0]))
    iqr = q3 - q1
    if iqr <= 0:
        return lo, hi
    return max(lo, q1 - ROBUST * iqr), min(hi, q3 + ROBUST * iqr)


@dataclass
class HeatmapPanel:
    """One heatmap panel: its axes, tensor type, and the layers (rows) and steps (columns)
    its cells stand for, so a click at data coordinates maps back to a tensor and a step."""

    ax: Axes
    tt: str
    layers: list[str]
    steps: list[int]
    values: np.ndarray  # layers x steps, NaN where a tensor has no row at a step

    def cell_at(self, xdata: float, ydata: float) -> tuple[str, int] | None:
        """The (layer, step) of the cell at data coordinates, or None outside the grid."""
        col, row = int(np.floor(xdata)), int(np.floor(ydata))
        if 0 <= row < len(self.layers) and 0 <= col < len(self.steps):
            return self.layers[row], self.steps[col]
        return None


def heatmap_panels(
    df: pd.DataFrame,
    tt: str | Sequence[str],
    scalar_metric: str,
    inc: int = 1,
    col_wrap: int | None = None,
    log_scale: bool | None = None,
    layer: str | re.Pattern[str] | Sequence[str] | None = None,
    figsize: tuple[float, float] | None = None,
) -> tuple[Figure, list[HeatmapPanel]]:
    """:func:`scalar_global_heatmap`, also returning the panels' cell maps (for clicks)."""
    check_log(df)
    tts = select_tensor_types(df, tt)
    if not isinstance(scalar_metric, str):
        raise VizArgumentError(
            f"scalar_metric={scalar_metric!r}: the heatmap shows one metric; pass a name"
        )
    (metric,) = select_metrics(df, scalar_metric)
    grids = []
    for t in tts:
        names = select_layers(df, layer, [t])
        rows = rows_for(df, names, [t])
        steps = select_steps(rows, inc)
        rows = rows[rows[(METADATA, STEP)].isin(steps)]
        flat = pd.DataFrame(
            {
                "name": rows[(METADATA, NAME)].to_numpy(),
                "step": rows[(METADATA, STEP)].to_numpy(),
                "value": rows[(SCALAR_STATS, metric)].to_numpy(dtype=np.float64),
            }
        )
        wide = flat.pivot(index="name", columns="step", values="value")
        wide = wide.reindex(index=names, columns=steps)
        grids.append((t, names, steps, wide.to_numpy(dtype=np.float64)))
    width = max(5.0, min(14.0, 0.12 * max(len(g[2]) for g in grids) + 3.5))
    if col_wrap is None:
        # one panel per row, each as tall as its layers need (a label every 0.2 inch)
        heights = [max(1.6, min(14.0, 0.2 * len(g[1]) + 1.0)) for g in grids]
        fig = NotebookFigure(figsize=figsize or (width, sum(heights) + 0.4), layout="constrained")
        axes = list(fig.subplots(len(grids), 1, squeeze=False, height_ratios=heights)[:, 0])
    else:
        n_layers = max(len(g[1]) for g in grids)
        fig, axes = facet_grid(
            len(grids),
            col_wrap,
            panel_size=(width, max(2.6, min(14.0, 0.2 * n_layers + 1.2))),
            figsize=figsize,
        )
    panels = []
    for ax, (t, names, steps, mat) in zip(axes, grids):
        use_log = spans_decades(mat) if log_scale is None else bool(log_scale)
        norm, shown, zeros = _colour_scale(mat, use_log)
        cmap = colormaps["viridis"].with_extremes(under="0.55", bad="white")
        mesh = ax.pcolormesh(
            np.arange(len(steps) + 1),
            np.arange(len(names) + 1),
            shown,
            norm=norm,
            cmap=cmap,
            gid="heatmap",
        )
        label = metric + (" (log scale" + ("; grey = 0)" if zeros else ")") if use_log else "")
        vals = mat[np.isfinite(mat) & ((mat > 0) if use_log else True)]
        below = vals.size and vals.min() < norm.vmin
        above = vals.size and vals.max() > norm.vmax
        extend = {(True, True): "both", (True, False): "min", (False, True): "max"}.get(
            (bool(below or zeros), bool(above)), "neither"
        )
        fig.colorbar(mesh, ax=ax, label=label, extend=extend)
        ax.set_ylim(len(names), 0)  # first layer at the top
        # Every layer named while they fit; beyond 80 rows every k-th, to stay legible.
        ystride = max(1, int(np.ceil(len(names) / 80)))
        ax.set_yticks(
            np.arange(0, len(names), ystride) + 0.5,
            [plain(n) for n in names[::ystride]],
            fontsize=7 if len(names) < 40 else 5,
        )
        stride = max(1, int(np.ceil(len(steps) / 12)))
        ax.set_xticks(
            np.arange(0, len(steps), stride) + 0.5, [str(s) for s in steps[::stride]], fontsize=7
        )
        ax.set_xlabel("step")  # ticks at whole steps already: one per column
        ax.set_title(plain(f"{t}: {metric}"), fontsize=10)
        panels.append(HeatmapPanel(ax, t, names, steps, mat))
    return fig, panels


def scalar_global_heatmap(
    df: pd.DataFrame,
    tt: str | Sequence[str],
    scalar_metric: str,
    inc: int = 1,
    col_wrap: int | None = None,
    log_scale: bool | None = None,
    layer: str | re.Pattern[str] | Sequence[str] | None = None,
    figsize: tuple[float, float] | None = None,
) -> Figure:
    """A scalar statistic of every tensor at every step, as a layers x steps heatmap.

    The global view of a run: which layers drift, blow up or collapse, and when.
    Layers run top to bottom in the order the log first holds them (the model's
    order); blank cells are steps at which a tensor was not logged.

    Arguments:
        df: a tandv log.
        tt: a tensor type, or a list of them for one panel each.
        scalar_metric: the statistic coloured, e.g. ``"rm2"``.
        inc: show every ``inc``-th logged step (the first always).
        col_wrap: panels per row (default: one per row, each as tall as its layers need).
        log_scale: colour on a log scale; default when the panel's values are positive
            and the largest is :data:`DECADES_RATIO` (20) times the smallest or more.
        layer: restrict the rows to these tensors (name, list or regex); default all.
        figsize: figure size in inches.

    Raises:
        tandv.SchemaError: if ``df`` is not a valid log.
        VizArgumentError: for an unknown tensor type, metric or layer, or a bad ``inc``.
    """
    return heatmap_panels(df, tt, scalar_metric, inc, col_wrap, log_scale, layer, figsize)[0]
