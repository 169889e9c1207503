"""Framework-free questions asked of a log: ranges, low-precision shares, first NaN/inf.

These read only the validated log (pandas), so they serve the CLI summary, the HTML
report and users' notebooks alike.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pandas as pd

from .schema.columns import (
    EXPONENT_COUNTS,
    METADATA,
    OVERFLOW,
    SCALAR_STATS,
    TENSOR_TYPES,
    UNDERFLOW,
)
from .schema.validate import is_exponent_label
from .stats.formats import number_format

__all__ = ["exponent_range", "format_shares", "first_nonfinite", "text_summary"]

_KEY = ["name", "tensor_type", "step"]


def _meta(df: pd.DataFrame, cols: Sequence[str] = _KEY) -> pd.DataFrame:
    out = pd.DataFrame({c: df[(METADATA, c)].to_numpy() for c in cols})
    out.index = df.index
    return out


def _exponents(df: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """The integer exponent labels of ``df`` (ascending) and their count matrix."""
    labels = sorted(int(c) for t, c in df.columns if t == EXPONENT_COUNTS and is_exponent_label(c))
    counts = df[[(EXPONENT_COUNTS, c) for c in labels]].to_numpy(dtype=np.int64) if labels else (
        np.zeros((len(df), 0), np.int64))
    return np.asarray(labels, dtype=np.int64), counts


def exponent_range(df: pd.DataFrame) -> pd.DataFrame:
    """Per row, the smallest and largest exponent n with a non-zero count and the number
    of binades between them (``width = max - min + 1``); NaN/0 for a row with no counts."""
    labels, counts = _exponents(df)
    out = _meta(df)
    nz = counts > 0
    has = nz.any(axis=1)
    lo = np.where(has, labels[nz.argmax(axis=1)] if labels.size else 0, 0)
    hi = np.where(has, labels[labels.size - 1 - nz[:, ::-1].argmax(axis=1)] if labels.size else 0, 0)
    out["min_exponent"] = pd.Series(lo, index=df.index, dtype="Int64").mask(~has)
    out["max_exponent"] = pd.Series(hi, index=df.index, dtype="Int64").mask(~has)
    out["width"] = np.where(has, hi - lo + 1, 0)
    return out


def format_shares(df: pd.DataFrame, fmt: Any) -> pd.DataFrame:
    """Per row, the share of the tensor's elements that would underflow or overflow ``fmt``.

    Estimated from the exponent counts: values in binades below the format's smallest
    subnormal underflow, values in binades above its largest finite value's binade
    overflow, and the log's own ``-inf``/``+inf`` counts are carried over as underflow and
    overflow. Values in the top binade of ``fmt`` count as representable, so the overflow
    share is a lower bound: it misses values between ``fmt``'s max and the next power of
    two (448 to 512 for float8_e4m3fn). Shares are fractions of
    ``numel`` (zeros and NaN are never underflow/overflow); rows with ``numel == 0`` get 0.
    """
    f = number_format(fmt)
    labels, counts = _exponents(df)
    under = counts[:, labels < f.min_exponent].sum(axis=1) + df[(EXPONENT_COUNTS, UNDERFLOW)].to_numpy()
    over = counts[:, labels > f.max_exponent].sum(axis=1) + df[(EXPONENT_COUNTS, OVERFLOW)].to_numpy()
    if (SCALAR_STATS, "numel") in df.columns:
        total = df[(SCALAR_STATS, "numel")].to_numpy(dtype=np.float64)
    else:  # custom logs without numel: shares of the counted (non-zero, non-NaN) values
        total = (counts.sum(axis=1) + df[(EXPONENT_COUNTS, UNDERFLOW)].to_numpy()
                 + df[(EXPONENT_COUNTS, OVERFLOW)].to_numpy()).astype(np.float64)
    safe = np.where(total > 0, total, 1.0)
    out = _meta(df)
    out["underflow"] = np.where(total > 0, under / safe, 0.0)
    out["overflow"] = np.where(total > 0, over / safe, 0.0)
    return out


def first_nonfinite(df: pd.DataFrame) -> pd.DataFrame:
    """Per tensor (name, tensor_type) that ever held NaN or inf: the first such step and
    its counts, ordered by step. Empty if the log never saw one, or if it lacks the
    ``nan_count``/``inf_count`` statistics."""
    cols = ["name", "tensor_type", "step", "nan_count", "inf_count"]
    if not {(SCALAR_STATS, "nan_count"), (SCALAR_STATS, "inf_count")} <= set(df.columns):
        return pd.DataFrame(columns=cols)
    m = _meta(df)
    m["nan_count"] = df[(SCALAR_STATS, "nan_count")].to_numpy()
    m["inf_count"] = df[(SCALAR_STATS, "inf_count")].to_numpy()
    bad = m[(m["nan_count"] > 0) | (m["inf_count"] > 0)]
    if bad.empty:
        return pd.DataFrame(columns=cols)
    first = bad.sort_values("step", kind="stable").groupby(["name", "tensor_type"], sort=False).head(1)
    return first[cols].reset_index(drop=True)


def _fmt_num(x: float) -> str:
    return "nan" if not np.isfinite(x) else f"{x:.3g}"


def text_summary(df: pd.DataFrame, formats: Sequence[str] = ("float8_e4m3fn", "bfloat16"),
                 top: int = 3) -> str:
    """A readable summary of a log, per tensor type: steps and tensors, the first and
    worst NaN/inf, the widest exponent range, the tensors with the largest and smallest
    ``rm2`` at the last step, and the share of values that would underflow/overflow each
    of ``formats``."""
    if df.empty:
        return "empty log: no rows (the run recorded no step)"
    lines: list[str] = []
    steps = df[(METADATA, "step")]
    lines.append(f"{len(df)} rows, steps {steps.min()}..{steps.max()} "
                 f"({steps.nunique()} recorded), {df[(METADATA, 'name')].nunique()} tensor names")
    ranges = exponent_range(df)
    shares = {f: format_shares(df, f) for f in formats}
    firsts = first_nonfinite(df)
    has_rm2 = (SCALAR_STATS, "rm2") in df.columns
    for tt in TENSOR_TYPES:
        mask = (df[(METADATA, "tensor_type")] == tt).to_numpy()
        if not mask.any():
            continue
        sub = df[mask]
        st = sub[(METADATA, "step")]
        lines.append("")
        lines.append(f"{tt}: {sub[(METADATA, 'name')].nunique()} tensors, steps {st.min()}..{st.max()}")
        f_tt = firsts[firsts["tensor_type"] == tt]
        if f_tt.empty:
            lines.append("  NaN/inf: none")
        else:
            r = f_tt.iloc[0]
            nonfin = sub[(SCALAR_STATS, "nan_count")] + sub[(SCALAR_STATS, "inf_count")]
            w = sub.loc[nonfin.idxmax()]
            lines.append(
                f"  NaN/inf: first in {r['name']} at step {r['step']} ({r['nan_count']} NaN, "
                f"{r['inf_count']} inf); {len(f_tt)} tensor{'s' if len(f_tt) != 1 else ''} affected; worst {w[(METADATA, 'name')]} "
                f"at step {w[(METADATA, 'step')]} ({int(nonfin.max())} of {int(w[(SCALAR_STATS, 'numel')])})")
        rg = ranges[mask]
        if rg["width"].max() > 0:
            r = rg.loc[rg["width"].idxmax()]
            lines.append(f"  widest exponent range: {r['name']} at step {r['step']}: "
                         f"2^{r['min_exponent']} .. 2^{r['max_exponent']} ({r['width']} binades)")
        if has_rm2:
            last = sub[st == st.max()]
            rm2 = last[(SCALAR_STATS, "rm2")].astype(float)
            names = last[(METADATA, "name")]
            order = rm2.sort_values(ascending=False, na_position="last")
            big = ", ".join(f"{names[i]} {_fmt_num(rm2[i])}" for i in order.index[:top])
            small = ", ".join(f"{names[i]} {_fmt_num(rm2[i])}" for i in order.dropna().index[::-1][:top])
            lines.append(f"  largest rm2 at step {st.max()}: {big}")
            lines.append(f"  smallest rm2 at step {st.max()}: {small}")
        if (SCALAR_STATS, "numel") in sub.columns:
            numel = sub[(SCALAR_STATS, "numel")].to_numpy(dtype=np.float64)
            total = numel.sum()
            parts = []
            for f, sh in shares.items():
                s = sh[mask]
                u = (s["underflow"].to_numpy() * numel).sum() / total if total else 0.0
                o = (s["overflow"].to_numpy() * numel).sum() / total if total else 0.0
                parts.append(f"{f}: {u:.2%} underflow, {o:.2%} overflow")
            lines.append("  as " + "; ".join(parts))
    return "\n".join(lines)
