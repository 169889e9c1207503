"""The exponent histogram of one or more tensors at one step."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ..schema import DTYPE, METADATA, NAME, OVERFLOW, STEP, TENSOR_TYPE, UNDERFLOW, run_record
from ..stats import NumberFormat, number_format
from ._data import (
    VizArgumentError,
    check_log,
    check_step,
    exponent_table,
    rows_for,
    select_layers,
    select_tensor_types,
)
from ._facets import facet_grid, figure_legend, plain

__all__ = ["exp_hist", "format_markers", "MAX_VIEW_SPAN"]

#: The x axis is widened to take in a format's markers only while it stays at most this
#: many exponents wide; markers further out are drawn as arrows at the edge instead.
MAX_VIEW_SPAN = 48
#: Most exponent tick labels on one axis (more are thinned to every k-th).
_MAX_TICKS = 10
_KINDS = ("max", "smallest normal", "smallest subnormal")


@dataclass(frozen=True)
class Marker:
    """A format boundary drawn on the histogram: which, at what exponent, and its value."""

    kind: str  # "max", "smallest normal", "smallest subnormal"
    exponent: int
    value: float


def format_markers(fmt: Any) -> list[Marker]:
    """The three boundaries of a format at their exponents (bins ``2**n <= |x| < 2**(n+1)``):
    its largest finite value, smallest normal and smallest subnormal."""
    f: NumberFormat = number_format(fmt)
    return [
        Marker("max", f.max_exponent, f.max),
        Marker("smallest normal", int(np.frexp(f.smallest_normal)[1]) - 1, f.smallest_normal),
        Marker("smallest subnormal", f.min_exponent, f.smallest_subnormal),
    ]


def _pow2(n: int) -> str:
    return f"$2^{{{n}}}$"


def _view_range(counts: pd.DataFrame, markers: Sequence[Marker]) -> tuple[int, int]:
    """The exponents shown: from the lowest to the highest exponent with a non-zero count
    in any panel (empty columns at either end trimmed), widened to take in the markers
    while that keeps the axis at most :data:`MAX_VIEW_SPAN` exponents wide."""
    ints = [c for c in counts.columns if c not in (UNDERFLOW, OVERFLOW)]
    used = [c for c in ints if counts[c].any()] or [0]
    lo, hi = min(used), max(used)
    for m in sorted(markers, key=lambda m: abs(m.exponent - (lo + hi) / 2)):
        nlo, nhi = min(lo, m.exponent), max(hi, m.exponent)
        if nhi - nlo + 1 <= MAX_VIEW_SPAN:
            lo, hi = nlo, nhi
    return lo, hi


def _annotation_format(value: Any, row_dtype: str) -> str | None:
    if value is None or value is False:
        return None
    if value is True:
        return row_dtype
    try:
        return number_format(value).name
    except ValueError as e:
        raise VizArgumentError(f"dtype_annotation={value!r}: {e}") from None


def _draw_panel(
    ax: Axes,
    counts: pd.Series,
    lo: int,
    hi: int,
    kind: str,
    fmt_name: str | None,
    color: Any,
) -> None:
    exps = np.arange(lo, hi + 1)
    values = np.array([int(counts.get(int(e), 0)) for e in exps], dtype=np.int64)
    if kind == "bar":
        ax.bar(exps, values, width=0.85, color=color, label="exponent counts")
    else:
        ax.plot(exps, values, marker="o", markersize=3, color=color, label="exponent counts")
    # Underflow and overflow sit one gap beyond the exponent range, hatched, always drawn.
    ax.bar(
        [lo - 2], [int(counts[UNDERFLOW])], width=0.85, color="0.6", hatch="//", label="underflow"
    )
    ax.bar(
        [hi + 2],
        [int(counts[OVERFLOW])],
        width=0.85,
        color="tab:red",
        hatch="\\\\",
        label="overflow",
    )
    stride = max(1, int(np.ceil(len(exps) / _MAX_TICKS)))
    # Ticks at multiples of the stride, keeping clear of the "under"/"over" labels.
    ticks = [
        int(e)
        for e in exps
        if e % stride == 0 and min(e - (lo - 2), hi + 2 - e) >= max(2, 0.8 * stride)
    ]
    positions: list[int] = [lo - 2, *ticks, hi + 2]
    ax.set_xticks(positions, ["under", *[_pow2(e) for e in ticks], "over"])
    ax.tick_params(axis="x", labelrotation=45, labelsize=8)
    ax.set_xlim(lo - 2.6, hi + 2.6)
    ax.set_xlabel("|x| (exponent bin)")
    ax.set_ylabel("count")
    if fmt_name is None:
        return
    styles = {
        "max": ("tab:red", "-"),
        "smallest normal": ("tab:green", "--"),
        "smallest subnormal": ("tab:purple", ":"),
    }
    for m in format_markers(fmt_name):
        col, ls = styles[m.kind]
        label = f"{fmt_name} {m.kind} ({_pow2(m.exponent)})"
        if lo <= m.exponent <= hi:
            ax.axvline(
                m.exponent,
                color=col,
                linestyle=ls,
                linewidth=1.5,
                label=label,
                gid=f"marker:{m.kind}",
            )
        else:
            # Off the axis: a note at the edge that says where the boundary is.
            right = m.exponent > hi
            text = f"{fmt_name} {m.kind} {_pow2(m.exponent)}"
            ax.annotate(
                f"{text} \u2192" if right else f"\u2190 {text}",
                xy=(0.99 if right else 0.01, 0.92 - 0.08 * _KINDS.index(m.kind)),
                xycoords="axes fraction",
                ha="right" if right else "left",
                fontsize=7,
                color=col,
                gid=f"marker:{m.kind}",
            )


def exp_hist(
    df: pd.DataFrame,
    layer: str | re.Pattern[str] | Sequence[str],
    tt: str | Sequence[str],
    step: int,
    kind: Literal["bar", "line"] = "bar",
    dtype_annotation: bool | str | Any = True,
    col_wrap: int | None = None,
    figsize: tuple[float, float] | None = None,
) -> Figure:
    """Exponent histogram of each selected tensor at ``step``: how many of its finite
    non-zero values fall in each power-of-two bin ``2**n <= |x| < 2**(n+1)``.

    Seeing where the bulk of a tensor sits against a number format's range is how
    one judges whether it survives a cast (to bfloat16, float8 ...) without scaling.

    Arguments:
        df: a tandv log.
        layer: a tensor name, a list of names, or a regular expression (see
            :func:`tandv.viz.select_layers`).
        tt: a tensor type (``"Activation"``, ``"Gradient"``, ``"Weight"``,
            ``"Optimiser_State"``) or a list of them; one panel per (tensor, type) logged.
        step: the training step.
        kind: ``"bar"`` or ``"line"``.
        dtype_annotation: vertical markers at a format's largest value, smallest normal
            and smallest subnormal: ``True`` for the format the counts were taken in (the
            log's recorded ``number_format``, else each tensor's logged dtype), a format
            name (``"float8_e4m3fn"``) or dtype for that format, ``False``/``None`` for none.
            Markers beyond the shown range are drawn as arrows at the panel's edge.
        col_wrap: panels per row (default: at most four).
        figsize: figure size in inches (default: from the number of panels).

    The x axis spans the exponents with non-zero counts (empty columns at both ends
    are trimmed), with the underflow (``-inf``) and overflow (``+inf``) counts drawn as
    separate hatched bars at either end.

    Raises:
        tandv.SchemaError: if ``df`` is not a valid log.
        VizArgumentError: for an unknown layer, tensor type or step, or a bad ``kind``.
    """
    check_log(df)
    if kind not in ("bar", "line"):
        raise VizArgumentError(f"kind={kind!r}: expected 'bar' or 'line'")
    tts = select_tensor_types(df, tt)
    names = select_layers(df, layer, tts)
    sel = rows_for(df, names, tts)
    step = check_step(sel, step, f"layer={layer!r}, tt={tt!r}")
    at = sel[sel[(METADATA, STEP)] == step]
    # Panels in log order of tensors, then tensor type order as requested.
    order = {(n, t): (i, j) for i, n in enumerate(names) for j, t in enumerate(tts)}
    keys = sorted(
        zip(at[(METADATA, NAME)], at[(METADATA, TENSOR_TYPE)], at.index), key=lambda k: order[k[:2]]
    )
    counts = exponent_table(at)
    # the counts' own format: the one the tracker counted in (the log's record), else the dtype
    recorded = run_record(df).get("number_format")
    fmts = {
        idx: _annotation_format(dtype_annotation, recorded or at.at[idx, (METADATA, DTYPE)])
        for _, _, idx in keys
    }
    markers = [m for f in set(fmts.values()) if f for m in format_markers(f)]
    lo, hi = _view_range(counts, markers)
    fig, axes = facet_grid(len(keys), col_wrap, figsize=figsize)
    colors = {
        t: c
        for t, c in zip(
            ("Activation", "Gradient", "Weight", "Optimiser_State"),
            ("tab:blue", "tab:orange", "tab:green", "tab:brown"),
        )
    }
    for ax, (name, t, idx) in zip(axes, keys):
        _draw_panel(ax, counts.loc[idx], lo, hi, kind, fmts[idx], colors[t])
        ax.set_title(plain(f"{name} ({t})"), fontsize=9)
    figure_legend(fig, axes)
    fig.suptitle(f"Exponent histogram at step {step}")
    return fig
