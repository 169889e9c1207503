"""The framework-neutral snapshot: named tensors with arithmetic, norms and ``describe``.

A :class:`Snapshot` maps names (parameter paths, module paths) to tensors of one kind (weights,
gradients, one optimizer-state entry, activations) or to plain numbers (a layerwise norm). The
values stay in their own framework and on their own device: arithmetic uses the arrays' own
operators, and only :meth:`Snapshot.describe` copies to the host, where the statistics are those
of :func:`tandv.stats.summarize` / :func:`tandv.stats.finalize`, exactly as in a tandv log.
Which framework a value belongs to is read from its type, so this module imports neither torch
nor JAX; their operations live in :mod:`tandv.snapshot._ops`, which imports a framework the
first time one of its arrays is seen.
"""

from __future__ import annotations

import math
import numbers
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, overload

import numpy as np
import pandas as pd

from ..stats import DEFAULT_STATS, finalize, merge_all, summarize
from ._ops import ops_for

__all__ = ["Snapshot", "sqrt", "DESCRIBE_COLUMNS", "EXTRA_COLUMNS"]

#: Columns :meth:`Snapshot.describe` returns by default, in order: the tensor's shape and dtype,
#: the log's default statistics (:data:`tandv.stats.DEFAULT_STATS`), and ``norm``, the L2 norm
#: of the finite elements (``rm2 * sqrt(numel - nan_count - inf_count)``).
DESCRIBE_COLUMNS: tuple[str, ...] = ("shape", "dtype", *DEFAULT_STATS, "norm")

#: Further columns :meth:`Snapshot.describe` gives when ``include`` names them (nnstat's
#: ``describe`` columns), all over the finite elements: ``norm1`` the L1 norm, ``sum``,
#: ``var`` the variance (``M2 / (n - ddof)``), ``skew`` the sample skewness ``m3 / m2**1.5``
#: and ``kurtosis`` the excess kurtosis ``m4 / m2**2 - 3`` (``m_k`` the k-th central moment,
#: divided by ``n``: ``scipy.stats.skew`` / ``scipy.stats.kurtosis`` with their defaults, as
#: nnstat computes them; NaN when all values are equal).
EXTRA_COLUMNS: tuple[str, ...] = ("norm1", "sum", "var", "skew", "kurtosis")


def _is_scalar(x: Any) -> bool:
    return isinstance(x, numbers.Number) or (isinstance(x, np.ndarray) and x.ndim == 0)


def _check_p(p: float) -> float:
    if not isinstance(p, numbers.Real) or isinstance(p, bool) or not (p > 0):
        raise ValueError(f"norm(p=...): p must be a positive number or math.inf, got {p!r}")
    return float(p)


class Snapshot(Mapping[str, Any]):
    """Named tensors (or numbers) of one kind, in model order, with arithmetic and statistics.

    Build one with the adapters (``tandv.snapshot.torch.from_weight(model)``,
    ``tandv.snapshot.jax.from_grad(grads)``, ...) or directly from a mapping of arrays.

    * It is a read-only mapping: ``snap["fc1.weight"]``, ``len(snap)``, ``snap.keys()``;
      :meth:`at` gives the i-th value.
    * ``+ - * / **``, unary ``-`` and ``abs()`` apply per name between two snapshots with the
      same names (in any order; the left one's order is kept) or between a snapshot and a
      number; :func:`sqrt` / :meth:`sqrt` likewise. A snapshot of numbers (a layerwise norm)
      combines with a snapshot of tensors per name: ``update / weight.norm(layerwise=True)``.
      Numbers combine in IEEE float64 arithmetic, like tensors: nnstat's trust-ratio one-liner
      ``update.norm(2, layerwise=True) / W.norm(2, layerwise=True)`` gives ``inf`` where a
      layer's norm is 0 (a zero-initialised bias) and ``nan`` for ``0 / 0``, as
      :func:`tandv.quantities.update_ratio` does, not ``ZeroDivisionError``.
    * Integer and boolean tensors (BatchNorm's ``num_batches_tracked`` in a state_dict) are
      kept as they are; :meth:`norm` and :meth:`describe` read them as float64.
    * :meth:`norm` and :meth:`describe` reduce it.

    Arguments:
        values: the name -> value mapping (kept in its order).
        name: a label for printing and for the whole-snapshot row of :meth:`describe`.
    """

    def __init__(self, values: Mapping[str, Any], name: str = "snapshot") -> None:
        if not isinstance(values, Mapping):
            raise TypeError(
                f"Snapshot(values=...): expected a mapping of name -> array, got "
                f"{type(values).__name__}"
            )
        self._values: dict[str, Any] = dict(values)
        self.name = name

    # -- mapping ---------------------------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        try:
            return self._values[key]
        except KeyError:
            raise KeyError(
                f"{key!r} is not in snapshot {self.name!r}; it holds {_few(self._values)}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def at(self, i: int) -> Any:
        """The value at position ``i`` in model order (negative counts from the end)."""
        keys = list(self._values)
        if not -len(keys) <= i < len(keys):
            raise IndexError(f"at({i}): snapshot {self.name!r} holds {len(keys)} values")
        return self._values[keys[i]]

    def filter(self, pattern: str | None = None, include: Iterable[str] | None = None) -> Snapshot:
        """The values whose names match ``pattern`` (a regular expression, ``re.search``) and
        are in ``include`` (exact names), in model order. Raises if nothing is left."""
        keep = list(self._values)
        if pattern is not None:
            rx = re.compile(pattern)
            keep = [k for k in keep if rx.search(k)]
        if include is not None:
            wanted = [include] if isinstance(include, str) else list(include)
            unknown = [k for k in wanted if k not in self._values]
            if unknown:
                raise KeyError(
                    f"include={unknown!r}: not in snapshot {self.name!r}; it holds "
                    f"{_few(self._values)}"
                )
            keep = [k for k in keep if k in wanted]
        if not keep:
            raise ValueError(
                f"pattern={pattern!r} matches no name of snapshot {self.name!r}; it "
                f"holds {_few(self._values)}"
            )
        return Snapshot({k: self._values[k] for k in keep}, self.name)

    def clone(self) -> Snapshot:
        """A copy whose tensors later in-place updates (an optimizer step) do not change."""
        return Snapshot({k: ops_for(v).clone(v) for k, v in self._values.items()}, self.name)

    def numpy(self) -> Snapshot:
        """The same values on the host as numpy arrays (float32 for dtypes numpy lacks, such as
        torch's bfloat16). Arrays already in CPU memory may be shared, not copied: call
        :meth:`clone` first to freeze them."""
        return Snapshot({k: ops_for(v).to_numpy(v)[0] for k, v in self._values.items()}, self.name)

    # -- arithmetic ------------------------------------------------------------------------
    def _zip(self, other: Any, op: Callable[[Any, Any], Any], reverse: bool, sym: str) -> Snapshot:
        if isinstance(other, Snapshot):
            if set(other._values) != set(self._values):
                missing = [k for k in self._values if k not in other._values]
                extra = [k for k in other._values if k not in self._values]
                raise ValueError(
                    f"snapshot {self.name!r} {sym} snapshot {other.name!r}: the names differ "
                    f"(only left: {_few(missing)}; only right: {_few(extra)}); select the same "
                    f"tensors on both sides, e.g. with .filter(include=other.keys())"
                )
            pairs = {k: (v, other._values[k]) for k, v in self._values.items()}
        elif _is_scalar(other):
            pairs = {k: (v, other) for k, v in self._values.items()}
        else:
            raise TypeError(
                f"snapshot {sym} {type(other).__name__}: a snapshot combines with "
                f"another snapshot or a number, not with {type(other).__name__}; "
                f"wrap per-name tensors in a Snapshot first"
            )
        out = {
            k: (_apply(op, b, a) if reverse else _apply(op, a, b)) for k, (a, b) in pairs.items()
        }
        return Snapshot(out, self.name)

    def __add__(self, o: Any) -> Snapshot:
        return self._zip(o, operator.add, False, "+")

    def __radd__(self, o: Any) -> Snapshot:
        return self._zip(o, operator.add, True, "+")

    def __sub__(self, o: Any) -> Snapshot:
        return self._zip(o, operator.sub, False, "-")

    def __rsub__(self, o: Any) -> Snapshot:
        return self._zip(o, operator.sub, True, "-")

    def __mul__(self, o: Any) -> Snapshot:
        return self._zip(o, operator.mul, False, "*")

    def __rmul__(self, o: Any) -> Snapshot:
        return self._zip(o, operator.mul, True, "*")

    def __truediv__(self, o: Any) -> Snapshot:
        return self._zip(o, operator.truediv, False, "/")

    def __rtruediv__(self, o: Any) -> Snapshot:
        return self._zip(o, operator.truediv, True, "/")

    def __pow__(self, o: Any) -> Snapshot:
        return self._zip(o, operator.pow, False, "**")

    def __rpow__(self, o: Any) -> Snapshot:
        return self._zip(o, operator.pow, True, "**")

    def __neg__(self) -> Snapshot:
        return Snapshot({k: -v for k, v in self._values.items()}, self.name)

    def __abs__(self) -> Snapshot:
        return Snapshot({k: abs(v) for k, v in self._values.items()}, self.name)

    def sqrt(self) -> Snapshot:
        """Elementwise square root of every value (see :func:`sqrt`)."""
        return Snapshot({k: ops_for(v).sqrt(v) for k, v in self._values.items()}, self.name)

    # -- reductions ------------------------------------------------------------------------
    @overload
    def norm(self, p: float = 2, layerwise: Literal[False] = False) -> float: ...
    @overload
    def norm(self, p: float = 2, *, layerwise: Literal[True]) -> Snapshot: ...
    @overload
    def norm(self, p: float, layerwise: Literal[True]) -> Snapshot: ...
    @overload
    def norm(self, p: float = 2, layerwise: bool = False) -> float | Snapshot: ...
    def norm(self, p: float = 2, layerwise: bool = False) -> float | Snapshot:
        """The p-norm of all elements together, or of each value (``layerwise=True``: a
        snapshot of floats, which combines with other snapshots per name).

        The norm is taken over the elements as one vector (not an operator norm); ``p`` is a
        positive number or ``math.inf`` (largest magnitude). The whole-snapshot norm is
        combined from the per-value norms: ``(sum_i ||x_i||_p**p)**(1/p)``.
        """
        p = _check_p(p)
        per = {k: ops_for(v).norm(v, p) for k, v in self._values.items()}
        if layerwise:
            return Snapshot(per, self.name)
        if not per:
            return 0.0
        a = np.array(list(per.values()), dtype=np.float64)
        if math.isinf(p):
            return float(a.max())
        m = a.max()
        if not np.isfinite(m) or m == 0:
            return float(m)
        return float(m * np.sum((a / m) ** p) ** (1.0 / p))

    @overload
    def describe(
        self,
        layerwise: bool = False,
        pattern: str | None = None,
        include: Sequence[str] | None = None,
        *,
        percentiles: Sequence[float] = (),
        ddof: int = 0,
        display: Literal[True] | None = None,
    ) -> pd.DataFrame: ...
    @overload
    def describe(
        self,
        layerwise: bool = False,
        pattern: str | None = None,
        include: Sequence[str] | None = None,
        *,
        percentiles: Sequence[float] = (),
        ddof: int = 0,
        display: Literal[False],
    ) -> dict[str, list[Any]]: ...
    @overload
    def describe(
        self,
        layerwise: bool = False,
        pattern: str | None = None,
        include: Sequence[str] | None = None,
        *,
        percentiles: Sequence[float] = (),
        ddof: int = 0,
        display: bool | None = None,
    ) -> pd.DataFrame | dict[str, list[Any]]: ...
    def describe(
        self,
        layerwise: bool = False,
        pattern: str | None = None,
        include: Sequence[str] | None = None,
        *,
        percentiles: Sequence[float] = (),
        ddof: int = 0,
        display: bool | None = None,
    ) -> pd.DataFrame | dict[str, list[Any]]:
        r"""Statistics of the snapshot as a DataFrame, named as in a tandv log.

        Arguments:
            layerwise: one row per value (indexed by name) instead of one row for all
                values together (indexed by the snapshot's name). The whole-snapshot row
                merges the per-value summaries exactly, as the trackers merge micro-batches.
            pattern: only names matching this regular expression (``re.search``).
            include: the columns to return, from :data:`DESCRIBE_COLUMNS` and
                :data:`EXTRA_COLUMNS` (default: :data:`DESCRIBE_COLUMNS`).
            percentiles: exact percentiles to add as columns ``pct<q>`` (``q`` in [0, 100]),
                of the non-NaN elements, interpolated as ``np.percentile``; the whole-snapshot
                row's are those of all values together (the Chainer monitor's whole-model
                percentiles: ``from_weight(model).filter(r"\.weight$").describe(
                percentiles=(...))``).
            ddof: delta degrees of freedom of ``std`` and ``var``: ``sqrt(M2 / (n - ddof))``
                over the ``n`` finite elements. The default 0 is a log's (population)
                standard deviation; ``ddof=1`` is nnstat's (``torch.std``, unbiased). NaN
                when ``n <= ddof``.
            display: ``None`` returns the DataFrame; ``True`` also prints it; ``False``
                returns nnstat's plain dict instead, ``{column: [value per row]}`` with the
                row names under ``"name"`` (for ``wandb.log`` and the like).

        Returns:
            A DataFrame with the columns of :data:`DESCRIBE_COLUMNS` (or ``include``) and the
            percentile columns: the statistics are :func:`tandv.stats.finalize` of
            :func:`tandv.stats.summarize` of each value, so they agree with a tandv log of
            the same tensors (``std`` with ``ddof=0``); or the dict (``display=False``).
        """
        known = (*DESCRIBE_COLUMNS, *EXTRA_COLUMNS)
        cols = list(DESCRIBE_COLUMNS)
        if include is not None:
            wanted = [include] if isinstance(include, str) else list(include)
            unknown = [c for c in wanted if c not in known]
            if unknown:
                raise ValueError(
                    f"describe(include=...): unknown columns {unknown}; choose from {list(known)}"
                )
            cols = wanted
        if isinstance(ddof, bool) or not isinstance(ddof, numbers.Integral) or ddof < 0:
            raise ValueError(f"describe(ddof={ddof!r}): expected a non-negative integer (0 or 1)")
        pct = _percentile_names(percentiles)
        extras = [c for c in cols if c in EXTRA_COLUMNS]
        snap = self if pattern is None else self.filter(pattern)
        summaries, shapes, dtypes, moments, hosts = {}, {}, {}, {}, {}
        layout = None
        for k, v in snap._values.items():
            arr, dtype = ops_for(v).to_numpy(v)
            # The exponent counts are not reported, so one format serves every value and
            # lets the whole-snapshot row merge them.
            summaries[k], layout = summarize(arr, fmt="float64")
            shapes[k], dtypes[k] = tuple(np.shape(arr)), dtype
            if extras:
                moments[k] = central_moments(arr)
            if pct:
                hosts[k] = np.asarray(arr, dtype=np.float64).ravel()
        if layerwise:
            rows = {
                k: _row(s, layout, shapes[k], dtypes[k], moments.get(k), hosts.get(k), pct, ddof)
                for k, s in summaries.items()
            }
        else:
            total = merge_all(summaries.values(), layout) if layout else None
            n = int(sum(math.prod(s) for s in shapes.values()))
            kinds = sorted(set(dtypes.values()))
            merged = merge_moments(moments.values()) if extras else None
            flat = (
                (np.concatenate(list(hosts.values())) if hosts else np.zeros(0, np.float64))
                if pct
                else None
            )
            rows = {
                snap.name: _row(
                    total,
                    layout,
                    (n,),
                    kinds[0] if len(kinds) == 1 else "mixed",
                    merged,
                    flat,
                    pct,
                    ddof,
                )
            }
        names = [*known, *(c for c, _ in pct)]
        df = pd.DataFrame.from_dict(rows, orient="index", columns=names)
        df.index.name = "name"
        df = df[cols + [c for c, _ in pct]]
        if display is False:
            out: dict[str, list[Any]] = {"name": list(df.index)}
            out.update({c: df[c].tolist() for c in df.columns})
            return out
        if display:
            print(f"[{' Stats ' + snap.name + ' ':=^60}]")
            print(df.to_string())
        return df

    # -- printing --------------------------------------------------------------------------
    def __repr__(self) -> str:
        return self._text(limit=12)

    def __str__(self) -> str:
        return self._text(limit=40)

    def _text(self, limit: int) -> str:
        n = len(self._values)
        arrays = {k: v for k, v in self._values.items() if not _is_scalar(v)}
        if arrays:
            numel = sum(int(np.prod(np.shape(v))) for v in arrays.values())
            dtypes = sorted(
                {str(getattr(v, "dtype", "?")).replace("torch.", "") for v in arrays.values()}
            )
            head = (
                f"Snapshot {self.name!r} [{n} tensors, numel={numel:,}, "
                f"L2={self.norm(2):.4g}, dtype={'/'.join(dtypes)}]"
            )
        else:
            head = f"Snapshot {self.name!r} [{n} numbers]"
        width = max((len(k) for k in self._values), default=0)
        lines = [head]
        for i, (k, v) in enumerate(self._values.items()):
            if i == limit and n > limit + 1:
                lines.append(f"  ... {n - limit} more")
                break
            desc = f"{float(v):.6g}" if _is_scalar(v) else str(tuple(np.shape(v)))
            lines.append(f"  {i:>2}: {k:<{width}}  {desc}")
        return "\n".join(lines)


def _percentile_names(percentiles: Sequence[float]) -> list[tuple[str, float]]:
    """``describe``'s ``percentiles`` as ``[(column, q)]``, columns named as a log's."""
    if isinstance(percentiles, (str, bytes)) or not isinstance(percentiles, Sequence):
        raise TypeError(
            f"describe(percentiles={percentiles!r}): expected a sequence of percentages, "
            f"e.g. (1, 50, 99)"
        )
    out: dict[str, float] = {}
    for q in percentiles:
        if isinstance(q, bool) or not isinstance(q, numbers.Real) or not 0 <= q <= 100:
            raise ValueError(f"describe(percentiles=...): {q!r} is not a percentage in [0, 100]")
        out[f"pct{float(q):g}"] = float(q)
    return list(out.items())


#: ``(n, mean, M2, M3, M4)`` of no elements.
_NO_MOMENTS = (0.0, 0.0, 0.0, 0.0, 0.0)


def central_moments(x: Any) -> tuple[float, float, float, float, float]:
    """``(n, mean, M2, M3, M4)`` of the finite elements of ``x`` in float64: their count,
    mean and centred power sums ``M_k = sum((x - mean)**k)`` (two passes: the mean first,
    so a large mean costs no digits)."""
    a = np.asarray(x, dtype=np.float64).ravel()
    a = a[np.isfinite(a)]
    if a.size == 0:
        return _NO_MOMENTS
    mean = float(a.mean())
    d = a - mean
    d2 = d * d
    return (float(a.size), mean, float(d2.sum()), float((d2 * d).sum()), float((d2 * d2).sum()))


def merge_moments(
    parts: Iterable[tuple[float, float, float, float, float]],
) -> tuple[float, float, float, float, float]:
    """The ``(n, mean, M2, M3, M4)`` of several parts' elements together, from each part's
    (Pébay 2008, the pairwise update of centred power sums): exact, and stable when the
    parts' means are far from zero."""
    n, mean, m2, m3, m4 = _NO_MOMENTS
    for nb, mb, b2, b3, b4 in parts:
        if nb == 0:
            continue
        if n == 0:
            n, mean, m2, m3, m4 = nb, mb, b2, b3, b4
            continue
        na, tot = n, n + nb
        delta = mb - mean
        dn = delta / tot
        m4 = (
            m4
            + b4
            + delta * dn**3 * na * nb * (na * na - na * nb + nb * nb)
            + 6.0 * dn * dn * (na * na * b2 + nb * nb * m2)
            + 4.0 * dn * (na * b3 - nb * m3)
        )
        m3 = m3 + b3 + delta * dn * dn * na * nb * (na - nb) + 3.0 * dn * (na * b2 - nb * m2)
        m2 = m2 + b2 + delta * dn * na * nb
        mean = mean + dn * nb
        n = tot
    return n, mean, m2, m3, m4


def _row(
    summary: np.ndarray | None,
    layout: Any,
    shape: tuple[int, ...],
    dtype: str,
    moments: tuple[float, float, float, float, float] | None,
    values: np.ndarray | None,
    pct: list[tuple[str, float]],
    ddof: int,
) -> list[Any]:
    if summary is None:  # an empty snapshot
        stats = {k: np.nan for k in DEFAULT_STATS}
        stats.update(numel=0, zero_count=0, nan_count=0, inf_count=0)
    else:
        stats, _ = finalize(summary, layout)
    finite = stats["numel"] - stats["nan_count"] - stats["inf_count"]
    norm = stats["rm2"] * math.sqrt(finite) if finite else 0.0
    if ddof:  # the finalized std is the population one: rescale to M2 / (n - ddof)
        stats["std"] = (
            stats["std"] * math.sqrt(finite / (finite - ddof)) if finite > ddof else np.nan
        )
    extra = [np.nan] * len(EXTRA_COLUMNS)
    if moments is not None:
        n, mean, m2, m3, m4 = moments
        with np.errstate(all="ignore"):
            extra = [
                stats["mean_abs"] * finite if finite else 0.0,
                mean * n,
                m2 / (n - ddof) if n > ddof else np.nan,
                (m3 / n) / (m2 / n) ** 1.5 if m2 > 0 else np.nan,
                (m4 / n) / (m2 / n) ** 2 - 3.0 if m2 > 0 else np.nan,
            ]
    qs = [q for _, q in pct]
    if values is not None and qs:
        kept = values[~np.isnan(values)]
        got = np.percentile(kept, qs) if kept.size else np.full(len(qs), np.nan)
    else:
        got = np.full(len(qs), np.nan)
    return [shape, dtype, *(stats[k] for k in DEFAULT_STATS), norm, *extra, *got.tolist()]


def _apply(op: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    """``op(a, b)``; between two plain numbers (a layerwise norm and another) in IEEE float64
    arithmetic, as between tensors: ``x / 0`` is ``inf`` (``nan`` for ``0 / 0``) where Python's
    floats raise ``ZeroDivisionError``."""
    if _is_scalar(a) and _is_scalar(b):
        with np.errstate(all="ignore"):
            return float(op(np.float64(a), np.float64(b)))
    return op(a, b)


def sqrt(x: Snapshot) -> Snapshot:
    """Elementwise square root of every value of a snapshot, in its own framework
    (``-lr * m / (sqrt(v) + eps)``)."""
    if not isinstance(x, Snapshot):
        raise TypeError(
            f"sqrt(x): expected a Snapshot, got {type(x).__name__}; use your "
            f"framework's sqrt for plain tensors"
        )
    return x.sqrt()


def _few(names: Iterable[str], n: int = 5) -> str:
    names = list(names)
    if not names:
        return "nothing"
    shown = ", ".join(repr(k) for k in names[:n])
    return shown + (f", ... ({len(names)} in all)" if len(names) > n else "")
