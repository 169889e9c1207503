"""Percentile bands of magnitudes over training, estimated from the exponent counts.

Like the Chainer monitor's percentile plot, but the percentiles are those of |x| over
the finite non-zero values, read off the log's exponent histograms: within a bin
``2**n <= |x| < 2**(n+1)`` values are taken as spread uniformly in log2|x|. An
estimate is therefore exact to within its bin, whatever the tensor's size, and bands
can be drawn for a whole model by adding the histograms of all its tensors.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..schema import METADATA, OVERFLOW, STEP, UNDERFLOW
from ._data import (
    VizArgumentError,
    check_log,
    exponent_table,
    rows_for,
    select_layers,
    select_tensor_types,
    thin_steps,
)
from ._facets import facet_grid, figure_legend, plain, step_axis

__all__ = ["percentile_bands", "log2_percentiles", "SIGMA_PERCENTILES"]

#: The percentiles drawn by default: the median, and 1, 2 and 3 sigma either side of it
#: (for a normal distribution), plus the extremes, as in Chainer's monitor.
SIGMA_PERCENTILES: tuple[float, ...] = (0.0, 0.13, 2.28, 15.87, 50.0, 84.13, 97.72, 99.87, 100.0)


def log2_percentiles(counts: pd.DataFrame, percentiles: Sequence[float]) -> np.ndarray:
    """Percentiles of log2|x| for each row of exponent counts.

    Arguments:
        counts: rows of counts with columns ``-inf``, int exponents, ``+inf`` (any order;
            missing exponents count zero).
        percentiles: values in [0, 100].

    Returns:
        A float array, rows x percentiles; NaN for a row with no counted value in an
        exponent bin. The log does not say how far beyond the format underflowed and
        overflowed values went, so they are placed at the lower edge of the row's lowest
        non-empty bin and the upper edge of its highest (:func:`percentile_bands` marks
        the steps where that happens). This keeps the result independent of which empty
        exponent columns a log happens to store.
    """
    qs = np.asarray(percentiles, dtype=np.float64)
    if qs.size == 0 or (qs < 0).any() or (qs > 100).any():
        raise VizArgumentError(f"percentiles={list(percentiles)!r}: expected values in [0, 100]")
    ints = np.array(
        sorted(c for c in counts.columns if c not in (UNDERFLOW, OVERFLOW)), dtype=np.int64
    )
    c = counts[[UNDERFLOW, *ints.tolist(), OVERFLOW]].to_numpy(dtype=np.float64)
    # Bin i spans [left[i], left[i] + width[i]) in log2|x|; underflow and overflow have
    # zero width, at the row's edges.
    width = np.concatenate([[0.0], np.ones(ints.size), [0.0]])
    out = np.full((c.shape[0], qs.size), np.nan)
    for r in range(c.shape[0]):
        row = c[r]
        inner = np.flatnonzero(row[1:-1])
        if inner.size == 0:
            continue
        left = np.concatenate([[ints[inner[0]]], ints, [ints[inner[-1]] + 1]]).astype(np.float64)
        total = row.sum()
        cum = np.cumsum(row)
        before = cum - row
        nz = np.flatnonzero(row)
        for j, q in enumerate(qs):
            target = q / 100.0 * total
            # The first non-empty bin whose cumulative count reaches the target.
            i = nz[np.searchsorted(cum[nz], target, side="left")] if target > 0 else nz[0]
            frac = 0.0 if target <= before[i] else (target - before[i]) / row[i]
            out[r, j] = left[i] + width[i] * frac
    return out


def percentile_bands(
    df: pd.DataFrame,
    tt: str | Sequence[str],
    layer: str | re.Pattern[str] | Sequence[str] | None = None,
    percentiles: Sequence[float] = SIGMA_PERCENTILES,
    inc: int = 1,
    col_wrap: int | None = None,
    figsize: tuple[float, float] | None = None,
) -> Figure:
    """Bands of |x| percentiles over training, from the exponent counts.

    Percentiles pair up from the outside in (first with last, ...) into shaded bands,
    darker towards the middle; an odd middle one (the median by default) is a line.
    Triangles mark steps holding values that overflowed (or were inf) or underflowed
    the logged format.

    Arguments:
        df: a tandv log.
        tt: a tensor type or a list of them.
        layer: ``None`` for one panel per tensor type over the whole model (all its
            tensors' histograms added up); or a name, list or regex for one panel per
            (tensor, type).
        percentiles: ascending values in [0, 100]; default :data:`SIGMA_PERCENTILES`.
        inc: use every ``inc``-th logged step.
        col_wrap: panels per row (default: at most four).
        figsize: figure size in inches.

    Raises:
        tandv.SchemaError: if ``df`` is not a valid log.
        VizArgumentError: for an unknown layer or tensor type, or bad percentiles.
    """
    check_log(df)
    qs = [float(q) for q in percentiles]
    if qs != sorted(qs):
        raise VizArgumentError(f"percentiles={qs!r}: expected ascending values")
    tts = select_tensor_types(df, tt)
    if layer is None:
        groups = [(f"whole model ({t})", rows_for(df, None, [t])) for t in tts]
        groups = [
            (title, rows.groupby((METADATA, STEP)).sum(numeric_only=True)) for title, rows in groups
        ]
    else:
        names = select_layers(df, layer, tts)
        groups = []
        for n in names:
            for t in tts:
                rows = rows_for(df, [n], [t])
                if not rows.empty:
                    groups.append((f"{n} ({t})", rows.set_index((METADATA, STEP)).sort_index()))
    fig, axes = facet_grid(len(groups), col_wrap, figsize=figsize)
    npairs = len(qs) // 2
    for ax, (title, by_step) in zip(axes, groups):
        steps = thin_steps(by_step.index, inc)
        table = exponent_table(by_step.loc[steps])
        p = np.exp2(log2_percentiles(table, qs))
        for k in range(npairs):
            shade = 0.15 + 0.55 * (k + 1) / max(npairs, 1)
            ax.fill_between(
                steps,
                p[:, k],
                p[:, -1 - k],
                color="tab:blue",
                alpha=shade * 0.6,
                linewidth=0,
                label=f"{qs[k]:g}\u2013{qs[-1 - k]:g}%",
                gid=f"band:{qs[k]:g}-{qs[-1 - k]:g}",
            )
        if len(qs) % 2:
            ax.plot(
                steps,
                p[:, npairs],
                color="k",
                linewidth=1.2,
                label=f"{qs[npairs]:g}%",
                gid=f"line:{qs[npairs]:g}",
            )
        # Steps with values beyond the logged format, at the band's edge where they are placed.
        for label, col, edge, mark, colour in (
            ("overflow / inf", OVERFLOW, -1, "^", "tab:red"),
            ("underflow", UNDERFLOW, 0, "v", "0.4"),
        ):
            hit = table[col].to_numpy() > 0
            if hit.any():
                ax.scatter(
                    np.asarray(steps)[hit],
                    p[hit, edge],
                    marker=mark,
                    color=colour,
                    zorder=3,
                    label=label,
                    gid=f"marks:{col}",
                )
        if np.isfinite(p).any():
            ax.set_yscale("log", base=2)
        else:
            ax.text(
                0.5,
                0.5,
                "no finite non-zero values logged",
                transform=ax.transAxes,
                ha="center",
                va="center",
            )
        ax.set_title(plain(title), fontsize=9)
        step_axis(ax)
        ax.set_ylabel("|x| percentiles")
        ax.grid(True, alpha=0.3)
    figure_legend(fig, axes)
    fig.suptitle("Percentiles of |x| (from exponent counts)")
    return fig
