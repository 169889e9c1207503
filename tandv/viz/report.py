"""A self-contained HTML report of a run: ``tandv report LOG -o report.html``.

One file, figures embedded as PNG data URIs, styles inline, no scripts and no
network access, so it can be mailed, attached to an issue or opened offline.
"""

from __future__ import annotations

import base64
import html
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..analysis import exponent_range, first_nonfinite, format_shares, text_summary
from ..quantities import block_format_names, block_shares, log_update_ratio
from ..schema import (
    METADATA,
    NAME,
    SCALAR_STATS,
    STEP,
    TENSOR_TYPE,
    TENSOR_TYPES,
    run_record,
    validate,
)
from ..schema.io import atomic_write
from ._data import check_log, logged_scalars
from ._facets import plain
from .bands import percentile_bands
from .exp_hist import exp_hist
from .scalar import scalar_global_heatmap

__all__ = ["write_report", "REPORT_FORMATS", "render_report", "overlay_figure"]

#: The low-precision formats whose underflow/overflow shares the report tabulates.
REPORT_FORMATS: tuple[str, ...] = ("float8_e4m3fn", "float8_e5m2", "bfloat16")
#: Heatmaps show at most this many step columns (every k-th step beyond that).
MAX_HEATMAP_STEPS = 120
#: Rows in the "widest or most worrying" table, and histograms drawn per tensor type.
TOP_TENSORS = 10
TOP_HISTOGRAMS = 4
#: Lines drawn in the update-ratio figure and in each Taiyi panel (the largest at the last step).
UPDATE_LINES = 12
TAIYI_LINES = 8
#: The two-run view (``against=``): the relative difference that counts as a divergence,
#: and the layers overlaid per tensor type.
AGAINST_RTOL = 1e-3
AGAINST_LINES = 6
#: Lines per panel of the block formats' figure (the largest at the last step).
BLOCK_LINES = 8

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:2rem auto;max-width:1200px;
padding:0 1rem;color:#1d1d1f;background:#fff}
h1{margin-bottom:.2rem}h2{border-bottom:1px solid #ccc;padding-bottom:.2rem;margin-top:2.2rem}
table{border-collapse:collapse;font-size:.85rem;margin:.6rem 0}
th,td{border:1px solid #d0d0d0;padding:.25rem .5rem;text-align:right}
th{background:#f2f2f2}td:first-child,th:first-child{text-align:left}
img{max-width:100%;height:auto;display:block;margin:.6rem 0}
pre{background:#f7f7f7;padding:.8rem;overflow-x:auto;font-size:.8rem}
.muted{color:#666}.bad{color:#b00020;font-weight:600}nav a{margin-right:1rem}
.banner{padding:.6rem .8rem;border-radius:4px;margin:.8rem 0}
.banner.bad{background:#fdecee;border:1px solid #b00020}
.banner.ok{background:#eef7ee;border:1px solid #2e7d32}
"""


def _png(fig: Figure, dpi: int = 80) -> str:
    """An <img> holding ``fig`` as a base64 PNG data URI."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    alt = html.escape(fig.get_suptitle() or "figure")
    return f'<img alt="{alt}" src="data:image/png;base64,{data}">'


def _table(df: pd.DataFrame) -> str:
    return df.to_html(index=False, escape=True, border=0, na_rep="")


def _pct(x: float) -> str:
    """A share as text; NaN (a log counted in a narrower format cannot tell) is "not known"."""
    if x != x:
        return "not known"
    return "0" if x == 0 else f"{100 * x:.3g}%"


def _overview(df: pd.DataFrame) -> str:
    rows = []
    for tt in TENSOR_TYPES:
        sub = df[df[(METADATA, TENSOR_TYPE)] == tt]
        if sub.empty:
            continue
        steps = sub[(METADATA, STEP)]
        rows.append(
            {
                "tensor type": tt,
                "tensors": sub[(METADATA, NAME)].nunique(),
                "steps logged": steps.nunique(),
                "first step": int(steps.min()),
                "last step": int(steps.max()),
                "dtypes": ", ".join(sorted(pd.unique(sub[(METADATA, "dtype")]))),
            }
        )
    return _made_by(df) + _table(pd.DataFrame(rows))


def _made_by(df: pd.DataFrame) -> str:
    """A line from the log's record of how it was made (nothing for a log without one)."""
    r = run_record(df)
    if not r:
        return ""
    versions = ", ".join(f"{k} {v}" for k, v in (r.get("versions") or {}).items())
    fmt = r.get("number_format") or "each tensor's dtype"
    text = (
        f"Made by the {r.get('framework')} tracker of {r.get('model')}, started {r.get('started')} "
        f"on {r.get('host')}, rank {r.get('rank')} of {r.get('world_size')}; exponents counted as "
        f"{fmt}; {versions}."
    )
    return f'<p class="made-by">{html.escape(text)}</p>'


def _nonfinite(df: pd.DataFrame) -> str:
    first = first_nonfinite(df)
    if first.empty:
        return "<p>No NaN or inf was logged in any tensor.</p>"
    head = (
        f'<p class="bad">{len(first)} tensor(s) held NaN or inf; the first at step '
        f"{int(first['step'].min())}. Each tensor's first such step:</p>"
    )
    return head + _table(
        first.rename(
            columns={
                "name": "tensor",
                "tensor_type": "tensor type",
                "step": "first step",
                "nan_count": "NaN",
                "inf_count": "inf",
            }
        )
    )


def _banner(df: pd.DataFrame) -> str:
    """The report's first line: where NaN/inf first appeared (step and tensor), or that none did."""
    first = first_nonfinite(df)
    if first.empty:
        return '<p class="banner ok">No NaN or inf in any logged tensor.</p>'
    r = first.iloc[0]
    more = len(first) - 1
    text = (
        f"First NaN/inf at step {int(r['step'])} in {r['tensor_type']} {r['name']} "
        f"({int(r['nan_count'])} NaN, {int(r['inf_count'])} inf)"
        + (
            f"; {more} more tensor{'s' if more != 1 else ''} held NaN/inf later or downstream"
            if more
            else ""
        )
        + "."
    )
    return (
        f'<p class="banner bad" role="alert">{html.escape(text)} '
        '<a href="#nonfinite">details</a></p>'
    )


def _scalars(df: pd.DataFrame) -> str | None:
    """Curves of the training scalars logged beside the log (``tracker.log_scalars``), one
    panel per name; ``None`` when the log has none (or was not read from a file)."""
    ts = logged_scalars(df)
    if ts is None:
        return None
    names = [c for c in ts.columns if c != "step"]
    fig = Figure(figsize=(10, 2.4 * ((len(names) + 1) // 2)), layout="constrained")
    axes = np.atleast_1d(
        fig.subplots((len(names) + 1) // 2, min(2, len(names)), squeeze=False).ravel()
    )
    for ax, name in zip(axes, names):
        sel = ts[name].notna()
        ax.plot(ts["step"][sel].to_numpy(), ts[name][sel].to_numpy(dtype=np.float64), lw=1)
        ax.set_title(plain(name), fontsize=9)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    fig.suptitle("training scalars (tracker.log_scalars)")
    last = ts.ffill().iloc[-1]
    text = ", ".join(f"{n} {last[n]:.4g}" for n in names)
    return (
        f"<p>{len(ts)} steps logged, {int(ts['step'].min())}..{int(ts['step'].max())}; "
        f"last values: {html.escape(text)}.</p>" + _png(fig)
    )


def _lines(ax: Any, wide: pd.DataFrame, limit: int) -> str:
    """Draw up to ``limit`` columns of ``wide`` (index: step) as lines on ``ax``, the columns
    with the largest last values first; return a note on what was left out ("" if nothing)."""
    last = wide.ffill().iloc[-1].sort_values(ascending=False, na_position="last")
    shown = list(last.index[:limit])
    for name in shown:
        col = wide[name].dropna()
        ax.plot(col.index.to_numpy(), col.to_numpy(dtype=np.float64), lw=1, label=plain(name))
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("step")
    ax.legend(fontsize=6, ncol=2)
    left = len(wide.columns) - len(shown)
    return f" ({left} more not drawn: the {limit} largest at the last step are)" if left else ""


def _updates(df: pd.DataFrame) -> str | None:
    """The update/weight ratio ``||update|| / ||W||`` per parameter over steps, from the
    ``<param>.update`` rows of ``track(..., track_updates=True)``; ``None`` without them."""
    if not df[(METADATA, NAME)].astype(str).str.endswith(".update").any():
        return None
    try:
        ratio = log_update_ratio(df).dropna(subset=["exact"])
    except ValueError:
        return None
    if ratio.empty:
        return None
    wide = ratio.pivot_table(index="step", columns="name", values="exact")
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax = fig.subplots()
    note = _lines(ax, wide, UPDATE_LINES)
    ax.set_yscale("log")
    ax.set_ylabel("||update|| / ||W||")
    last = wide.ffill().iloc[-1].dropna()
    text = (
        f"Relative size of each parameter's update (after minus before the optimizer step) "
        f"for {len(wide.columns)} parameters{note}. At the last step the median is "
        f"{last.median():.3g}, the range {last.min():.3g} .. {last.max():.3g} (around 1e-3 "
        f"is the usual rule of thumb for Adam-style training)."
    )
    return f"<p>{html.escape(text)}</p>" + _png(fig)


def _taiyi(df: pd.DataFrame) -> str | None:
    """Taiyi's quantities written beside the log (``tandv.taiyi.Monitor``), a panel per
    quantity and a line per module; ``None`` when the log has no such table."""
    from ..schema.scalars import SOURCE_ATTR
    from ..taiyi import read_taiyi

    source = df.attrs.get(SOURCE_ATTR)
    if not source:
        return None
    try:
        table = read_taiyi(source)
    except (OSError, ValueError):
        return None
    if table.empty:
        return None
    quantities = list(dict.fromkeys(table["quantity"]))
    rows = (len(quantities) + 1) // 2
    fig = Figure(figsize=(10, 2.8 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, min(2, len(quantities)), squeeze=False).ravel())
    notes = []
    for ax, q in zip(axes, quantities):
        wide = table[table["quantity"] == q].pivot_table(
            index="step", columns="module", values="value"
        )
        notes.append(_lines(ax, wide, TAIYI_LINES))
        ax.set_title(q, fontsize=9)
    for ax in axes[len(quantities) :]:
        ax.set_visible(False)
    fig.suptitle("Taiyi quantities (tandv.taiyi.Monitor)")
    text = (
        f"{len(quantities)} quantities of {table['module'].nunique()} modules at "
        f"{table['step'].nunique()} steps; each is defined in tandv.taiyi.describe_quantities()"
        + ("; some panels draw only the modules largest at the last step" if any(notes) else "")
        + "."
    )
    return f"<p>{html.escape(text)}</p>" + _png(fig)


def _shares(df: pd.DataFrame, formats: Sequence[str]) -> str:
    """Per tensor type the share of all logged values (every tensor, every step) that
    would underflow / overflow each format, then the worst tensors per format."""
    numel = (
        df[(SCALAR_STATS, "numel")].to_numpy(dtype=np.float64)
        if (SCALAR_STATS, "numel") in df.columns
        else np.ones(len(df))
    )
    tts = df[(METADATA, TENSOR_TYPE)].to_numpy()
    summary, worst = [], []
    for fmt in formats:
        sh = format_shares(df, fmt)
        entry = {"format": fmt}
        for tt in TENSOR_TYPES:
            m = tts == tt
            if not m.any():
                continue
            total = numel[m].sum()
            u = float((sh["underflow"].to_numpy()[m] * numel[m]).sum() / total) if total else 0.0
            o = float((sh["overflow"].to_numpy()[m] * numel[m]).sum() / total) if total else 0.0
            entry[f"{tt} underflow"] = _pct(u)
            entry[f"{tt} overflow"] = _pct(o)
        summary.append(entry)
        sh = sh.assign(lost=sh["underflow"] + sh["overflow"])
        top = sh[sh["lost"] > 0].sort_values("lost", ascending=False, kind="stable")
        top = top.drop_duplicates(["name", "tensor_type"]).head(5)
        for _, r in top.iterrows():
            worst.append(
                {
                    "format": fmt,
                    "tensor": r["name"],
                    "tensor type": r["tensor_type"],
                    "worst step": int(r["step"]),
                    "underflow": _pct(r["underflow"]),
                    "overflow": _pct(r["overflow"]),
                }
            )
    out = (
        "<p>Share of logged values (all tensors, all steps, weighted by size) that would "
        "underflow to zero or overflow if cast to each format without scaling, estimated from "
        "the exponent counts (overflow is a lower bound: values between a format's max and the "
        "next power of two count as representable).</p>"
    )
    out += _table(pd.DataFrame(summary))
    if worst:
        out += "<h3>Tensors losing the most values, per format (at their worst step)</h3>" + _table(
            pd.DataFrame(worst)
        )
    else:
        out += "<p>No logged value would underflow or overflow any of these formats.</p>"
    return out


def _block_formats(df: pd.DataFrame) -> str | None:
    """What the block-scaled formats of ``track(block_formats=...)`` would do, per tensor and
    step: underflow and saturation shares and the relative error power, a row of panels
    per format; ``None`` when the log has none of their columns."""
    formats = block_format_names(df)
    if not formats:
        return None
    sh = block_shares(df, formats)
    sh["tensor"] = sh["name"].astype(str) + " (" + sh["tensor_type"].astype(str) + ")"
    panels = [
        ("underflow", "underflow share"),
        ("saturated", "saturated share"),
        ("rel_err", "relative error power"),
    ]
    fig = Figure(figsize=(12, 2.8 * len(formats)), layout="constrained")
    axes = fig.subplots(len(formats), len(panels), squeeze=False)
    summary = []
    for row, f in zip(axes, formats):
        one = sh[sh["format"] == f]
        for ax, (col, label) in zip(row, panels):
            _lines(ax, one.pivot_table(index="step", columns="tensor", values=col), BLOCK_LINES)
            ax.set_title(f"{f}: {label}", fontsize=9)
            if col == "rel_err" and (one[col] > 0).any():
                ax.set_yscale("log")
        last = one[one["step"] == one["step"].max()]
        worst = last.sort_values("rel_err", ascending=False, na_position="last").iloc[0]
        summary.append(
            {
                "format": f,
                "underflow (last step, max)": _pct(float(last["underflow"].max())),
                "saturated (last step, max)": _pct(float(last["saturated"].max())),
                "median relative error (last step)": f"{last['rel_err'].median():.3g}",
                "worst tensor": f"{worst['tensor']}: {worst['rel_err']:.3g}",
            }
        )
    text = (
        "What quantizing each tensor into each block-scaled format would do (blocks along "
        "the last dimension; definitions in tandv.stats.blocks): the share of its elements "
        "that would underflow to zero or saturate, and the relative error power "
        "sq_err / (rm2^2 * n); each panel draws the tensors largest at the last step."
    )
    return f"<p>{html.escape(text)}</p>" + _table(pd.DataFrame(summary)) + _png(fig)


def _ranges(df: pd.DataFrame) -> tuple[str, list[str]]:
    """The tensors with the widest exponent ranges, or holding NaN/inf, and histograms of
    the top ones per tensor type at the step where their range is widest."""
    rg = exponent_range(df)
    rg["nonfinite"] = (
        (df[(SCALAR_STATS, "nan_count")] + df[(SCALAR_STATS, "inf_count")]).to_numpy()
        if {(SCALAR_STATS, "nan_count"), (SCALAR_STATS, "inf_count")} <= set(df.columns)
        else 0
    )
    e4m3 = format_shares(df, REPORT_FORMATS[0])
    rg["lost"] = (e4m3["underflow"] + e4m3["overflow"]).to_numpy()
    per_tensor = (
        rg.sort_values(["width", "step"], ascending=[False, True], kind="stable")
        .groupby(["name", "tensor_type"], sort=False)
        .agg(
            width=("width", "first"),
            step=("step", "first"),
            lo=("min_exponent", "first"),
            hi=("max_exponent", "first"),
            nonfinite=("nonfinite", "sum"),
            lost=("lost", "max"),
        )
        .reset_index()
    )
    # Worrying first (NaN/inf, then values lost in float8_e4m3fn), then the widest ranges.
    per_tensor = per_tensor.sort_values(
        ["nonfinite", "lost", "width"], ascending=False, kind="stable"
    )
    top = per_tensor.head(TOP_TENSORS)
    table = pd.DataFrame(
        {
            "tensor": top["name"],
            "tensor type": top["tensor_type"],
            "widest at step": top["step"].astype(int),
            "exponent range": [
                f"2^{lo} .. 2^{hi}" if pd.notna(lo) else "" for lo, hi in zip(top["lo"], top["hi"])
            ],
            "binades": top["width"].astype(int),
            f"max {REPORT_FORMATS[0]} loss": [_pct(x) for x in top["lost"]],
            "NaN+inf (all steps)": top["nonfinite"].astype(int),
        }
    )
    figs = []
    for tt in TENSOR_TYPES:
        cand = per_tensor[per_tensor["tensor_type"] == tt].head(TOP_HISTOGRAMS)
        if cand.empty:
            continue
        # One figure per tensor type at the step where its top tensor is widest.
        step = int(cand["step"].iloc[0])
        names = [
            n
            for n, s in zip(cand["name"], cand["step"])
            if (
                (df[(METADATA, NAME)] == n)
                & (df[(METADATA, TENSOR_TYPE)] == tt)
                & (df[(METADATA, STEP)] == step)
            ).any()
        ]
        fig = exp_hist(
            df, names, tt, step, dtype_annotation=REPORT_FORMATS[0], col_wrap=min(len(names), 4)
        )
        fig.suptitle(f"{tt}: exponent histograms at step {step} (markers: {REPORT_FORMATS[0]})")
        figs.append(_png(fig))
    return _table(table), figs


def overlay_figure(table: pd.DataFrame, stat: str, layers: Mapping[str, Sequence[str]]) -> Figure:
    """Both runs of a :func:`tandv.compare` table overlaid: one panel per tensor type of
    ``layers`` (``{tensor_type: names}``), a color per layer, run A solid and run B dashed
    over steps; a dotted red line marks the first step where a drawn layer differs by more
    than ``AGAINST_RTOL``. The y axis is logarithmic where every value drawn is positive."""
    kinds = list(layers)
    cols = min(len(kinds), 2)
    rows = (len(kinds) + cols - 1) // cols
    height = 3.2 * rows
    fig = Figure(figsize=(10, height))
    # margins in inches (constrained layout costs seconds per figure)
    fig.subplots_adjust(
        left=0.07, right=0.98, top=1 - 0.6 / height, bottom=0.5 / height, hspace=0.45
    )
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False).ravel())
    for ax, tt in zip(axes, kinds):
        sub = table[table["tensor_type"] == tt]
        drawn = []
        for i, name in enumerate(layers[tt]):
            t = sub[sub["name"] == name].sort_values("step", kind="stable")
            for run, style in (("a", "-"), ("b", "--")):
                v = t[f"{stat}_{run}"]
                ok = v.notna().to_numpy()
                ax.plot(
                    t["step"].to_numpy()[ok],
                    v.to_numpy(dtype=np.float64)[ok],
                    style,
                    color=f"C{i % 10}",
                    lw=1.2,
                    label=f"{name} ({run.upper()})",
                )
                drawn.append(v.to_numpy(dtype=np.float64)[ok])
        values = np.concatenate(drawn) if drawn else np.zeros(0)
        if values.size and (values > 0).all():
            ax.set_yscale("log")
        apart = sub[sub["name"].isin(list(layers[tt])) & (sub[f"{stat}_rel"] > AGAINST_RTOL)]
        if len(apart):
            ax.axvline(int(apart["step"].min()), color="#b00020", ls=":", lw=1)
        ax.set_title(f"{tt}: {stat}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    for ax in axes[len(kinds) :]:
        ax.set_visible(False)
    fig.suptitle("run A (solid) and run B (dashed), per layer")
    return fig


def _against(df: pd.DataFrame, other: pd.DataFrame, other_title: str) -> str:
    """The two-run view: where the runs first diverge, what only one logged, the tensors that
    differ most, and each layer's statistic in both runs, overlaid."""
    from ..compare import compare, divergence_in, most_different

    stats = [
        s for s in ("rm2", "max_abs") if {(SCALAR_STATS, s)} <= set(df.columns) & set(other.columns)
    ]
    if not stats:
        return "<p>The two logs share neither rm2 nor max_abs: nothing to compare.</p>"
    table = compare(df, other, stats)
    first = divergence_in(table, AGAINST_RTOL)
    esc = html.escape
    intro = f"<p>Run A is this log, run B is {esc(other_title)}.</p>"
    if not (table["present"] == "both").any():
        head = '<p class="banner bad">The runs share no (tensor, step): nothing to compare.</p>'
    elif first is None:
        head = (
            f'<p class="banner ok">The runs agree: every tensor both logged is within a relative '
            f"difference of {AGAINST_RTOL:g} in {', '.join(stats)}.</p>"
        )
    else:
        values = "; ".join(f"{s} {first[f'{s}_a']:.6g} vs {first[f'{s}_b']:.6g}" for s in stats)
        head = (
            f'<p class="banner bad">First divergence at step {int(first["step"])} in '
            f"{esc(str(first['tensor_type']))} {esc(str(first['name']))} ({esc(values)}; "
            f"relative difference above {AGAINST_RTOL:g}).</p>"
        )
    only = []
    for which, run in (("a only", "A"), ("b only", "B")):
        n = int((table["present"] == which).sum())
        if n:
            only.append(f"{n} rows only in run {run}")
    extra = f"<p>Not compared: {', '.join(only)}.</p>" if only else ""
    top = most_different(table, TOP_TENSORS)
    top_html = (
        "<h3>Tensors that differ most (largest relative difference over steps)</h3>"
        + _table(top.rename(columns={"name": "tensor", "tensor_type": "tensor type"}))
        if len(top)
        else ""
    )
    stat = stats[0]
    shared = table[table["present"] == "both"]
    layers, notes = {}, []
    for tt in TENSOR_TYPES:
        sub = shared[shared["tensor_type"] == tt]
        if sub.empty:
            continue
        worst = sub.groupby("name", sort=False)[f"{stat}_rel"].max()
        layers[tt] = list(worst.sort_values(ascending=False, kind="stable").index[:AGAINST_LINES])
        if len(worst) > len(layers[tt]):
            notes.append(f"{tt}: {len(layers[tt])} of {len(worst)}")
    figs = _png(overlay_figure(table, stat, layers)) if layers else ""
    if notes:
        drawn = esc("; ".join(notes))
        figs += f'<p class="muted">Layers drawn, those that differ most first: {drawn}.</p>'
    return intro + head + extra + top_html + figs


def render_report(
    df: pd.DataFrame,
    title: str,
    against: pd.DataFrame | None = None,
    against_title: str = "run B",
) -> str:
    """The report of log ``df`` as one HTML string (see :func:`write_report`)."""
    check_log(df)
    if against is not None:
        validate(against)  # rows are not needed: an empty B has nothing in common with A
    tts = [t for t in TENSOR_TYPES if (df[(METADATA, TENSOR_TYPE)] == t).any()]
    metric = (
        "rm2"
        if (SCALAR_STATS, "rm2") in df.columns
        else next(c for g, c in df.columns if g == SCALAR_STATS)
    )
    heatmaps = []
    for tt in tts:
        nsteps = df.loc[df[(METADATA, TENSOR_TYPE)] == tt, (METADATA, STEP)].nunique()
        inc = max(1, int(np.ceil(nsteps / MAX_HEATMAP_STEPS)))
        fig = scalar_global_heatmap(df, tt, metric, inc=inc)
        heatmaps.append(f"<h3>{html.escape(tt)}</h3>" + _png(fig))
    range_table, hists = _ranges(df)
    bands = _png(percentile_bands(df, tts, col_wrap=2), dpi=80)
    esc = html.escape
    scalars = _scalars(df)
    updates = _updates(df)
    taiyi = _taiyi(df)
    blocks = _block_formats(df)
    sections = [
        ("overview", "Overview", _overview(df) + f"<pre>{esc(text_summary(df))}</pre>"),
        *(
            [("against", f"Against {against_title}", _against(df, against, against_title))]
            if against is not None
            else []
        ),
        *([("scalars", "Training scalars", scalars)] if scalars is not None else []),
        ("nonfinite", "Where NaN/inf first appeared", _nonfinite(df)),
        *([("updates", "Update/weight ratio", updates)] if updates is not None else []),
        *([("taiyi", "Taiyi quantities", taiyi)] if taiyi is not None else []),
        ("formats", "Underflow and overflow in low-precision formats", _shares(df, REPORT_FORMATS)),
        *([("blocks", "Block formats", blocks)] if blocks is not None else []),
        ("ranges", "Widest or most worrying exponent ranges", range_table + "".join(hists)),
        ("heatmaps", f"{metric} per layer and step", "".join(heatmaps)),
        ("bands", "Percentiles of |x| over training (whole model)", bands),
    ]
    nav = " ".join(f'<a href="#{sid}">{esc(name)}</a>' for sid, name, _ in sections)
    body = "\n".join(
        f'<section id="{sid}"><h2>{esc(name)}</h2>\n{content}</section>'
        for sid, name, content in sections
    )
    steps = df[(METADATA, STEP)]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>\n"
        f'<h1>{esc(title)}</h1><p class="muted">tandv report: {len(df)} rows, '
        f"steps {int(steps.min())}"
        f"..{int(steps.max())}, {df[(METADATA, NAME)].nunique()} tensors</p>\n"
        f"{_banner(df)}\n<nav>{nav}</nav>\n{body}\n"
        "</body></html>\n"
    )


def write_report(
    df: pd.DataFrame,
    path: str | os.PathLike,
    title: str = "tandv report",
    against: pd.DataFrame | None = None,
    against_title: str = "run B",
) -> Path:
    """Write a self-contained HTML report of the log ``df`` to ``path`` and return the path.

    The report leads with where NaN/inf first appeared (step and tensor: see
    :func:`tandv.first_nonfinite`), or says that none did. Sections: an overview and text
    summary; the training scalars logged beside the log (``tracker.log_scalars``), when
    there are any; each tensor's first NaN/inf; the share of
    values that would underflow/overflow float8_e4m3fn, float8_e5m2 and bfloat16; what the
    block-scaled formats of ``track(block_formats=...)`` would do, when logged; the
    tensors with the widest or most worrying exponent ranges, with their histograms;
    a heatmap of ``rm2`` per tensor type; percentile bands for the whole model.

    With ``against`` (a second log, named ``against_title``), a section after the overview
    sets the two runs side by side (:func:`tandv.compare`): their first divergence
    (relative difference above ``AGAINST_RTOL`` in ``rm2`` or ``max_abs``), the rows only one
    run logged, the tensors that differ most, and per tensor type each layer's ``rm2`` in
    both runs overlaid (the ``AGAINST_LINES`` layers that differ most).

    Raises:
        tandv.SchemaError: if ``df`` (or ``against``) is not a valid log.
        VizArgumentError: if the log has no rows.
    """
    text = render_report(df, title, against, against_title)
    out = atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return out
