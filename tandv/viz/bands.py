"""Percentile bands of magnitudes over training, estimated from the exponent counts.

Like the Chainer monitor's percentile plot, but the percentiles are those of |x| over
the finite non-zero values, read off the log's exponent histograms: within a bin
``2**n <= |x| < 2**(n+1)`` values are taken as spread uniformly in log2|x|. An
estimate is therefore exact to within its bin, whatever the tensor's size, and bands
can be drawn for a whole model by adding the histograms of all its tensors.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..schema import METADATA, OVERFLOW, STEP, UNDERFLOW
from ._data import VizArgumentError, check_log, exponent_table, rows_for, select_layers, select_tensor_types, thin_steps
from ._facets import facet_grid

__all__ = ["percentile_bands", "log2_percentiles", "SIGMA_PERCENTILES"]

#: The percentiles drawn by default: the median, and 1, 2 and 3 sigma either side of it
#: (for a normal distribution), plus the extremes, as in Chainer's monitor.
SIGMA_PERCENTILES: tuple[float, ...] = (0.0, 0.13, 2.28, 15.87, 50.0, 84.13, 97.72, 99.87, 100.0)


def log2_percentiles(counts: pd.DataFrame, percentiles: Sequence[float]) -> np.ndarray:
    """Percentiles of log2|x| for each row of exponent counts.

    Arguments:
        counts: rows of counts with columns ``-inf``, ascending int exponents, ``+inf``
            (as :func:`tandv.viz._data.exponent_table` gives).
        percentiles: values in [0, 100].

    Returns:
        A float array, rows x percentiles; NaN for a row with no counted values.
        Underflowed values are placed at the lower edge of the lowest exponent column
        and overflowed ones at the upper edge of the highest, since the log does not say
        how far beyond the format they went.
    """
    qs = np.asarray(percentiles, dtype=np.float64)
    if qs.size == 0 or (qs < 0).any() or (qs > 100).any():
        raise VizArgumentError(f"percentiles={list(percentiles)!r}: expected values in [0, 100]")
    ints = np.array([c for c in counts.columns if c not in (UNDERFLOW, OVERFLOW)], dtype=np.int64)
    c = counts[[UNDERFLOW, *ints.tolist(), OVERFLOW]].to_numpy(dtype=np.float64)
    lo = ints.min() if ints.size else 0
    hi = ints.max() + 1 if ints.size else 1
    # Bin i spans [left[i], left[i] + width[i]) in log2|x|; the under/overflow bins have
    # zero width at the edges of the exponent range.
    left = np.concatenate([[lo], ints, [hi]]).astype(np.float64)
    width = np.concatenate([[0.0], np.ones(ints.size), [0.0]])
    out = np.full((c.shape[0], qs.size), np.nan)
    for r in range(c.shape[0]):
        row = c[r]
        total = row.sum()
        if total <= 0:
            continue
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

    Arguments:
        df: a tandv log.
        tt: a tensor type or a list of them.
        layer: ``None`` for one panel per tensor type over the whole model (all its
            tensors' histograms added up); or a name, list or regex for one panel per
            (tensor, type).
        percentiles: ascending values in [0, 100]; default :data:`SIGMA_PERCENTILES`.
        inc: use every ``inc``-th logged step.
        col_wrap: panels per row.
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
        groups = [(title, rows.groupby((METADATA, STEP)).sum(numeric_only=True)) for title, rows in groups]
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
            ax.fill_between(steps, p[:, k], p[:, -1 - k], color="tab:blue", alpha=shade * 0.6, linewidth=0,
                            label=f"{qs[k]:g}\u2013{qs[-1 - k]:g}%", gid=f"band:{qs[k]:g}-{qs[-1 - k]:g}")
        if len(qs) % 2:
            ax.plot(steps, p[:, npairs], color="k", linewidth=1.2, label=f"{qs[npairs]:g}%", gid=f"line:{qs[npairs]:g}")
        if np.isfinite(p).any():
            ax.set_yscale("log", base=2)
        else:
            ax.text(0.5, 0.5, "no finite non-zero values logged", transform=ax.transAxes, ha="center", va="center")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("|x| percentiles")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    fig.suptitle("Percentiles of |x| (from exponent counts)")
    return fig
