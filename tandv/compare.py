"""Two runs side by side: :func:`compare` lines up their statistics tensor by tensor and step
by step, :func:`first_divergence` finds where they first part.

The bf16 run beside the float32 one, today's code beside yesterday's, the run that diverged
beside the one that did not: each question is "which tensor, at which step, first differed".
Both functions read logs (paths or frames) only, so they serve notebooks, ``tandv diff`` and
the HTML report's two-run view alike.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import pandas as pd

from .analysis import computation_order
from .schema import read_log, validate
from .schema.columns import METADATA, SCALAR_STATS

__all__ = [
    "compare",
    "first_divergence",
    "divergence_in",
    "most_different",
    "relative_difference",
    "PRESENT",
]

#: The ``present`` column of :func:`compare`: in which run(s) a (tensor_type, name, step) was.
PRESENT = ("both", "a only", "b only")

_KEY = ["tensor_type", "name", "step"]

Log: TypeAlias = "pd.DataFrame | str | os.PathLike[str]"


def _load(log: Log, which: str, trust_pickle: bool) -> pd.DataFrame:
    """A validated log from a frame or a path (argument ``which`` names it in errors)."""
    if isinstance(log, pd.DataFrame):
        return validate(log)
    if isinstance(log, (str, os.PathLike)):
        return read_log(log, trust_pickle=trust_pickle)
    raise TypeError(
        f"compare: {which} must be a log (a DataFrame) or the path of one; got {type(log).__name__}"
    )


def _stats(stats: str | Sequence[str]) -> list[str]:
    names = [stats] if isinstance(stats, str) else list(stats)
    if not names or not all(isinstance(s, str) for s in names):
        raise ValueError(
            f"stats={stats!r}: expected one or more statistic names, e.g. ('rm2', 'max_abs')"
        )
    return list(dict.fromkeys(names))


def _flat(df: pd.DataFrame, stats: list[str], which: str) -> pd.DataFrame:
    """``tensor_type, name, step`` and the statistics ``stats`` of log ``df``, in log order."""
    have = [c for g, c in df.columns if g == SCALAR_STATS]
    missing = [s for s in stats if s not in have]
    if missing:
        raise ValueError(
            f"compare: log {which} has no statistic {missing}; it has {have} (choose stats= "
            f"among the statistics both logs hold)"
        )
    out = pd.DataFrame({c: df[(METADATA, c)].to_numpy() for c in _KEY})
    out["step"] = out["step"].astype(np.int64)
    for s in stats:
        out[s] = df[(SCALAR_STATS, s)].to_numpy(dtype=np.float64)
    return out


def relative_difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``|a - b| / max(|a|, |b|)`` elementwise: 0 where the values are equal (two zeros, the
    same infinity, or both NaN: the runs agree), ``inf`` where only one is NaN or the two are
    different infinities; at most 2 otherwise (values of opposite sign)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        rel = np.abs(a - b) / np.maximum(np.abs(a), np.abs(b))
    return np.where(same, 0.0, np.where(np.isfinite(rel), rel, np.inf))


def compare(
    a: Log,
    b: Log,
    stats: str | Sequence[str] = ("rm2", "max_abs"),
    *,
    trust_pickle: bool = False,
) -> pd.DataFrame:
    """Line up two runs' statistics: one row per (tensor_type, name, step).

    Arguments:
        a, b: the two logs (DataFrames, or paths that :func:`tandv.read_log` reads).
        stats: the ``scalar_stats`` columns to compare; both logs must hold them.
        trust_pickle: read ``.pkl``/``.pickle`` paths (unpickling runs code stored in the
            file: only for logs you made or trust), as :func:`tandv.read_log`.

    Returns:
        A flat frame, in computation order (:func:`tandv.analysis.computation_order`: by step,
        then weights, activations, gradients, optimizer state, each in run ``a``'s order),
        with columns ``tensor_type``, ``name``, ``step``, ``present``, and per statistic
        ``<stat>_a``, ``<stat>_b`` and ``<stat>_rel`` (:func:`relative_difference`).
        A tensor or step that only one run logged is listed, not dropped: ``present`` is
        ``"a only"`` or ``"b only"``, and the other run's value and the difference are NaN
        (``b``'s own rows come after ``a``'s rows of their step and tensor type). Rows both
        runs logged have ``present == "both"``.

    Raises:
        TypeError, tandv.SchemaError: a log that is not a frame or path, or not a valid log.
        ValueError: a statistic missing from a log (naming it and the ones there are).
    """
    names = _stats(stats)
    fa = _flat(_load(a, "a", trust_pickle), names, "a")
    fb = _flat(_load(b, "b", trust_pickle), names, "b")
    ka = pd.MultiIndex.from_frame(fa[_KEY])
    kb = pd.MultiIndex.from_frame(fb[_KEY])
    in_b = kb.get_indexer(ka)  # where each of a's rows is in b (-1: absent)
    b_only = np.flatnonzero(~kb.isin(ka))
    keys = pd.concat([fa[_KEY], fb[_KEY].iloc[b_only]], ignore_index=True)
    present = np.concatenate(
        [np.where(in_b >= 0, PRESENT[0], PRESENT[1]), np.full(b_only.size, PRESENT[2])]
    )
    order = computation_order(keys)
    out = keys.iloc[order].reset_index(drop=True)
    out["present"] = pd.Categorical(present[order], categories=list(PRESENT))
    both = present[order] == PRESENT[0]
    for s in names:
        va = np.concatenate([fa[s].to_numpy(), np.full(b_only.size, np.nan)])[order]
        vb = np.append(fb[s].to_numpy(), np.nan)  # position -1: NaN, for a's rows b lacks
        vb = np.concatenate([vb[in_b], vb[b_only]])[order]
        out[f"{s}_a"], out[f"{s}_b"] = va, vb
        out[f"{s}_rel"] = np.where(both, relative_difference(va, vb), np.nan)
    return out


def _check_rtol(rtol: float) -> None:
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol >= 0:
        raise ValueError(f"first_divergence(rtol={rtol!r}): expected a number >= 0")


def first_divergence(
    a: Log,
    b: Log,
    rtol: float = 1e-3,
    stats: str | Sequence[str] = ("rm2", "max_abs"),
    *,
    trust_pickle: bool = False,
) -> pd.Series | None:
    """Where two runs first part: the first step at which a tensor both logged differs in
    some statistic by more than ``rtol`` (:func:`relative_difference`), and within that step
    the first such tensor in computation order (weights, activations in forward order,
    gradients in backward order, optimizer state: the order of :func:`tandv.first_nonfinite`).

    Tensors or steps that only one run logged are not divergences (:func:`compare` lists
    them). ``trust_pickle`` as :func:`compare`.

    Returns:
        That row of :func:`compare` (``tensor_type``, ``name``, ``step``, and each statistic
        of both runs with their relative difference), or ``None`` when the runs agree.

    Raises:
        ValueError: ``rtol`` negative or not a number; as :func:`compare`.
    """
    _check_rtol(rtol)
    return divergence_in(compare(a, b, stats, trust_pickle=trust_pickle), rtol)


def divergence_in(table: pd.DataFrame, rtol: float = 1e-3) -> pd.Series | None:
    """:func:`first_divergence` of a :func:`compare` table (over all its statistics)."""
    _check_rtol(rtol)
    rel = table[[c for c in table.columns if c.endswith("_rel")]].to_numpy()
    apart = np.flatnonzero((np.nan_to_num(rel, nan=0.0) > rtol).any(axis=1))
    if apart.size == 0:
        return None
    return table.iloc[int(apart[0])]


def most_different(table: pd.DataFrame, top: int = 10) -> pd.DataFrame:
    """The tensors whose statistics differ most between the runs, from a :func:`compare`
    table: per tensor (tensor_type, name) both runs logged, its largest relative difference
    over steps and statistics, largest first (ties in computation order), at most ``top``.
    Tensors that never differ are left out.

    Returns:
        Columns ``tensor_type``, ``name``, ``step`` (where the difference is largest),
        ``stat``, ``a``, ``b``, ``rel``.
    """
    stats = [c[: -len("_rel")] for c in table.columns if c.endswith("_rel")]
    parts = [
        pd.DataFrame(
            {
                "tensor_type": table["tensor_type"],
                "name": table["name"],
                "step": table["step"],
                "stat": s,
                "a": table[f"{s}_a"],
                "b": table[f"{s}_b"],
                "rel": table[f"{s}_rel"],
            }
        )
        for s in stats
    ]
    cols = ["tensor_type", "name", "step", "stat", "a", "b", "rel"]
    if not parts:
        return pd.DataFrame(columns=cols)
    long = pd.concat(parts, ignore_index=True)
    long = long[long["rel"] > 0].sort_values("rel", ascending=False, kind="stable")
    worst = long.groupby(["tensor_type", "name"], sort=False).head(1)
    return worst.head(top).reset_index(drop=True)[cols]
