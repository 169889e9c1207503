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
``m3 m4``             with ``Layout(moments=4)`` only, last: sums over finite x of
                      ((x - mean) / s)**3 and **4 (centred, scaled like ``m2``)
====================  ===========================================================

Moments are scaled by the largest magnitude so that no power overflows, whatever
the input dtype (|x|**8 overflows float32 already for |x| > 2**16); the variance is
kept as a centred sum (Chan et al.) so it stays accurate when |mean| >> std.

Skewness and kurtosis are opt-in (``Layout(moments=4)``, :data:`HIGHER_STATS`): the third
and fourth centred sums merge by Pébay's pairwise update (2008), the higher-order analogue
of Chan et al.'s, so they too are exact for micro-batches, shards, ranks and steps and stay
accurate when the mean dominates.

The wire format
---------------
This module is the one owner of the order above. Kernels that keep the counts in integers
and the values in floats (the JAX paths: int32 counts, float32 values; the host kernel
behind XLA's custom call) hold a summary as two *parts*:

- counts: the leading counts (:data:`LEADING_COUNT_FIELDS`), then the exponent counts;
- values: the core values (:data:`VALUE_FIELDS`), then the custom statistics.

:func:`split_summary` and :func:`join_summary` convert between a vector and its parts,
:func:`pack_fields` / :func:`pack_summary` build vectors from fields given by name, and
:func:`unpack_fields` reads them back by name; every position is derived from
:data:`CORE_FIELDS` (:data:`FIELD_INDEX`, :data:`COUNT_INDEX`, :data:`VALUE_INDEX`).
These helpers work on numpy, ``jax.numpy`` and torch arrays alike (the array module is
detected, or passed as ``xp``) and on stacks of summaries, shape ``(..., n)``: one
definition serves the numpy reference, the host kernel and every device kernel.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast

import numpy as np

from .formats import NumberFormat, number_format

__all__ = [
    "CORE_FIELDS",
    "N_CORE",
    "N_LEADING_COUNTS",
    "N_CORE_VALUES",
    "LEADING_COUNT_FIELDS",
    "VALUE_FIELDS",
    "FIELD_INDEX",
    "COUNT_INDEX",
    "VALUE_INDEX",
    "LEADING_COUNTS",
    "CORE_VALUES",
    "DEFAULT_STATS",
    "HIGHER_STATS",
    "HIGHER_FIELDS",
    "MERGE_RULES",
    "FIELD_RULES",
    "RULE_UFUNCS",
    "Layout",
    "summarize",
    "merge",
    "merge_all",
    "rebin",
    "finalize",
    "finalize_many",
    "unfinalize_many",
    "INVERTIBLE_STATS",
    "merge_groups",
    "exponent_bins",
    "exponent_labels",
    "array_module",
    "framework_of",
    "split_summary",
    "join_summary",
    "pack_fields",
    "unpack_fields",
    "pack_summary",
    "pack_parts",
    "append_extras",
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
#: Number of core fields: the exponent counts start here.
N_CORE: int = len(CORE_FIELDS)
#: Position of each core field in a summary vector (and in a row of a stack of them).
FIELD_INDEX: Mapping[str, int] = MappingProxyType({name: i for i, name in enumerate(CORE_FIELDS)})
_I = FIELD_INDEX
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
#: The statistics ``Layout(moments=4)`` adds after the default ones: the skewness
#: ``m3 / m2**1.5`` and the excess kurtosis ``m4 / m2**2 - 3`` of the finite elements, with
#: ``m_k`` the k-th central moment (sum divided by n): ``scipy.stats.skew`` and
#: ``scipy.stats.kurtosis`` with their defaults (biased, Fisher). NaN when the finite
#: elements are all equal, or there are none.
HIGHER_STATS: tuple[str, ...] = ("skew", "kurtosis")
#: The summary fields behind :data:`HIGHER_STATS`, at the end of a ``moments=4`` summary.
HIGHER_FIELDS: tuple[str, ...] = ("m3", "m4")

#: Default statistics that are counts (written as int64 columns).
COUNT_STATS: frozenset[str] = frozenset({"numel", "zero_count", "nan_count", "inf_count"})
#: How many fields lead :data:`CORE_FIELDS` as counts: kernels that keep counts in integers
#: apart from the float values split and join the vector here.
N_LEADING_COUNTS: int = next(i for i, f in enumerate(CORE_FIELDS) if f not in COUNT_STATS)
if any(f in COUNT_STATS for f in CORE_FIELDS[N_LEADING_COUNTS:]):  # pragma: no cover
    raise AssertionError("CORE_FIELDS: every count must lead the values")
#: The leading counts: the first fields of a summary's integer part.
LEADING_COUNT_FIELDS: tuple[str, ...] = CORE_FIELDS[:N_LEADING_COUNTS]
#: The core values (extrema, mean and scaled sums): the first fields of a summary's float part.
VALUE_FIELDS: tuple[str, ...] = CORE_FIELDS[N_LEADING_COUNTS:]
#: Number of core values: the custom statistics start here in a summary's float part.
N_CORE_VALUES: int = len(VALUE_FIELDS)
#: Where the leading counts lie, in a summary vector and in its integer part alike.
LEADING_COUNTS: slice = slice(0, N_LEADING_COUNTS)
#: Where the core values lie in a summary vector.
CORE_VALUES: slice = slice(N_LEADING_COUNTS, N_CORE)
#: Position of each leading count in a summary's integer part (exponent counts follow).
COUNT_INDEX: Mapping[str, int] = MappingProxyType(
    {name: i for i, name in enumerate(LEADING_COUNT_FIELDS)}
)
#: Position of each core value in a summary's float part (custom statistics follow).
VALUE_INDEX: Mapping[str, int] = MappingProxyType({name: i for i, name in enumerate(VALUE_FIELDS)})

#: How an extra (custom) statistic of two parts combines: ``mean`` is weighted by numel.
MERGE_RULES: tuple[str, ...] = ("sum", "min", "max", "mean")

#: How each core field of two summaries combines when they merge: the one table of the merge
#: arithmetic, which :func:`merge`, :func:`merge_groups` and the JAX tracker's on-device merge
#: follow. ``"sum"``: the counts add (exactly); ``"min"`` / ``"max"``: the extremum is kept;
#: ``"moment"``: the count-weighted mean and the centred sum of squares (Chan et al.; with
#: ``moments=4`` also ``m3``, ``m4``, Pébay), computed on the merged scale; ``"power"``: a
#: power sum scaled by the part's largest magnitude, rescaled to the merged one. The exponent
#: counts add; a custom statistic merges by its own rule (:data:`MERGE_RULES`).
FIELD_RULES: Mapping[str, str] = MappingProxyType(
    {
        **dict.fromkeys(LEADING_COUNT_FIELDS, "sum"),
        "min": "min",
        "max": "max",
        "min_abs": "min",
        "max_abs": "max",
        "mean": "moment",
        "m2": "moment",
        **{f"p{k}": "power" for k in POWERS},
    }
)
assert tuple(FIELD_RULES) == CORE_FIELDS, "FIELD_RULES must give every core field a rule"

#: The rules that merge value by value, as numpy ufuncs: ``ufunc(a, b)`` merges two values,
#: ``ufunc.at(out, groups, values)`` merges groups of them (core fields and custom statistics).
RULE_UFUNCS: Mapping[str, np.ufunc] = MappingProxyType(
    {"sum": np.add, "min": np.minimum, "max": np.maximum}
)
#: The neutral element of each rule (an empty summary's value), 0 for those not named; but
#: ``max_abs``, whose values are never negative, is 0 in an empty summary (see ``_EMPTY_CORE``).
_NEUTRAL: Mapping[str, float] = MappingProxyType({"min": np.inf, "max": -np.inf})
#: The core fields of an empty summary, the neutral element of the merge.
_EMPTY_CORE = np.array([_NEUTRAL.get(rule, 0.0) for rule in FIELD_RULES.values()])
_EMPTY_CORE[FIELD_INDEX["max_abs"]] = 0.0  # the scale of the power sums: 0 keeps them 0
_EMPTY_CORE.flags.writeable = False
#: The core fields of each value-by-value rule, by position.
_RULE_FIELDS: Mapping[str, list[int]] = MappingProxyType(
    {rule: [FIELD_INDEX[f] for f, r in FIELD_RULES.items() if r == rule] for rule in RULE_UFUNCS}
)


@dataclass(frozen=True)
class Layout:
    """Where each quantity sits in a summary vector for one number format.

    Arguments:
        format: the number format whose exponent range the counts cover (and whose
            thresholds decide underflow and overflow).
        extras: custom statistics appended after the counts, as ``(name, rule)`` pairs
            with ``rule`` one of :data:`MERGE_RULES`.
        moments: the highest central moment kept: 2 (default: the variance) or 4 (also the
            third and fourth, :data:`HIGHER_FIELDS`, after the custom statistics, for the
            skewness and kurtosis).
    """

    format: NumberFormat
    extras: tuple[tuple[str, str], ...] = field(default=())
    moments: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", number_format(self.format))
        if self.moments not in (2, 4) or isinstance(self.moments, bool):
            raise ValueError(
                f"Layout(moments={self.moments!r}): expected 2 (mean and variance) or 4 "
                f"(also skewness and kurtosis)"
            )
        for name, rule in self.extras:
            if rule not in MERGE_RULES:
                raise ValueError(
                    f"custom statistic {name!r}: merge rule {rule!r} is not one of {MERGE_RULES}"
                )
            if name in DEFAULT_STATS or name in HIGHER_STATS:
                raise ValueError(
                    f"custom statistic {name!r} clashes with a default statistic; rename it"
                )

    @property
    def counts_start(self) -> int:
        """Index of the ``-inf`` (underflow) count."""
        return N_CORE

    @property
    def num_counts(self) -> int:
        """Number of exponent counts: underflow, one per exponent, overflow."""
        return self.format.num_bins + 2

    @property
    def extras_start(self) -> int:
        """Index of the first custom statistic."""
        return self.counts_start + self.num_counts

    @property
    def higher_start(self) -> int:
        """Index of ``m3`` (with ``moments=4``; the vector's end otherwise)."""
        return self.extras_start + len(self.extras)

    @property
    def num_higher(self) -> int:
        """How many higher central moments the vector holds (0, or 2 with ``moments=4``)."""
        return len(HIGHER_FIELDS) if self.moments == 4 else 0

    @property
    def size(self) -> int:
        """Length of the summary vector."""
        return self.higher_start + self.num_higher

    @property
    def exponent_counts(self) -> slice:
        """Where the exponent counts lie in a summary vector."""
        return slice(self.counts_start, self.extras_start)

    @property
    def extra_values(self) -> slice:
        """Where the custom statistics lie in a summary vector."""
        return slice(self.extras_start, self.higher_start)

    @property
    def higher_values(self) -> slice:
        """Where ``m3`` and ``m4`` lie (an empty slice without ``moments=4``)."""
        return slice(self.higher_start, self.size)

    def empty(self) -> np.ndarray:
        """The summary of an empty tensor: the neutral element of :func:`merge`."""
        out = np.zeros(self.size, dtype=np.float64)
        out[:N_CORE] = _EMPTY_CORE
        for i, (_, rule) in enumerate(self.extras):
            out[self.extras_start + i] = _NEUTRAL.get(rule, 0.0)
        return out


# ------------------------------------------------------------------------ wire format


def framework_of(x: Any) -> str:
    """``"torch"`` for a torch tensor, ``"jax"`` for a JAX array (tracers included), else
    ``"numpy"`` (numbers, numpy arrays), read from the value's type without importing
    either framework."""
    root = type(x).__module__.partition(".")[0]
    return "jax" if root in ("jax", "jaxlib") else "torch" if root == "torch" else "numpy"


def array_module(*arrays: Any) -> Any:
    """The array module of ``arrays``: ``torch`` for torch tensors, ``jax.numpy`` for JAX
    arrays (tracers included), else ``numpy``. Neither framework is imported unless one of
    its arrays is given."""
    for a in arrays:
        framework = framework_of(a)
        if framework == "torch":
            import torch

            return torch
        if framework == "jax":
            import jax.numpy as jnp

            return jnp
    return np


def _concat(parts: Sequence[Any], xp: Any) -> Any:
    """``parts`` joined along their last axis (torch spells it ``cat(dim=)``)."""
    if len(parts) == 1:
        return parts[0]
    if xp.__name__ == "torch":
        return xp.cat(list(parts), dim=-1)
    return xp.concatenate(list(parts), axis=-1)


def _stack(parts: Sequence[Any], xp: Any) -> Any:
    """``parts`` stacked on a new last axis."""
    if xp.__name__ == "torch":
        return xp.stack(list(parts), dim=-1)
    return xp.stack(list(parts), axis=-1)


def _width(v: Any) -> int:
    return int(v.shape[-1])


def split_summary(v: Any, layout: Layout | None = None, xp: Any = None) -> tuple[Any, Any]:
    """A summary (or a stack of them, shape ``(..., n)``) as its integer and float parts.

    Arguments:
        v: summary vectors of ``layout`` (numpy, ``jax.numpy`` or torch; not copied where
            a part is one slice).
        layout: their layout; ``None`` for summaries without custom statistics whose
            exponent counts are all the columns after the core (a log's exponent columns).
        xp: the array module (default: detected from ``v``, see :func:`array_module`).

    Returns:
        ``(counts, values)``: the leading counts (:data:`LEADING_COUNT_FIELDS`) then the
        exponent counts, and the core values (:data:`VALUE_FIELDS`) then the custom
        statistics, in ``v``'s dtype (the caller casts: int32 counts, float32 values, ...).

    Raises:
        ValueError: if ``v``'s last axis is not ``layout.size`` long.
    """
    xp = array_module(v) if xp is None else xp
    n = _width(v)
    end = N_CORE if layout is None else layout.extras_start
    if (layout is not None and n != layout.size) or n < end:
        want = f"{layout.size} values (the layout's)" if layout else f"at least {N_CORE}"
        raise ValueError(f"split_summary: summaries of {n} values; expected {want}")
    if layout is None:
        end = n
    counts = _concat([v[..., LEADING_COUNTS], v[..., N_CORE:end]], xp)
    values = _concat([v[..., CORE_VALUES], v[..., end:]], xp) if end < n else v[..., CORE_VALUES]
    return counts, values


def join_summary(counts: Any, values: Any, xp: Any = None) -> Any:
    """The summary vectors (shape ``(..., n)``) of the parts :func:`split_summary` gives, in
    the dtype the array module promotes the parts to (cast them first for float64).

    Raises:
        ValueError: if a part is shorter than its core fields.
    """
    xp = array_module(counts, values) if xp is None else xp
    if _width(counts) < N_LEADING_COUNTS or _width(values) < N_CORE_VALUES:
        raise ValueError(
            f"join_summary: parts of {_width(counts)} counts and {_width(values)} values; "
            f"expected at least {N_LEADING_COUNTS} and {N_CORE_VALUES}"
        )
    return _concat(
        [
            counts[..., :N_LEADING_COUNTS],
            values[..., :N_CORE_VALUES],
            counts[..., N_LEADING_COUNTS:],
            values[..., N_CORE_VALUES:],
        ],
        xp,
    )


def unpack_fields(v: Any, names: Sequence[str] = CORE_FIELDS) -> dict[str, Any]:
    """``{name: v[..., i]}`` for the ``i``-th of ``names``: the named fields of a vector or
    of a stack of them (views where the array module gives views). ``names`` is
    :data:`CORE_FIELDS` for a summary, :data:`LEADING_COUNT_FIELDS` for its integer part,
    :data:`VALUE_FIELDS` for its float part, or a kernel's own record of partial results."""
    if _width(v) < len(names):
        raise ValueError(f"unpack_fields: {_width(v)} values hold no field {names[_width(v)]!r}")
    return {name: v[..., i] for i, name in enumerate(names)}


def pack_fields(
    fields: Mapping[str, Any], names: Sequence[str] = CORE_FIELDS, xp: Any = None
) -> Any:
    """The arrays ``fields`` (all of one shape) stacked on a new last axis in the order of
    ``names``, the inverse of :func:`unpack_fields`.

    Raises:
        ValueError: if ``fields`` lacks one of ``names`` or holds another name.
    """
    if set(fields) != set(names):
        missing = [n for n in names if n not in fields]
        unknown = [n for n in fields if n not in names]
        raise ValueError(f"pack_fields: missing fields {missing}, unknown fields {unknown}")
    parts = [fields[n] for n in names]
    return _stack(parts, array_module(*parts) if xp is None else xp)


def pack_summary(
    core: Mapping[str, Any], exponent_counts: Any, extras: Any = None, xp: Any = None
) -> Any:
    """Summary vectors from their core fields by name (:data:`CORE_FIELDS`, each of shape
    ``(...)``), their exponent counts ``(..., num_counts)`` and their custom statistics
    ``(..., len(extras))`` (``None``: none)."""
    xp = array_module(exponent_counts, *core.values()) if xp is None else xp
    parts = [pack_fields(core, CORE_FIELDS, xp), exponent_counts]
    return _concat(parts if extras is None else [*parts, extras], xp)


def pack_parts(
    core: Mapping[str, Any], exponent_counts: Any, extras: Any = None, xp: Any = None
) -> tuple[Any, Any]:
    """The integer and float parts (as :func:`split_summary` gives them) of summaries given
    by their core fields by name (:data:`CORE_FIELDS`), their exponent counts and custom
    statistics (``None``: none). The leading counts are stacked apart from the values, so
    each part keeps its own dtype (int32 counts and float32 values stay so).

    Raises:
        ValueError: if ``core`` lacks one of :data:`CORE_FIELDS` or holds another name.
    """
    if set(core) != set(CORE_FIELDS):
        pack_fields(core, CORE_FIELDS)  # raises, naming the difference
    xp = array_module(exponent_counts, *core.values()) if xp is None else xp
    leading = pack_fields({k: core[k] for k in LEADING_COUNT_FIELDS}, LEADING_COUNT_FIELDS, xp)
    values = pack_fields({k: core[k] for k in VALUE_FIELDS}, VALUE_FIELDS, xp)
    counts = _concat([leading, exponent_counts], xp)
    return counts, values if extras is None else _concat([values, extras], xp)


def append_extras(v: Any, extras: Any, xp: Any = None) -> Any:
    """Summaries ``v`` (or a summary's float part) with the custom statistics ``extras``
    (shape ``(..., k)``) appended: the position the layout gives them, after the rest."""
    return _concat([v, extras], array_module(v, extras) if xp is None else xp)


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
    moments: int = 2,
) -> tuple[np.ndarray, Layout]:
    """Summary of the array ``x`` (numpy reference; the framework kernels must agree).

    Arguments:
        x: any array numpy can hold, including ml_dtypes types (bfloat16, float8_*).
        fmt: the number format for the exponent counts; default ``x``'s own dtype.
        extras: already-computed custom statistics, ``{name: (value, merge_rule)}``.
        moments: 4 to keep the third and fourth central moments too (skewness, kurtosis).

    Returns:
        ``(vector, layout)``.
    """
    arr = np.asarray(x)
    layout = Layout(
        number_format(arr.dtype if fmt is None else fmt),
        tuple((k, r) for k, (_, r) in (extras or {}).items()),
        moments,
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
        d = fin / scale - mean / scale
        v[_I["m2"]] = np.sum(d**2)
        for k in POWERS:
            v[_I[f"p{k}"]] = np.sum((a / scale) ** k)
        if layout.num_higher:
            v[layout.higher_values] = higher_sums(d)
    v[layout.exponent_counts] = exponent_bins(flat, layout.format)
    v[layout.extra_values] = [float(value) for value, _ in (extras or {}).values()]
    return v, layout


def higher_sums(d: np.ndarray) -> tuple[float, float]:
    """``(sum(d**3), sum(d**4))`` of centred values ``d`` (``(x - mean) / s``), corrected for
    the rounding of the mean: ``d``'s own mean ``e`` (zero but for rounding) is taken out,
    ``sum((d - e)**3) = S3 - 3 e S2 + 2 n e**3`` and likewise for the fourth power."""
    d = np.asarray(d, dtype=np.float64)
    if d.size == 0:
        return 0.0, 0.0
    n = d.size
    e = float(d.mean())
    d2 = d * d
    s2, s3, s4 = float(d2.sum()), float((d2 * d).sum()), float((d2 * d2).sum())
    m3 = s3 - 3.0 * e * s2 + 2.0 * n * e**3
    m4 = s4 - 4.0 * e * s3 + 6.0 * e * e * s2 - 3.0 * n * e**4
    return m3, m4


def merge_higher(
    na: Any, nb: Any, delta: Any, a2: Any, a3: Any, a4: Any, b2: Any, b3: Any, b4: Any
) -> tuple[Any, Any]:
    """Pébay's merge of two parts' centred sums (all on one scale): ``delta`` is the
    difference of their means, ``na``, ``nb`` their counts. Returns ``(M3, M4)``. Numbers or
    arrays of any array module (numpy, ``jax.numpy`` in :func:`merge_jax`, torch)."""
    n = na + nb
    dn = delta / array_module(n).where(n > 0, n, 1.0)
    m3 = a3 + b3 + delta * dn * dn * na * nb * (na - nb) + 3.0 * dn * (na * b2 - nb * a2)
    m4 = (
        a4
        + b4
        + delta * dn**3 * na * nb * (na * na - na * nb + nb * nb)
        + 6.0 * dn * dn * (na * na * b2 + nb * nb * a2)
        + 4.0 * dn * (na * b3 - nb * a3)
    )
    return m3, m4


def _scale(s: np.ndarray | float) -> Any:
    return np.where(np.asarray(s) > 0, s, 1.0)


def _n_finite(v: Any) -> Any:
    """Finite elements of summaries ``v`` (shape ``(..., n)``): numel less NaN and inf."""
    return v[..., _I["numel"]] - v[..., _I["nan_count"]] - v[..., _I["inf_count"]]


def merge(a: np.ndarray, b: np.ndarray, layout: Layout) -> np.ndarray:
    """The summary of the union of two tensors' elements, from their summaries.

    ``merge(summarize(x), summarize(y)) == summarize(concat(x, y))`` up to rounding;
    counts, extrema and exponent counts exactly.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    out: np.ndarray = a.copy()
    for rule, ufunc in RULE_UFUNCS.items():  # counts add, extrema are kept (FIELD_RULES)
        idx = _RULE_FIELDS[rule]
        out[idx] = ufunc(a[idx], b[idx])
    counts = layout.exponent_counts
    out[counts] = a[counts] + b[counts]
    na = _n_finite(a)
    nb = _n_finite(b)
    n = na + nb
    # Rescale each part's sums from its own scale to the merged one. A part whose
    # largest magnitude is 0 has all-zero scaled sums, so its ratio may be 0.
    s = _scale(out[_I["max_abs"]])
    ra, rb = a[_I["max_abs"]] / s, b[_I["max_abs"]] / s
    ma, mb = a[_I["mean"]], b[_I["mean"]]
    if n > 0:
        # scaled before subtracting: means near the float64 max must not overflow
        delta = mb / s - ma / s
        out[_I["mean"]] = ma + delta * (nb / n) * s
        a2, b2 = a[_I["m2"]] * ra**2, b[_I["m2"]] * rb**2
        out[_I["m2"]] = a2 + b2 + delta**2 * (na * nb / n)
        if layout.num_higher:
            i3, i4 = layout.higher_start, layout.higher_start + 1
            out[i3], out[i4] = merge_higher(
                na, nb, delta, a2, a[i3] * ra**3, a[i4] * ra**4, b2, b[i3] * rb**3, b[i4] * rb**4
            )
    for k in POWERS:
        i = _I[f"p{k}"]
        out[i] = a[i] * ra**k + b[i] * rb**k
    wa, wb = a[_I["numel"]], b[_I["numel"]]
    for j, (_, rule) in enumerate(layout.extras):
        i = layout.extras_start + j
        if rule in RULE_UFUNCS:
            out[i] = RULE_UFUNCS[rule](a[i], b[i])
        else:  # "mean", weighted by numel
            total = wa + wb
            out[i] = (a[i] * wa + b[i] * wb) / total if total else 0.0
    return out


def merge_all(parts: Iterable[np.ndarray], layout: Layout) -> np.ndarray:
    """Merge any number of summaries of one layout (the empty summary if none)."""
    out = layout.empty()
    for p in parts:
        out = merge(out, p, layout)
    return out


def rebin(v: np.ndarray, src: Layout, dst: Layout) -> np.ndarray | None:
    """Summary ``v`` of layout ``src`` in layout ``dst``, or ``None`` where that is not
    exact: the formats' exponent ranges must nest and ``v`` must count no underflow and no
    finite overflow of its own format.

    What lets a tensor seen in two dtypes within a step (a shared module fed float32 and
    bfloat16) keep one row, in the wider format: the exponent counts move to the wider
    format's bins, every other field keeps its value.
    """
    if src == dst:
        return v
    f, g = src.format, dst.format
    nested = (
        src.extras == dst.extras
        and src.moments == dst.moments
        and g.min_exponent <= f.min_exponent
        and g.max_exponent >= f.max_exponent
        and g.max >= f.max
    )
    counts = v[src.exponent_counts]
    inf = v[FIELD_INDEX["inf_count"]]
    if not nested or counts[0] != 0 or counts[-1] != inf:
        return None
    out = dst.empty()
    out[: src.counts_start] = v[: src.counts_start]
    first = dst.counts_start + 1 + f.min_exponent - g.min_exponent
    out[first : first + f.num_bins] = counts[1:-1]
    out[dst.extras_start - 1] = inf
    out[dst.extra_values] = v[src.extra_values]
    out[dst.higher_values] = v[src.higher_values]  # m3, m4 (scaled by the same max)
    return out


def _empty_rows(rows: int, width: int, layout: Layout | None) -> np.ndarray:
    """``rows`` empty summaries of ``width`` values (of ``layout``, or layout-free)."""
    if layout is not None:
        return np.tile(layout.empty(), (rows, 1))
    out = np.zeros((rows, width))
    out[:, :N_CORE] = _EMPTY_CORE
    return out


def _checked_rows(v: Any, layout: Layout | None, what: str) -> np.ndarray:
    """``v`` as a 2-D float64 stack of summaries, its width checked against ``layout``."""
    v = np.asarray(v, dtype=np.float64)
    rows: np.ndarray = v.reshape(-1, v.shape[-1]) if v.ndim > 1 else v[None, :]
    want = N_CORE if layout is None else layout.size
    if (rows.shape[1] < want) if layout is None else (rows.shape[1] != want):
        raise ValueError(
            f"{what}: summaries of {rows.shape[1]} values; expected "
            + (f"at least {N_CORE}" if layout is None else f"{want} (the layout's size)")
        )
    return rows


def _num_higher(layout: Layout | None, moments: int) -> int:
    """How many higher central moments summaries of ``layout`` (or layout-free summaries
    with ``moments``) end with."""
    if layout is not None:
        return layout.num_higher
    if moments not in (2, 4):
        raise ValueError(f"moments={moments!r}: expected 2 or 4")
    return len(HIGHER_FIELDS) if moments == 4 else 0


def merge_groups(
    v: Any,
    groups: Any,
    layout: Layout | None = None,
    num_groups: int | None = None,
    moments: int = 2,
) -> np.ndarray:
    """Merge the summaries ``v`` (rows) by group, vectorized: row ``i`` of the result is the
    summary of the union of the rows ``r`` with ``groups[r] == i`` (the empty summary for a
    group without rows).

    The same merge as :func:`merge` in one step per group rather than pairwise: counts and
    exponent counts add (exactly), extrema take the min/max, the mean is the count-weighted
    mean, the centred sum of squares adds each part's (rescaled) and the spread of the
    parts' means (Chan et al.), and the power sums are rescaled from each part's largest
    magnitude to the group's, so nothing overflows. Results equal :func:`merge_all`'s up to
    rounding.

    Arguments:
        v: summaries of ``layout``, shape ``(rows, layout.size)``.
        groups: the group of each row, integers in ``[0, num_groups)``.
        layout: their layout; ``None`` for summaries without custom statistics whose
            exponent counts are every column after the core (a log's exponent columns).
        num_groups: how many groups (default: ``max(groups) + 1``).
        moments: with ``layout=None``, 4 when the summaries end with ``m3``, ``m4``.

    Returns:
        A ``(num_groups, v.shape[1])`` float64 array of summaries.

    Raises:
        ValueError: if ``v`` does not fit ``layout``, or ``groups`` does not give one group
            in range for each row.
    """
    v = _checked_rows(v, layout, "merge_groups")
    g = np.asarray(groups)
    if g.shape != (v.shape[0],) or (g.size and g.dtype.kind not in "iu"):
        raise ValueError(
            f"merge_groups: groups must be one integer per row ({v.shape[0]}); "
            f"got shape {g.shape}, dtype {g.dtype}"
        )
    k = (int(g.max()) + 1 if g.size else 0) if num_groups is None else int(num_groups)
    if g.size and (g.min() < 0 or g.max() >= k):
        raise ValueError(f"merge_groups: groups must lie in [0, {k}); got {g.min()}..{g.max()}")
    width = v.shape[1]
    extras = () if layout is None else layout.extras
    high = _num_higher(layout, moments)
    ends = width - len(extras) - high
    out = _empty_rows(k, width, layout)
    col = unpack_fields(v)
    sums = [*_RULE_FIELDS["sum"], *range(N_CORE, ends)]  # counts and exponent counts
    acc = np.zeros((k, len(sums)))
    np.add.at(acc, g, v[:, sums])  # counts: integers, added exactly in float64
    out[:, sums] = acc
    for rule in ("min", "max"):  # the extrema (FIELD_RULES)
        for i in _RULE_FIELDS[rule]:
            RULE_UFUNCS[rule].at(out[:, i], g, v[:, i])
    n_i = _n_finite(v)
    n = np.zeros(k)
    np.add.at(n, g, n_i)
    has = n > 0
    nf = np.where(has, n, 1.0)
    scale = _scale(out[:, _I["max_abs"]])
    s = scale[g]
    r = col["max_abs"] / s  # each row's scale relative to its group's
    mean_s = np.zeros(k)
    np.add.at(mean_s, g, n_i * (col["mean"] / s))  # scaled: no overflow near the float max
    mean_s /= nf
    spread = np.zeros(k)
    np.add.at(spread, g, col["m2"] * r**2 + n_i * (col["mean"] / s - mean_s[g]) ** 2)
    out[:, _I["mean"]] = np.where(has, mean_s * scale, 0.0)
    out[:, _I["m2"]] = np.where(has, spread, 0.0)
    if high:
        # each row's centred sums moved to the group's mean: with d the row's mean less the
        # group's, sum((x - mean_g)**k) expands binomially in d (exact)
        d = col["mean"] / s - mean_s[g]
        out[:, width - 2], out[:, width - 1] = _group_higher(
            v[:, width - 2 :], col["m2"], r, d, n_i, g, k, has
        )
    for p in POWERS:
        i = _I[f"p{p}"]
        acc1 = np.zeros(k)
        np.add.at(acc1, g, col[f"p{p}"] * r**p)
        out[:, i] = acc1
    _group_extras(out, v, extras, ends, col["numel"], g, k)
    return out


def _group_higher(
    m34: np.ndarray, m2: Any, r: Any, d: Any, n_i: Any, g: Any, k: int, has: Any
) -> tuple[np.ndarray, np.ndarray]:
    """The groups' ``m3``, ``m4`` (:func:`merge_groups`) from the rows' (``m34``), ``m2``,
    ratios ``r`` of their scales to their group's, and ``d``, their means less their
    group's (on the group's scale)."""
    m2r = m2 * r**2
    m3r = m34[:, 0] * r**3
    m4r = m34[:, 1] * r**4
    acc3 = np.zeros(k)
    acc4 = np.zeros(k)
    np.add.at(acc3, g, m3r + 3.0 * d * m2r + n_i * d**3)
    np.add.at(acc4, g, m4r + 4.0 * d * m3r + 6.0 * d * d * m2r + n_i * d**4)
    return np.where(has, acc3, 0.0), np.where(has, acc4, 0.0)


def _group_extras(
    out: np.ndarray,
    v: np.ndarray,
    extras: Sequence[tuple[str, str]],
    start: int,
    numel: Any,
    g: Any,
    k: int,
) -> None:
    """Merge the custom statistics (columns ``start`` on) of the rows ``v`` by group into
    ``out``, each by its rule; ``mean`` weighted by ``numel``."""
    weight = np.zeros(k)
    np.add.at(weight, g, numel)
    for j, (_, rule) in enumerate(extras):
        i = start + j
        if rule in RULE_UFUNCS:
            RULE_UFUNCS[rule].at(out[:, i], g, v[:, i])
        else:  # "mean", weighted by numel
            acc1 = np.zeros(k)
            np.add.at(acc1, g, v[:, i] * numel)
            out[:, i] = np.where(weight > 0, acc1 / np.where(weight > 0, weight, 1.0), 0.0)


def finalize_many(
    v: np.ndarray,
    layout: Layout | None = None,
    moments: int = 2,
    counts_out: np.ndarray | None = None,
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """:func:`finalize` of a stack of summaries of one layout (rows of ``v``), vectorized.

    ``layout=None`` reads summaries without custom statistics whose exponent counts are
    every column after the core (as :func:`merge_groups` and :func:`unfinalize_many` make
    them from a log's exponent columns), and with ``moments=4`` end with ``m3``, ``m4``.

    ``counts_out``: an int64 array of ``(rows, num_counts)`` to round the exponent counts
    into (the log's writer keeps one from batch to batch: a fresh one is megabytes of new
    memory each time); ``None``: a new array.

    Returns:
        ``(stats, counts)``: ``stats`` maps each statistic name to an array over the rows
        (int64 for counts, float64 otherwise); ``counts`` is the ``(rows, num_counts)`` int64
        array of exponent counts (``counts_out`` where given).
    """
    v = np.atleast_2d(np.asarray(v, dtype=np.float64))
    col = unpack_fields(v)
    numel, nan, inf, zero = (np.rint(col[k]).astype(np.int64) for k in LEADING_COUNT_FIELDS)
    n = numel - nan - inf
    has = n > 0
    nf = np.where(has, n, 1).astype(np.float64)
    s = _scale(col["max_abs"])
    with np.errstate(invalid="ignore"):
        finished = {
            "mean": col["mean"],
            "std": s * np.sqrt(np.maximum(col["m2"], 0.0) / nf),
            "mean_abs": s * (col["p1"] / nf),  # divided before scaling up: no overflow
            "min_abs": col["min_abs"],
            "max_abs": col["max_abs"],
            **{f"rm{k}": s * (col[f"p{k}"] / nf) ** (1.0 / k) for k in (2, 4, 8)},
            "min": col["min"],
            "max": col["max"],
        }
    stats: dict[str, np.ndarray] = {k: np.where(has, finished[k], np.nan) for k in finished}
    stats.update(numel=numel, zero_count=zero, nan_count=nan, inf_count=inf)
    stats = {k: stats[k] for k in DEFAULT_STATS}
    extras = () if layout is None else layout.extras
    high = _num_higher(layout, moments)
    ends = v.shape[1] - len(extras) - high
    if high:
        m2 = np.maximum(col["m2"], 0.0) / nf
        ok = has & (m2 > 0)
        m2s = np.where(ok, m2, 1.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            stats["skew"] = np.where(ok, (v[:, -2] / nf) / m2s**1.5, np.nan)
            stats["kurtosis"] = np.where(ok, (v[:, -1] / nf) / m2s**2 - 3.0, np.nan)
    for j, (name, _) in enumerate(extras):
        stats[name] = v[:, ends + j].copy()
    # rounded straight into int64 (one pass over the counts, the widest part of a row)
    shape = (v.shape[0], ends - N_CORE)
    if counts_out is None:
        counts = np.empty(shape, dtype=np.int64)
    elif counts_out.shape != shape or counts_out.dtype != np.int64:
        raise ValueError(
            f"finalize_many(counts_out=...): expected an int64 array of shape {shape}; got "
            f"{counts_out.dtype} {counts_out.shape}"
        )
    else:
        counts = counts_out
    np.rint(v[:, N_CORE:ends], out=counts, casting="unsafe")
    return stats, counts


#: The statistics of a log row :func:`unfinalize_many` rebuilds a summary from.
#: (the counts, extrema and mean are fields of the summary itself; the rest are moments)
INVERTIBLE_STATS: tuple[str, ...] = CORE_FIELDS[: CORE_FIELDS.index("mean") + 1] + (
    "std",
    "mean_abs",
    "rm2",
    "rm4",
    "rm8",
)


def unfinalize_many(
    stats: Mapping[str, Any], counts: Any, layout: Layout | None = None, moments: int = 2
) -> np.ndarray:
    """Summary vectors rebuilt from finished statistics, the inverse of :func:`finalize_many`:
    what lets rows of a log merge as their tensors' summaries would.

    Each field comes back from what a row stores: the counts and extrema as they are, ``m2``
    from ``std`` (``n * (std / s)**2``), ``p1`` from ``mean_abs`` (``n * mean_abs / s``),
    ``pK`` from ``rmK`` (``n * (rmK / s)**K``), with ``n`` the finite elements and ``s`` the
    largest magnitude (1 when 0); a row without finite elements (NaN moments) gets the
    empty summary's moments and extrema. So ``unfinalize_many(*finalize_many(v)) == v`` up
    to rounding (a few units in the last place; ``p8`` from ``rm8`` carries eight times the
    rounding of ``rm8``).

    What cannot come back: statistics a summary does not hold (percentiles, and custom
    statistics without a merge rule in ``layout``); and precision the row lost (a log that
    stored float32 moments gives float32-accurate sums).

    Arguments:
        stats: per statistic name, one value per row: :data:`INVERTIBLE_STATS`, and the
            custom statistics of ``layout.extras`` (stored as their summary fields).
        counts: ``(rows, num_counts)`` exponent counts (``layout.num_counts`` wide; any
            width when ``layout`` is ``None``: a log's exponent columns).
        layout: the summaries' layout, or ``None`` for summaries without custom statistics
            whose exponent counts are ``counts``' columns, whatever they are.
        moments: with ``layout=None``, 4 to rebuild ``m3``, ``m4`` from ``skew`` and
            ``kurtosis`` too (a layout says so itself).

    Returns:
        A float64 array ``(rows, N_CORE + num_counts + len(extras))`` of summaries.

    Raises:
        ValueError: naming a missing statistic, or when shapes disagree.
    """
    c = np.asarray(counts, dtype=np.float64)
    c = c.reshape(-1, c.shape[-1]) if c.ndim > 1 else c[None, :]
    rows = c.shape[0]
    names = [name for name, _ in (() if layout is None else layout.extras)]
    higher = bool(_num_higher(layout, moments))
    missing = [k for k in (*INVERTIBLE_STATS, *names, *(HIGHER_STATS if higher else ()))]
    missing = [k for k in missing if k not in stats]
    if missing:
        raise ValueError(f"unfinalize_many: no statistics {missing} to rebuild summaries from")
    if layout is not None and c.shape[1] != layout.num_counts:
        raise ValueError(
            f"unfinalize_many: {c.shape[1]} exponent counts per row; the layout has "
            f"{layout.num_counts}"
        )
    col = {}
    for k in (*INVERTIBLE_STATS, *names, *(HIGHER_STATS if higher else ())):
        a = np.asarray(stats[k], dtype=np.float64).reshape(-1)
        if a.size != rows:
            raise ValueError(
                f"unfinalize_many: statistic {k!r} has {a.size} values for {rows} rows"
            )
        col[k] = a
    n = col["numel"] - col["nan_count"] - col["inf_count"]
    has = n > 0
    s = _scale(np.where(has, col["max_abs"], 0.0))
    with np.errstate(invalid="ignore"):
        rebuilt = {
            "min": (col["min"], np.inf),
            "max": (col["max"], -np.inf),
            "min_abs": (col["min_abs"], np.inf),
            "max_abs": (col["max_abs"], 0.0),
            "mean": (col["mean"], 0.0),
            "m2": (n * (col["std"] / s) ** 2, 0.0),
            "p1": (n * (col["mean_abs"] / s), 0.0),
            **{f"p{k}": (n * (col[f"rm{k}"] / s) ** k, 0.0) for k in POWERS if k > 1},
        }
    core = {k: np.where(has, value, empty) for k, (value, empty) in rebuilt.items()}
    core.update({k: col[k] for k in LEADING_COUNT_FIELDS})
    tail = [col[k] for k in names]
    if higher:
        m2n = core["m2"] / np.where(has, n, 1.0)  # the scaled second central moment
        with np.errstate(invalid="ignore"):
            m3 = n * col["skew"] * m2n**1.5
            m4 = n * (col["kurtosis"] + 3.0) * m2n**2
        tail += [np.where(has & np.isfinite(m3), m3, 0.0), np.where(has & np.isfinite(m4), m4, 0.0)]
    extras = np.stack(tail, axis=-1) if tail else None
    return cast(np.ndarray, pack_summary(core, c, extras, np))


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
