"""Framework-free questions asked of a log: ranges, low-precision shares, first NaN/inf.

These read only the validated log (pandas), so they serve the CLI summary, the HTML
report and users' notebooks alike. The text summary is a tally that takes a log in
chunks (:func:`summarize_log` streams a parquet log through it), so summarizing a long
run needs memory for one chunk, not for the whole log.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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
from .schema.io import CHUNK_ROWS, ParquetLog, read_log, read_parquet_chunks, run_record
from .schema.validate import is_exponent_label
from .stats.formats import number_format
from .stats.summary import (
    DEFAULT_STATS,
    HIGHER_STATS,
    INVERTIBLE_STATS,
    finalize_many,
    merge_groups,
    unfinalize_many,
)

__all__ = [
    "exponent_range",
    "format_shares",
    "first_nonfinite",
    "computation_order",
    "computation_phase",
    "STEP_PHASES",
    "text_summary",
    "summarize_log",
    "sparsity",
    "aggregate",
    "merge_percentiles",
]

_KEY = ["name", "tensor_type", "step"]


def _meta(df: pd.DataFrame, cols: Sequence[str] = _KEY) -> pd.DataFrame:
    out = pd.DataFrame({c: df[(METADATA, c)].to_numpy() for c in cols})
    out.index = df.index
    return out


def _exponents(df: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """The integer exponent labels of ``df`` (ascending) and their count matrix."""
    labels = sorted(int(c) for t, c in df.columns if t == EXPONENT_COUNTS and is_exponent_label(c))
    counts = (
        df[[(EXPONENT_COUNTS, c) for c in labels]].to_numpy(dtype=np.int64)
        if labels
        else (np.zeros((len(df), 0), np.int64))
    )
    return np.asarray(labels, dtype=np.int64), counts


def exponent_range(df: pd.DataFrame) -> pd.DataFrame:
    """Per row, the smallest and largest exponent n with a non-zero count and the number
    of binades between them (``width = max - min + 1``); NaN/0 for a row with no counts."""
    labels, counts = _exponents(df)
    out = _meta(df)
    nz = counts > 0
    has = nz.any(axis=1)
    lo = np.where(has, labels[nz.argmax(axis=1)] if labels.size else 0, 0)
    hi = np.where(
        has, labels[labels.size - 1 - nz[:, ::-1].argmax(axis=1)] if labels.size else 0, 0
    )
    out["min_exponent"] = pd.Series(lo, index=df.index, dtype="Int64").mask(~has)
    out["max_exponent"] = pd.Series(hi, index=df.index, dtype="Int64").mask(~has)
    out["width"] = np.where(has, hi - lo + 1, 0)
    return out


def _knowable(df: pd.DataFrame, fmt: Any) -> tuple[bool, bool]:
    """Whether the log can tell which values underflow and which overflow ``fmt``.

    A log whose exponent counts were taken in one number format (``track(...,
    number_format=...)``, kept in its record of how it was made) holds in ``-inf`` the
    values below that format's smallest subnormal, and in ``+inf`` those above its max,
    without their exponents: a wider ``fmt`` cannot say where they fall. Logs counted in
    each tensor's own dtype (the default) have no such values, only infinities."""
    recorded = run_record(df).get("number_format")
    if not recorded:
        return True, True
    f, r = number_format(fmt), number_format(recorded)
    return f.min_exponent >= r.min_exponent, f.max_exponent <= r.max_exponent


def format_shares(df: pd.DataFrame, fmt: Any) -> pd.DataFrame:
    """Per row, the share of the tensor's elements that would underflow or overflow ``fmt``.

    Estimated from the exponent counts: values in binades below the format's smallest
    subnormal underflow, values in binades above its largest finite value's binade
    overflow, and the log's own ``-inf``/``+inf`` counts are carried over as underflow and
    overflow. Values in the top binade of ``fmt`` count as representable, so the overflow
    share is a lower bound: it misses values between ``fmt``'s max and the next power of
    two (448 to 512 for float8_e4m3fn). Shares are fractions of
    ``numel`` (zeros and NaN are never underflow/overflow); rows with ``numel == 0`` get 0.
    A share the log cannot tell (it counted exponents in a narrower format: see
    :func:`_knowable`) is NaN.
    """
    f = number_format(fmt)
    under_ok, over_ok = _knowable(df, fmt)
    labels, counts = _exponents(df)
    under = (
        counts[:, labels < f.min_exponent].sum(axis=1) + df[(EXPONENT_COUNTS, UNDERFLOW)].to_numpy()
    )
    over = (
        counts[:, labels > f.max_exponent].sum(axis=1) + df[(EXPONENT_COUNTS, OVERFLOW)].to_numpy()
    )
    if (SCALAR_STATS, "numel") in df.columns:
        total = df[(SCALAR_STATS, "numel")].to_numpy(dtype=np.float64)
    else:  # custom logs without numel: shares of the counted (non-zero, non-NaN) values
        total = (
            counts.sum(axis=1)
            + df[(EXPONENT_COUNTS, UNDERFLOW)].to_numpy()
            + df[(EXPONENT_COUNTS, OVERFLOW)].to_numpy()
        ).astype(np.float64)
    safe = np.where(total > 0, total, 1.0)
    out = _meta(df)
    out["underflow"] = np.where(total > 0, under / safe, 0.0) if under_ok else np.nan
    out["overflow"] = np.where(total > 0, over / safe, 0.0) if over_ok else np.nan
    return out


#: The phases of a training step in the order they compute, as :func:`computation_phase`
#: numbers them: the weights the forward pass reads, the activations it produces, the
#: gradients of the backward pass, the optimizer state the update leaves, and last the
#: update itself (``<param>.update`` rows of ``track(..., track_updates=True)``, typed
#: ``Weight`` in the log but computed from the step's gradients and optimizer state).
STEP_PHASES: tuple[str, ...] = ("Weight", "Activation", "Gradient", "Optimiser_State", "update")

#: The suffix of the update rows' names (``<param>.update``).
UPDATE_SUFFIX = ".update"


def _column(df: pd.DataFrame, name: str) -> pd.Series:
    """A metadata column of a log (two-level columns) or of a flat frame of keys."""
    return df[(METADATA, name)] if isinstance(df.columns, pd.MultiIndex) else df[name]


def computation_phase(df: pd.DataFrame) -> np.ndarray:
    """Per row of ``df``, the index in :data:`STEP_PHASES` of the phase of the step that
    computed it: 0 weights, 1 activations, 2 gradients, 3 optimizer state, 4 update rows
    (``Weight`` rows whose name ends in ``.update``); a tensor type the schema does not
    know sorts after all of them (5)."""
    kinds = _column(df, "tensor_type").astype(str).to_numpy()
    names = _column(df, "name").astype(str).to_numpy()
    rank = {k: i for i, k in enumerate(STEP_PHASES[:-1])}
    phase = np.array([rank.get(k, len(STEP_PHASES)) for k in kinds], dtype=np.int64)
    if phase.size:
        update = (kinds == "Weight") & np.char.endswith(names.astype(str), UPDATE_SUFFIX)
        phase[update] = STEP_PHASES.index("update")
    return phase


def computation_order(df: pd.DataFrame) -> np.ndarray:
    """The positions of ``df``'s rows in the order a training run computed them:
    ``df.iloc[computation_order(df)]`` lists them by step, then within a step by phase
    (:data:`STEP_PHASES`: weights as the forward pass found them, activations in forward
    order, gradients in backward order, optimizer state, then the update rows), then by the
    log's own row order.

    The log's row order is the order the tracker observed the tensors (activations in the
    order their modules finished the forward pass, activation gradients in the order the
    backward pass reached them); a log re-sorted by hand loses that order within a phase.
    This is the order in which "first" is meant by :func:`first_nonfinite` (and the HTML
    report's banner), :func:`tandv.first_divergence` and the trackers' alerts; use it
    wherever "which tensor went wrong first" is asked. ``df`` is a log (two-level columns)
    or a flat frame with ``name``, ``tensor_type`` and ``step`` columns.
    """
    if len(df) == 0:
        return np.zeros(0, dtype=np.int64)
    steps = _column(df, "step").to_numpy(dtype=np.int64)
    # lexsort: the last key is the primary one; the row position breaks ties (stable)
    return np.lexsort((np.arange(len(df)), computation_phase(df), steps)).astype(np.int64)


def first_nonfinite(df: pd.DataFrame) -> pd.DataFrame:
    """Where NaN or inf appeared: per tensor (name, tensor_type) that ever held one, its
    first such step and counts, in the order the values went bad.

    Row 0 is *the* first: the earliest step, and within it the first tensor in the order
    of the step's computation (:func:`computation_order`): weights, then activations in
    forward order, then gradients in backward order, then optimizer state, then update
    rows (``<param>.update``). An update row is therefore never named first when, in the
    same step, an activation, gradient or optimizer state had already gone non-finite.

    Returns:
        Columns ``name``, ``tensor_type``, ``step``, ``nan_count``, ``inf_count``; empty if
        the log never saw NaN/inf, or lacks the ``nan_count``/``inf_count`` statistics.
    """
    cols = ["name", "tensor_type", "step", "nan_count", "inf_count"]
    if not {(SCALAR_STATS, "nan_count"), (SCALAR_STATS, "inf_count")} <= set(df.columns):
        return pd.DataFrame(columns=cols)
    m = _meta(df)
    m["nan_count"] = df[(SCALAR_STATS, "nan_count")].to_numpy()
    m["inf_count"] = df[(SCALAR_STATS, "inf_count")].to_numpy()
    m = m.iloc[computation_order(df)]
    bad = m[(m["nan_count"] > 0) | (m["inf_count"] > 0)]
    if bad.empty:
        return pd.DataFrame(columns=cols)
    first = bad.groupby(["name", "tensor_type"], sort=False).head(1)
    return first[cols].reset_index(drop=True)


def _fmt_num(x: float) -> str:
    return "nan" if not np.isfinite(x) else f"{x:.3g}"


class _Names:
    """``names[i]``: the name of row ``i`` of a tensor type's rows, from factorized codes
    (no string array per chunk)."""

    def __init__(self, values: np.ndarray, codes: np.ndarray) -> None:
        self.values, self.codes = values, codes

    def __getitem__(self, i: int) -> str:
        return self.values[self.codes[i]]


class _TypeTally:
    """What :func:`text_summary` reports of one tensor type, gathered chunk by chunk."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.step_min: int | None = None
        self.step_max: int | None = None
        self.first: dict[str, tuple[int, int, int]] = {}  # name -> (step, nan, inf), earliest
        self.worst: tuple[int, str, int, int] | None = None  # (nan + inf, name, step, numel)
        self.widest: tuple[int, str, int, int, int] | None = None  # (width, name, step, lo, hi)
        self.last: list[tuple[str, float]] = []  # (name, rm2) at step_max
        self.lost: dict[str, list[float]] = {}  # format -> [underflow, overflow] counts
        self.numel = 0.0

    def add(self, c: _Chunk, idx: np.ndarray) -> None:
        """Tally rows ``idx`` of chunk ``c`` (the rows of this tensor type)."""
        codes = c.name_codes[idx]
        names = _Names(c.name_values, codes)
        steps = c.steps[idx]
        self.names.update(c.name_values[np.unique(codes)].tolist())
        first_step, last_step = int(steps.min()), int(steps.max())
        self.step_min = first_step if self.step_min is None else min(self.step_min, first_step)
        if c.nan is not None and c.inf is not None:
            self._add_nonfinite(c, idx, names, steps)
        w = c.width[idx]
        i = int(np.argmax(w))
        if w[i] > 0 and (self.widest is None or w[i] > self.widest[0]):
            r = idx[i]
            self.widest = (int(w[i]), names[i], int(steps[i]), int(c.lo[r]), int(c.hi[r]))
        if c.rm2 is not None:
            if self.step_max is None or last_step > self.step_max:
                self.last = []
            if self.step_max is None or last_step >= self.step_max:
                at = steps == last_step
                self.last += list(zip(c.name_values[codes[at]], c.rm2[idx][at]))
        self.step_max = last_step if self.step_max is None else max(self.step_max, last_step)
        if c.numel is not None:
            self.numel += c.numel[idx].sum()
            for f, (under, over) in c.lost.items():
                acc = self.lost.setdefault(f, [0.0, 0.0])
                acc[0] += under[idx].sum()
                acc[1] += over[idx].sum()

    def _add_nonfinite(self, c: _Chunk, idx: np.ndarray, names: _Names, steps: np.ndarray) -> None:
        """The first NaN/inf of each name, and the row with the most of them."""
        assert c.nan is not None and c.inf is not None
        nan, inf = c.nan[idx], c.inf[idx]
        bad = np.flatnonzero((nan > 0) | (inf > 0))
        for i in bad[np.argsort(steps[bad], kind="stable")]:
            if names[i] not in self.first or steps[i] < self.first[names[i]][0]:
                self.first[names[i]] = (int(steps[i]), int(nan[i]), int(inf[i]))
        if bad.size:
            total = nan + inf
            i = int(np.argmax(total))
            if self.worst is None or total[i] > self.worst[0]:
                size = int(c.numel[idx[i]]) if c.numel is not None else 0
                self.worst = (int(total[i]), names[i], int(steps[i]), size)


class _Chunk:
    """The columns of one chunk of a log that :class:`_SummaryTally` reads, as numpy arrays
    (``None`` for a statistic the log lacks)."""

    def __init__(self, df: pd.DataFrame, formats: Sequence[str]) -> None:
        n = len(df)
        self.steps = df[(METADATA, "step")].to_numpy(dtype=np.int64)
        self.name_codes, name_values = pd.factorize(df[(METADATA, "name")])
        self.name_values = np.asarray(name_values, dtype=object)
        labels, counts = _exponents(df)  # one (rows, exponents) matrix per chunk
        nz = counts > 0
        seen = nz.any(axis=1)
        if labels.size:
            self.lo = labels[nz.argmax(axis=1)]
            self.hi = labels[labels.size - 1 - nz[:, ::-1].argmax(axis=1)]
        else:
            self.lo = self.hi = np.zeros(n, np.int64)
        self.width = np.where(seen, self.hi - self.lo + 1, 0)
        del nz
        has = {c for g, c in df.columns if g == SCALAR_STATS}

        def stat(name: str, dtype: Any = None) -> np.ndarray | None:
            return df[(SCALAR_STATS, name)].to_numpy(dtype=dtype) if name in has else None

        self.numel = stat("numel", np.float64)
        self.rm2 = stat("rm2", np.float64)
        nonfinite = {"nan_count", "inf_count"} <= has
        self.nan = stat("nan_count") if nonfinite else None
        self.inf = stat("inf_count") if nonfinite else None
        #: format -> (underflow, overflow) count of each row, NaN where not knowable
        self.lost: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        if self.numel is None:
            return
        under_col = df[(EXPONENT_COUNTS, UNDERFLOW)].to_numpy()
        over_col = df[(EXPONENT_COUNTS, OVERFLOW)].to_numpy()
        positive = self.numel > 0  # as format_shares: a row without elements has share 0
        for f in formats:
            fmt = number_format(f)
            under_ok, over_ok = _knowable(df, f)
            under = under_col + counts[:, labels < fmt.min_exponent].sum(axis=1)
            over = over_col + counts[:, labels > fmt.max_exponent].sum(axis=1)
            self.lost[f] = (
                np.where(positive, under, 0.0) if under_ok else np.full(n, np.nan),
                np.where(positive, over, 0.0) if over_ok else np.full(n, np.nan),
            )


class _SummaryTally:
    """Running totals behind :func:`text_summary`: :meth:`add` each chunk of a log (in log
    order), then :meth:`text`. One definition serves a frame in memory and a parquet log
    read in chunks."""

    def __init__(self, formats: Sequence[str]) -> None:
        self.formats = tuple(formats)
        self.rows = 0
        self.steps: set[int] = set()
        self.names: set[str] = set()
        self.types = {tt: _TypeTally() for tt in TENSOR_TYPES}
        self.run: dict[str, Any] = {}  # the log's record of how it was made

    def add(self, df: pd.DataFrame) -> None:
        """Tally the rows of ``df``, a log or a chunk of one (column by column in numpy:
        no per-type copies of the chunk, no 2-D copy of its counts)."""
        self.run = self.run or run_record(df)
        if df.empty:
            return
        chunk = _Chunk(df, self.formats)
        self.rows += len(df)
        self.steps.update(np.unique(chunk.steps).tolist())
        self.names.update(chunk.name_values.tolist())
        kind_codes, kind_values = pd.factorize(df[(METADATA, "tensor_type")])
        kinds = list(np.asarray(kind_values, dtype=object))
        for tt, t in self.types.items():
            if tt in kinds:
                t.add(chunk, np.flatnonzero(kind_codes == kinds.index(tt)))

    def text(self, top: int) -> str:
        if not self.rows:
            return "empty log: no rows (the run recorded no step)"
        lines = [
            f"{self.rows} rows, steps {min(self.steps)}..{max(self.steps)} "
            f"({len(self.steps)} recorded), {len(self.names)} tensor names"
        ]
        if self.run:
            r = self.run
            fmt = r.get("number_format") or "each tensor's dtype"
            versions = ", ".join(f"{k} {v}" for k, v in (r.get("versions") or {}).items())
            lines.append(
                f"made by the {r.get('framework')} tracker of {r.get('model')}, started "
                f"{r.get('started')}, rank {r.get('rank')} of {r.get('world_size')}; "
                f"exponents counted as {fmt}; {versions}"
            )
        for tt, t in self.types.items():
            if t.step_min is None:
                continue
            lines.append("")
            lines.append(f"{tt}: {len(t.names)} tensors, steps {t.step_min}..{t.step_max}")
            if not t.first:
                lines.append("  NaN/inf: none")
            else:
                order = sorted(t.first.items(), key=lambda kv: kv[1][0])  # stable: first seen first
                name, (step, nan, inf) = order[0]
                n = len(order)
                w = t.worst
                assert w is not None  # set with the first NaN/inf
                lines.append(
                    f"  NaN/inf: first in {name} at step {step} ({nan} NaN, {inf} inf); {n} tensor"
                    f"{'s' if n != 1 else ''} affected; "
                    f"worst {w[1]} at step {w[2]} ({w[0]} of {w[3]})"
                )
            if t.widest is not None:
                width, name, step, lo, hi = t.widest
                lines.append(
                    f"  widest exponent range: {name} at step {step}: 2^{lo} .. 2^{hi} ({width} "
                    "binades)"
                )
            if t.last:
                rm2 = pd.Series([v for _, v in t.last], index=[n for n, _ in t.last])
                order = rm2.reset_index(drop=True).sort_values(
                    ascending=False, na_position="last", kind="stable"
                )
                names = rm2.index
                big = ", ".join(f"{names[i]} {_fmt_num(order[i])}" for i in order.index[:top])
                small = ", ".join(
                    f"{names[i]} {_fmt_num(order[i])}" for i in order.dropna().index[::-1][:top]
                )
                lines.append(f"  largest rm2 at step {t.step_max}: {big}")
                lines.append(f"  smallest rm2 at step {t.step_max}: {small}")
            if t.lost:
                parts = []
                for f, (u, o) in t.lost.items():
                    u, o = (u / t.numel, o / t.numel) if t.numel else (0.0, 0.0)
                    parts.append(
                        f"{f}: "
                        + ", ".join(
                            f"{v:.2%} {what}" if np.isfinite(v) else f"{what} not known"
                            for v, what in ((u, "underflow"), (o, "overflow"))
                        )
                    )
                lines.append("  as " + "; ".join(parts))
        return "\n".join(lines)


def text_summary(
    df: pd.DataFrame, formats: Sequence[str] = ("float8_e4m3fn", "bfloat16"), top: int = 3
) -> str:
    """A readable summary of a log, per tensor type: steps and tensors, the first and
    worst NaN/inf, the widest exponent range, the tensors with the largest and smallest
    ``rm2`` at the last step, and the share of values that would underflow/overflow each
    of ``formats``."""
    tally = _SummaryTally(formats)
    tally.add(df)
    return tally.text(top)


def summarize_log(
    path: str | os.PathLike,
    formats: Sequence[str] = ("float8_e4m3fn", "bfloat16"),
    top: int = 3,
    chunk_rows: int = CHUNK_ROWS,
    *,
    trust_pickle: bool = False,
) -> str:
    """:func:`text_summary` of the log at ``path``. A parquet log is read in chunks of the
    columns the summary needs (memory stays flat however long the run); a pickle is read
    whole, and only with ``trust_pickle=True``: unpickling runs code stored in the file
    (the command line's ``--trust-pickle``).

    Raises:
        FileNotFoundError, tandv.SchemaError: as the readers do.
        ValueError: for a pickle without ``trust_pickle=True``.
    """
    p = Path(path)
    tally = _SummaryTally(formats)
    if p.suffix.lower() in (".pkl", ".pickle"):
        tally.add(read_log(p, trust_pickle=trust_pickle))
        return tally.text(top)
    log = ParquetLog(p, statistics=False)
    wanted = [
        c
        for g, c in log.columns
        if g == SCALAR_STATS and c in ("rm2", "numel", "nan_count", "inf_count")
    ]
    wanted += [c for g, c in log.columns if g == EXPONENT_COUNTS]
    for chunk in read_parquet_chunks(log, columns=wanted, chunk_rows=chunk_rows):
        tally.add(chunk)
    return tally.text(top)


def sparsity(df: pd.DataFrame) -> pd.DataFrame:
    """Per row, the fraction of the tensor's elements that are exactly zero (+0.0 or -0.0):
    ``zero_count / numel`` (the Chainer monitor's sparsity), NaN for a tensor without
    elements.

    Raises:
        ValueError: if the log lacks the ``zero_count`` or ``numel`` statistic.
    """
    missing = [c for c in ("zero_count", "numel") if (SCALAR_STATS, c) not in df.columns]
    if missing:
        raise ValueError(
            f"sparsity(df): the log has no {missing} statistic(s); "
            "logs made by the trackers have them"
        )
    zeros = df[(SCALAR_STATS, "zero_count")].to_numpy(dtype=np.float64)
    numel = df[(SCALAR_STATS, "numel")].to_numpy(dtype=np.float64)
    out = _meta(df)
    with np.errstate(invalid="ignore", divide="ignore"):
        out["sparsity"] = np.where(numel > 0, zeros / np.where(numel > 0, numel, 1), np.nan)
    return out


def _percentile_columns(df: pd.DataFrame) -> list[tuple[str, float]]:
    """The log's percentile statistics (``pct<q>``, as the trackers' ``percentiles`` option
    names them) with their ``q``, ascending in ``q``."""
    out = []
    for g, c in df.columns:
        if g == SCALAR_STATS and isinstance(c, str) and c.startswith("pct"):
            try:
                q = float(c[3:])
            except ValueError:
                continue
            if 0 <= q <= 100:
                out.append((c, q))
    return sorted(out, key=lambda cq: cq[1])


def _probit(f: float) -> float:
    """The standard normal quantile of ``f`` (``-inf``/``inf`` at 0 and 1)."""
    from statistics import NormalDist

    return -math.inf if f <= 0 else math.inf if f >= 1 else NormalDist().inv_cdf(f)


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    """The standard normal distribution function (Abramowitz & Stegun 7.1.26 for erf,
    absolute error below 1.5e-7: enough for an estimate)."""
    x = np.abs(z) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (
        0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))
    )
    erf = 1.0 - poly * np.exp(-x * x)
    return 0.5 * (1.0 + np.sign(z) * erf)


def _interp_cdf(x: np.ndarray, pts: np.ndarray, fr: np.ndarray, z: np.ndarray) -> np.ndarray:
    """One tensor's distribution function at ``x``, interpolated between its known points
    ``(pts[j], fr[j])``: linearly in the normal quantile ``z`` between two inner points (a
    normal tensor's is then exact) and linearly in ``fr`` next to its extrema."""
    j = np.clip(np.searchsorted(pts, x, side="right") - 1, 0, pts.size - 2)
    x0, x1 = pts[j], pts[j + 1]
    t = np.where(x1 > x0, (x - x0) / np.where(x1 > x0, x1 - x0, 1.0), 1.0)
    t = np.clip(t, 0.0, 1.0)
    inner = np.isfinite(z[j]) & np.isfinite(z[j + 1])
    with np.errstate(invalid="ignore"):
        by_z = _normal_cdf(np.where(inner, z[j] + t * (z[j + 1] - z[j]), 0.0))
    out = np.where(inner, by_z, fr[j] + t * (fr[j + 1] - fr[j]))
    return np.where(x < pts[0], 0.0, np.where(x >= pts[-1], 1.0, out))


def merge_percentiles(
    values: np.ndarray,
    qs: Sequence[float],
    counts: np.ndarray,
    mins: np.ndarray,
    maxs: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The percentiles ``qs`` of several tensors' elements together, from each tensor's own
    percentiles: an estimate and bounds that hold the exact value.

    Percentiles do not merge exactly (two tensors' medians do not give their joint median),
    so this brackets each: tensor ``i`` (``counts[i]`` non-NaN elements, extrema
    ``mins[i]``, ``maxs[i]``) has, by ``np.percentile``'s linear interpolation at position
    ``h = q / 100 * (n - 1)`` of its sorted values, at least ``floor(h) + 1`` elements
    ``<= values[i, j]`` and at most ``ceil(h)`` below it. Summing these bounds over the
    tensors gives the smallest and largest values the joint percentile can take (``lo``,
    ``hi``: both among the tensors' own percentile values and extrema). The estimate
    interpolates each tensor's distribution function between its known points (linearly in
    the normal quantile between two of its percentiles, so a normally distributed tensor's
    is exact there; linearly next to its extrema) and inverts their count-weighted sum,
    clipped to ``[lo, hi]``. With one tensor all three are its own percentile; ``q = 0``
    and ``q = 100`` are the joint extrema, exact.

    Arguments:
        values: ``(tensors, len(qs))`` percentiles, ``qs`` ascending in [0, 100].
        counts: each tensor's number of non-NaN elements (tensors with 0 are left out).
        mins, maxs: each tensor's smallest and largest element.

    Returns:
        ``(estimate, lo, hi)``, each of ``len(qs)``; NaN where no tensor has elements or a
        tensor's percentiles or extrema are not finite (infinities: the bounds need finite
        points).
    """
    q = np.asarray(qs, dtype=np.float64) / 100.0
    v = np.asarray(values, dtype=np.float64).reshape(-1, q.size)
    n = np.asarray(counts, dtype=np.float64).ravel()
    keep = n > 0
    v, n = v[keep], n[keep]
    lo_x, hi_x = (
        np.asarray(mins, np.float64).ravel()[keep],
        np.asarray(maxs, np.float64).ravel()[keep],
    )
    nan = np.full(q.size, np.nan)
    if n.size == 0 or not (
        np.isfinite(v).all() and np.isfinite(lo_x).all() and np.isfinite(hi_x).all()
    ):
        return nan, nan.copy(), nan.copy()
    if n.size == 1:
        return v[0].copy(), v[0].copy(), v[0].copy()
    # each tensor's known points (fraction, value), anchored by its extrema at 0 and 1
    fr = np.concatenate([[0.0], q, [1.0]])
    pts = np.concatenate([lo_x[:, None], v, hi_x[:, None]], axis=1)
    pts = np.maximum.accumulate(pts, axis=1)  # rounding can not reorder what is sorted
    pos = fr[None, :] * (n[:, None] - 1)  # np.percentile's positions
    at_least = np.floor(pos) + 1  # elements <= pts[i, j]
    below = np.ceil(pos)  # elements < pts[i, j] at most
    grid = np.unique(pts)
    z = np.array([_probit(f) for f in fr])  # +-inf at the extrema
    # per grid point, summed over tensors: lower and upper bounds of count(<= x) and the
    # interpolated estimate of it
    low = np.zeros(grid.size)
    high = np.zeros(grid.size)
    est = np.zeros(grid.size)
    for i in range(n.size):
        j_le = np.searchsorted(pts[i], grid, side="right") - 1  # last point <= x
        low += np.where(j_le >= 0, at_least[i][np.clip(j_le, 0, None)], 0.0)
        j_gt = j_le + 1  # first point > x
        high += np.where(j_gt < fr.size, below[i][np.clip(j_gt, None, fr.size - 1)], n[i])
        est += n[i] * _interp_cdf(grid, pts[i], fr, z)
    total = n.sum()
    target = q * (total - 1)  # the joint percentile's position
    first, last = np.floor(target), np.ceil(target)
    lo = grid[np.searchsorted(high, first + 1, side="left").clip(None, grid.size - 1)]
    hi = grid[np.searchsorted(low, last + 1, side="left").clip(None, grid.size - 1)]
    frac = est / total
    guess = np.empty(q.size)
    for k, f in enumerate(q):
        j = int(np.searchsorted(frac, f, side="left"))
        if j <= 0:
            guess[k] = grid[0]
        elif j >= grid.size:
            guess[k] = grid[-1]
        else:
            a, b = frac[j - 1], frac[j]
            t = (f - a) / (b - a) if b > a else 1.0
            guess[k] = grid[j - 1] + t * (grid[j] - grid[j - 1])
    exact = (q == 0) | (q == 1)
    lo[q == 0] = hi[q == 0] = grid[0]
    lo[q == 1] = hi[q == 1] = grid[-1]
    guess = np.where(exact, lo, np.clip(guess, lo, hi))
    return guess, lo, hi


def aggregate(
    df: pd.DataFrame,
    groups: Mapping[str, str] | None = None,
    tensor_types: str | Sequence[str] | None = None,
    exclude: str | None = r"\.update$",
) -> pd.DataFrame:
    r"""Aggregate rows: the statistics of all tensors of a group together, per tensor type and
    step, as if their elements were one tensor (the Chainer monitor's whole-model statistics).

    Merged exactly from what each row stores, not averaged from finished statistics: each
    row's summary is rebuilt from its statistics (:func:`tandv.stats.summary.unfinalize_many`),
    the summaries of each (group, tensor type, step) merge
    (:func:`tandv.stats.summary.merge_groups`: counts and exponent counts add up, extrema
    take the min/max, the mean is the count-weighted mean, the variance adds each part's
    centred sum of squares and its spread of means, the power sums behind ``rm2/rm4/rm8``
    and ``mean_abs`` add, rescaled to the group's largest magnitude so that nothing
    overflows), and the merged summaries are finished like any row's. Moments are over the
    finite elements, as in every row; ``skew`` and ``kurtosis`` (logged with ``moments=4``)
    merge exactly too (each row's third and fourth central sums shifted to the group's
    mean). Custom statistics do not merge and are left out.

    Percentiles (the ``pct<q>`` columns of ``track(..., percentiles=...)``) do not merge
    exactly either; each aggregate row gets ``pct<q>``, an estimate, and ``pct<q>_lo`` /
    ``pct<q>_hi``, bounds that hold the exact percentile of the members' elements together
    (:func:`merge_percentiles`). They are exact for a group of one tensor and for ``q`` 0
    and 100. The Chainer monitor's exact whole-model percentiles come from a snapshot of
    the model instead: ``from_weight(model).filter(r"\.weight$").describe(percentiles=...)``.

    Arguments:
        groups: ``{group name: regex}``; a row belongs to every group whose regex is found
            in its name (``re.search``). Default: one group ``"model"`` of every row.
        tensor_types: the tensor types to aggregate (default: all in the log). Each is
            aggregated on its own: weights with weights, gradients with gradients.
        exclude: a regex of names left out (default: update rows ``<param>.update``, which
            are not weights); ``None`` keeps every row.

    Returns:
        A log (validated; it can be concatenated with ``df`` or plotted) with one row per
        (group, tensor type, step) that has members: ``name`` is the group, ``type``
        ``"aggregate"``, ``dtype`` the members' (the widest format when they differ, whose
        exponent range holds the others'), the default statistics, ``tensors`` (how many
        rows were merged), ``sparsity``, the percentile columns (when the log has them) and
        the summed exponent counts.

    Raises:
        ValueError: naming a missing statistic, an unknown tensor type or a bad regex.
    """
    import re

    from .schema.columns import META_COLUMNS
    from .schema.validate import validate

    missing = [c for c in INVERTIBLE_STATS if (SCALAR_STATS, c) not in df.columns]
    if missing:
        raise ValueError(
            f"aggregate(df): the log lacks the statistics {missing}; aggregates are merged from "
            f"the default statistics a tracker logs"
        )
    tts = (
        [tensor_types]
        if isinstance(tensor_types, str)
        else (list(TENSOR_TYPES) if tensor_types is None else list(tensor_types))
    )
    unknown = [t for t in tts if t not in TENSOR_TYPES]
    if unknown:
        raise ValueError(
            f"aggregate(tensor_types={tensor_types!r}): unknown {unknown}; "
            f"choose from {list(TENSOR_TYPES)}"
        )
    groups = {"model": ""} if groups is None else dict(groups)
    try:
        patterns = {g: re.compile(p) for g, p in groups.items()}
        skip = None if exclude is None else re.compile(exclude)
    except re.error as e:
        raise ValueError(f"aggregate: bad regex in groups/exclude: {e}") from None
    names = df[(METADATA, "name")].astype(str).to_numpy()
    kinds = df[(METADATA, "tensor_type")].to_numpy()
    steps = df[(METADATA, "step")].to_numpy(dtype=np.int64)
    dtypes = df[(METADATA, "dtype")].astype(str).to_numpy()
    exp_cols = [c for c in df.columns if c[0] == EXPONENT_COUNTS]
    # skewness and kurtosis (logged with moments=4) merge too, when every row has them
    higher = [c for c in HIGHER_STATS if (SCALAR_STATS, c) in df.columns]
    moments = 4 if len(higher) == len(HIGHER_STATS) else 2
    wanted = INVERTIBLE_STATS + (HIGHER_STATS if moments == 4 else ())
    # the rows' summaries, their exponent counts in the log's columns (a layout of its own)
    summaries = unfinalize_many(
        {c: df[(SCALAR_STATS, c)].to_numpy(dtype=np.float64) for c in wanted},
        df[exp_cols].to_numpy(dtype=np.float64).reshape(len(df), len(exp_cols)),
        moments=moments,
    )
    kept = (
        np.ones(len(df), bool)
        if skip is None
        else np.array([skip.search(n) is None for n in names], bool)
    )
    meta: list[list[Any]] = []
    members: list[np.ndarray] = []
    group_of: list[np.ndarray] = []
    for g, pat in patterns.items():
        member = kept & np.array([pat.search(n) is not None for n in names], bool)
        for tt in tts:
            sel = member & (kinds == tt)
            for step in np.unique(steps[sel]):
                idx = np.flatnonzero(sel & (steps == step))
                found = sorted(set(dtypes[idx].tolist()))
                dtype = (
                    found[0]
                    if len(found) == 1
                    else max(found, key=lambda k: number_format(k).num_bins)
                )
                group_of.append(np.full(idx.size, len(meta)))
                members.append(idx)
                meta.append([g, "aggregate", tt, int(step), dtype])
    rows = np.concatenate(members) if members else np.zeros(0, np.int64)
    merged = merge_groups(
        summaries[rows],
        np.concatenate(group_of) if group_of else np.zeros(0, np.int64),
        num_groups=len(meta),
        moments=moments,
    )
    st, counts = finalize_many(merged.reshape(len(meta), summaries.shape[1]), moments=moments)
    stats = pd.DataFrame({k: st[k] for k in DEFAULT_STATS + (HIGHER_STATS if moments == 4 else ())})
    stats["tensors"] = np.array([idx.size for idx in members], dtype=np.int64)
    numel = st["numel"].astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        stats["sparsity"] = np.where(
            numel > 0, st["zero_count"] / np.where(numel > 0, numel, 1), np.nan
        )
    pcts = _percentile_columns(df)
    if pcts:
        qs = [q for _, q in pcts]
        values = df[[(SCALAR_STATS, c) for c, _ in pcts]].to_numpy(dtype=np.float64)
        non_nan = df[(SCALAR_STATS, "numel")].to_numpy(dtype=np.float64) - df[
            (SCALAR_STATS, "nan_count")
        ].to_numpy(dtype=np.float64)
        lows, highs = (df[(SCALAR_STATS, k)].to_numpy(dtype=np.float64) for k in ("min", "max"))
        merged_pct = [
            merge_percentiles(values[idx], qs, non_nan[idx], lows[idx], highs[idx])
            for idx in members
        ]
        for k, (c, _) in enumerate(pcts):
            for part, suffix in enumerate(("", "_lo", "_hi")):
                stats[c + suffix] = np.array(
                    [m[part][k] for m in merged_pct] if merged_pct else [], dtype=np.float64
                )
    meta_df = pd.DataFrame(meta, columns=list(META_COLUMNS))
    meta_df["step"] = meta_df["step"].astype(np.int64)
    ex = pd.DataFrame(counts, columns=[c[1] for c in exp_cols])
    out = pd.concat([meta_df, stats, ex], axis=1, keys=[METADATA, SCALAR_STATS, EXPONENT_COUNTS])
    return validate(out)
