"""Mergeable summaries of a tensor, and the plain numpy reference that defines them.

A *summary* is a small float64 vector of sufficient statistics of one tensor:
counts, extrema, scaled moments and exponent counts. Two summaries of two
parts of a tensor merge (:func:`merge`) into exactly the summary of the whole,
which is what lets one design serve micro-batches, shards and ranks.
:func:`finalize` turns a summary into the scalar statistics and exponent
counts that make up a log row.

Layout (see :class:`Layout`), all float64; counts are exact below 2**53:

====================  ===========================================================
``numel``             number of elements
``nan_count``         NaN elements
``inf_count``         +inf and -inf elements
``zero_count``        elements equal to zero (+0.0 and -0.0)
``min``, ``max``      extrema of the finite elements (+inf / -inf when none)
``min_abs``           smallest magnitude of the finite elements (+inf when none)
``max_abs``           largest magnitude of the finite elements (0 when none); it is
                      also the *scale* s of the moments below (1 when it is 0)
``mean``              mean of the finite elements
``m2``                sum over finite x of ((x - mean) / s)**2
``p1 p2 p4 p8``       sum over finite x of (|x| / s)**K
exponent counts       ``-inf`` (underflow), one count per exponent of the format,
                      ``+inf`` (overflow); see :func:`exponent_bins`
extras                custom statistics, merged by their declared rule
====================  ===========================================================

Moments are scaled by the largest magnitude so that no power overflows, whatever
the input dtype (|x|**8 overflows float32 already for |x| > 2**16); the variance is
kept as a centred sum (Chan et al.) so it stays accurate when |mean| >> std.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .formats import NumberFormat, number_format

__all__ = [
    "CORE_FIELDS",
    "N_LEADING_COUNTS",
    "DEFAULT_STATS",
    "MERGE_RULES",
    "Layout",
    "summarize",
    "merge",
    "merge_all",
    "finalize",
    "finalize_many",
    "exponent_bins",
    "exponent_labels",
]

#: Names of the fixed leading fields of every summary vector, in order.
CORE_FIELDS: tuple[str, ...] = (
    "numel",
    "nan_count",
    "inf_count",
    "zero_count",
    "min",
    "max",
    "min_abs",
    "max_abs",
    "mean",
    "m2",
    "p1",
    "p2",
    "p4",
    "p8",
)
_I = {name: i for i, name in enumerate(CORE_FIELDS)}
#: The moment orders K kept as scaled power sums, and their field names.
POWERS: tuple[int, ...] = (1, 2, 4, 8)

#: The default scalar statistics of a log row, in column order.
DEFAULT_STATS: tuple[str, ...] = (
    "mean",
    "std",
    "mean_abs",
    "min_abs",
    "max_abs",
    "rm2",
    "rm4",
    "rm8",
    "min",
    "max",
    "numel",
    "zero_count",
    "nan_count",
    "inf_count",
)
#: Default statistics that are counts (written as int64 columns).
COUNT_STATS: frozenset[str] = frozenset({"numel", "zero_count", "nan_count", "inf_count"})
#: How many fields lead :data:`CORE_FIELDS` as counts: kernels that keep counts in integers
#: apart from the float values split and join the vector here.
N_LEADING_COUNTS: int = next(i for i, f in enumerate(CORE_FIELDS) if f not in COUNT_STATS)

#: How an extra (custom) statistic of two parts combines: ``mean`` is weighted by numel.
MERGE_RULES: tuple[str, ...] = ("sum", "min", "max", "mean")


@dataclass(frozen=True)
class Layout:
    """Where each quantity sits in a summary vector for one number format.

    Arguments:
        format: the number format whose exponent range the counts cover (and whose
            thresholds decide underflow and overflow).
        extras: custom statistics appended after the counts, as ``(name, rule)`` pairs
            with ``rule`` one of :data:`MERGE_RULES`.
    """

    format: NumberFormat
    extras: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", number_format(self.format))
        for name, rule in self.extras:
            if rule not in MERGE_RULES:
                raise ValueError(
                    f"custom statistic {name!r}: merge rule {rule!r} is not one of {MERGE_RULES}"
                )
            if name in DEFAULT_STATS:
                raise ValueError(
                    f"custom statistic {name!r} clashes with a default statistic; rename it"
                )

    @property
    def counts_start(self) -> int:
        """Index of the ``-inf`` (underflow) count."""
        return len(CORE_FIELDS)

    @property
    def num_counts(self) -> int:
        """Number of exponent counts: underflow, one per exponent, overflow."""
        return self.format.num_bins + 2

    @property
    def extras_start(self) -> int:
        """Index of the first custom statistic."""
        return self.counts_start + self.num_counts

    @property
    def size(self) -> int:
        """Length of the summary vector."""
        return self.extras_start + len(self.extras)

    def empty(self) -> np.ndarray:
        """The summary of an empty tensor: the neutral element of :func:`merge`."""
        out = np.zeros(self.size, dtype=np.float64)
        out[_I["min"]] = np.inf
        out[_I["max"]] = -np.inf
        out[_I["min_abs"]] = np.inf
        for i, (_, rule) in enumerate(self.extras):
            out[self.extras_start + i] = {"min": np.inf, "max": -np.inf}.get(rule, 0.0)
        return out


def exponent_labels(fmt: Any) -> list[int | str]:
    """Column labels of the exponent counts of ``fmt``: ``-inf``, each exponent, ``+inf``."""
    f = number_format(fmt)
    return ["-inf", *f.exponents, "+inf"]


def exponent_bins(x: np.ndarray, fmt: Any) -> np.ndarray:
    """Exponent counts of ``x`` for format ``fmt`` (reference implementation).

    Returns an int64 array of length ``num_bins + 2``: index 0 counts the finite
    non-zero values whose magnitude is below the format's smallest subnormal
    (underflow, ``-inf``); index ``1 + n - min_exponent`` counts finite values with
    ``2**n <= |x| < 2**(n+1)`` and ``|x| <= max``; the last index counts values whose
    magnitude exceeds the format's max, infinities included (overflow, ``+inf``).
    Zeros and NaN are not counted anywhere.
    """
    f = number_format(fmt)
    a = np.abs(np.asarray(x).astype(np.float64)).ravel()
    a = a[~np.isnan(a) & (a != 0)]
    over = a > f.max  # includes +inf
    finite = a[~over]
    exps = np.frexp(finite)[1].astype(np.int64) - 1  # exact floor(log2|x|), subnormals too
    under = exps < f.min_exponent
    counts = np.zeros(f.num_bins + 2, dtype=np.int64)
    counts[0] = int(under.sum())
    np.add.at(counts, exps[~under] - f.min_exponent + 1, 1)
    counts[-1] = int(over.sum())
    return counts


def summarize(
    x: Any,
    fmt: Any = None,
    extras: Mapping[str, tuple[float, str]] | None = None,
) -> tuple[np.ndarray, Layout]:
    """Summary of the array ``x`` (numpy reference; the framework kernels must agree).

    Arguments:
        x: any array numpy can hold, including ml_dtypes types (bfloat16, float8_*).
        fmt: the number format for the exponent counts; default ``x``'s own dtype.
        extras: already-computed custom statistics, ``{name: (value, merge_rule)}``.

    Returns:
        ``(vector, layout)``.
    """
    arr = np.asarray(x)
    layout = Layout(
        number_format(arr.dtype if fmt is None else fmt),
        tuple((k, r) for k, (_, r) in (extras or {}).items()),
    )
    v = layout.empty()
    flat = arr.astype(np.float64).ravel()
    nan = np.isnan(flat)
    inf = np.isinf(flat)
    fin = flat[~nan & ~inf]
    v[_I["numel"]] = flat.size
    v[_I["nan_count"]] = nan.sum()
    v[_I["inf_count"]] = inf.sum()
    v[_I["zero_count"]] = (flat == 0).sum()
    if fin.size:
        a = np.abs(fin)
        s = a.max()
        scale = s if s > 0 else 1.0
        mean = scale * np.mean(fin / scale)
        v[_I["min"]], v[_I["max"]] = fin.min(), fin.max()
        v[_I["min_abs"]], v[_I["max_abs"]] = a.min(), s
        v[_I["mean"]] = mean
        v[_I["m2"]] = np.sum((fin / scale - mean / scale) ** 2)
        for k in POWERS:
            v[_I[f"p{k}"]] = np.sum((a / scale) ** k)
    v[layout.counts_start : layout.extras_start] = exponent_bins(flat, layout.format)
    for i, (value, _) in enumerate((extras or {}).values()):
        v[layout.extras_start + i] = float(value)
    return v, layout


def _scale(s: np.ndarray | float) -> Any:
    return np.where(np.asarray(s) > 0, s, 1.0)


def merge(a: np.ndarray, b: np.ndarray, layout: Layout) -> np.ndarray:
    """The summary of the union of two tensors' elements, from their summaries.

    ``merge(summarize(x), summarize(y)) == summarize(concat(x, y))`` up to rounding;
    counts, extrema and exponent counts exactly.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    out = a.copy()
    sums = [_I[k] for k in ("numel", "nan_count", "inf_count", "zero_count")]
    sums += range(layout.counts_start, layout.extras_start)
    out[sums] = a[sums] + b[sums]  # counts and exponent counts
    na = a[0] - a[1] - a[2]
    nb = b[0] - b[1] - b[2]
    n = na + nb
    for name, fn in (
        ("min", np.minimum),
        ("min_abs", np.minimum),
        ("max", np.maximum),
        ("max_abs", np.maximum),
    ):
        out[_I[name]] = fn(a[_I[name]], b[_I[name]])
    # Rescale each part's sums from its own scale to the merged one. A part whose
    # largest magnitude is 0 has all-zero scaled sums, so its ratio may be 0.
    s = _scale(out[_I["max_abs"]])
    ra, rb = a[_I["max_abs"]] / s, b[_I["max_abs"]] / s
    ma, mb = a[_I["mean"]], b[_I["mean"]]
    if n > 0:
        # scaled before subtracting: means near the float64 max must not overflow
        delta = mb / s - ma / s
        out[_I["mean"]] = ma + delta * (nb / n) * s
        out[_I["m2"]] = a[_I["m2"]] * ra**2 + b[_I["m2"]] * rb**2 + delta**2 * (na * nb / n)
    for k in POWERS:
        i = _I[f"p{k}"]
        out[i] = a[i] * ra**k + b[i] * rb**k
    for j, (_, rule) in enumerate(layout.extras):
        i = layout.extras_start + j
        if rule == "min":
            out[i] = min(a[i], b[i])
        elif rule == "max":
            out[i] = max(a[i], b[i])
        elif rule == "sum":
            out[i] = a[i] + b[i]
        elif rule == "mean":
            total = a[0] + b[0]
            out[i] = (a[i] * a[0] + b[i] * b[0]) / total if total else 0.0
    return out


def merge_all(parts: Iterable[np.ndarray], layout: Layout) -> np.ndarray:
    """Merge any number of summaries of one layout (the empty summary if none)."""
    out = layout.empty()
    for p in parts:
        out = merge(out, p, layout)
    return out


def finalize_many(v: np.ndarray, layout: Layout) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """:func:`finalize` of a stack of summaries of one layout (rows of ``v``), vectorized.

    Returns:
        ``(stats, counts)``: ``stats`` maps each statistic name to an array over the rows
        (int64 for counts, float64 otherwise); ``counts`` is the ``(rows, num_counts)`` int64
        array of exponent counts.
    """
    v = np.atleast_2d(np.asarray(v, dtype=np.float64))
    col = {name: v[:, i] for i, name in enumerate(CORE_FIELDS)}
    numel, nan, inf, zero = (
        np.rint(col[k]).astype(np.int64) for k in ("numel", "nan_count", "inf_count", "zero_count")
    )
    n = numel - nan - inf
    has = n > 0
    nf = np.where(has, n, 1).astype(np.float64)
    s = _scale(col["max_abs"])
    with np.errstate(invalid="ignore"):
        moments = {
            "mean": col["mean"],
            "std": s * np.sqrt(np.maximum(col["m2"], 0.0) / nf),
            "mean_abs": s * (col["p1"] / nf),  # divided before scaling up: no overflow
            "min_abs": col["min_abs"],
            "max_abs": col["max_abs"],
            **{f"rm{k}": s * (col[f"p{k}"] / nf) ** (1.0 / k) for k in (2, 4, 8)},
            "min": col["min"],
            "max": col["max"],
        }
    stats: dict[str, np.ndarray] = {k: np.where(has, moments[k], np.nan) for k in moments}
    stats.update(numel=numel, zero_count=zero, nan_count=nan, inf_count=inf)
    stats = {k: stats[k] for k in DEFAULT_STATS}
    for j, (name, _) in enumerate(layout.extras):
        stats[name] = v[:, layout.extras_start + j].copy()
    counts = np.rint(v[:, layout.counts_start : layout.extras_start]).astype(np.int64)
    return stats, counts


def finalize(v: np.ndarray, layout: Layout) -> tuple[dict[str, float | int], np.ndarray]:
    """Scalar statistics and exponent counts of a summary.

    Returns:
        ``(stats, counts)``: ``stats`` maps each name of :data:`DEFAULT_STATS` (then each
        custom statistic) to its value; moments are over the finite elements, and are NaN
        when there are none. ``counts`` is the int64 exponent-count array in the order of
        :func:`exponent_labels`.
    """
    stats, counts = finalize_many(np.asarray(v, dtype=np.float64)[None, :], layout)
    return {
        k: (int(a[0]) if a.dtype.kind == "i" else float(a[0])) for k, a in stats.items()
    }, counts[0]
