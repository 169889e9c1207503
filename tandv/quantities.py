"""Derived training quantities: trust ratio, update/weight ratio, gradient noise scale.

Pure numpy/pandas. The ratios take :class:`tandv.snapshot.Snapshot` objects (any framework)
or a tandv log; the noise-scale estimators take squared gradient norms, which any framework
gives (``snapshot.norm() ** 2``).

Definitions:

* **Trust ratio** (LARS, You et al. 2017, "Large Batch Training of Convolutional Networks"):
  per layer ``||W|| / (||grad|| + weight_decay * ||W||)``, L2 norms of the whole parameter
  tensor. LAMB (You et al. 2019) uses ``||W|| / ||r||`` with ``r`` the Adam step direction
  plus ``weight_decay * W``: pass that direction as ``grad`` and ``weight_decay=0``.
  (nnstat calls ``||update|| / ||W||`` its trust ratio; that is :func:`update_ratio` here.)
* **Update/weight ratio**: per layer ``||W_after - W_before|| / ||W_before||``.
* **Block-scaled formats** (``track(block_formats=...)``, definitions in
  :mod:`tandv.stats.blocks`): per tensor the shares of its elements that would underflow,
  be subnormal or saturate, and the relative error power ``sq_err / sum(x**2)`` (sum over
  the finite values, ``rm2**2 * (numel - nan_count - inf_count)``).
* **Gradient noise scale** (McCandlish et al. 2018, "An Empirical Model of Large-Batch
  Training", appendix A): with ``G`` the true gradient and ``Sigma`` the per-example
  gradient covariance, a batch of ``B`` examples has ``E|G_B|^2 = |G|^2 + tr(Sigma)/B``;
  two batch sizes give unbiased estimates of ``|G|^2`` and ``tr(Sigma)``, and
  ``B_simple = tr(Sigma) / |G|^2``. nnstat's README defines the noise scale as
  ``B_noise = tr(H Sigma) / (G^T H G)`` (McCandlish et al. eq. 2.8, ``H`` the loss's Hessian):
  with ``H``-weighted squared norms ``g^T H g`` (:func:`hessian_sq_norm` for a diagonal ``H``)
  in place of ``|g|^2`` the same estimators give ``G^T H G`` and ``tr(H Sigma)``, and
  :attr:`NoiseScaleEstimate.b_simple` of that estimate is ``B_noise``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import pandas as pd

__all__ = [
    "trust_ratio",
    "update_ratio",
    "log_norms",
    "log_trust_ratio",
    "log_update_ratio",
    "NoiseScaleEstimate",
    "noise_scale",
    "noise_scale_from_microbatches",
    "NoiseScaleEMA",
    "noise_scale_fit",
    "two_batch_estimate",
    "smoothed_noise_scale",
    "hessian_sq_norm",
    "block_format_names",
    "block_shares",
]


@runtime_checkable
class SnapshotLike(Protocol):
    """What the ratios read from a :class:`tandv.snapshot.Snapshot`: its names, a filter by
    name, layerwise norms and a host copy. Declared here, by the reader, so that this module
    (below the trackers, whose noise-scale hooks use it) does not import the snapshots, which
    sit above the trackers."""

    def __iter__(self) -> Iterator[str]: ...
    def __contains__(self, key: object) -> bool: ...
    def filter(self, pattern: str | None = None) -> SnapshotLike: ...
    def norm(self, p: float, layerwise: Literal[True]) -> Mapping[str, Any]: ...
    def numpy(self) -> Mapping[str, Any]: ...


def _norms(x: SnapshotLike, what: str, pattern: str | None) -> pd.Series:
    if not isinstance(x, SnapshotLike):
        raise TypeError(f"{what}: expected a tandv.snapshot.Snapshot, got {type(x).__name__}")
    if pattern is not None:
        x = x.filter(pattern)
    return pd.Series(dict(x.norm(2, layerwise=True)), dtype=np.float64, name=what)


def _aligned(a: pd.Series, b: pd.Series, fn: str) -> tuple[pd.Series, pd.Series]:
    if set(a.index) != set(b.index):
        only_a = [k for k in a.index if k not in b.index][:5]
        only_b = [k for k in b.index if k not in a.index][:5]
        raise ValueError(
            f"{fn}: the snapshots hold different names (only {a.name}: {only_a}; "
            f"only {b.name}: {only_b}); filter both with the same pattern"
        )
    return a, b.reindex(a.index)


def _ratio(
    num: pd.Series | pd.DataFrame, den: pd.Series | pd.DataFrame
) -> pd.Series | pd.DataFrame:
    with np.errstate(divide="ignore", invalid="ignore"):
        return num / den  # 0 denominators give inf (nan for 0/0): the ratio is undefined there


def trust_ratio(
    weight: SnapshotLike, grad: SnapshotLike, weight_decay: float = 0.0, pattern: str | None = None
) -> pd.Series:
    """LARS trust ratio per layer: ``||W|| / (||grad|| + weight_decay * ||W||)``.

    Arguments:
        weight: the weights the gradient was taken at.
        grad: their gradient (for LAMB: Adam's step direction ``m / (sqrt(v) + eps)``).
        weight_decay: LARS's weight-decay term in the denominator.
        pattern: only names matching this regular expression.

    Returns:
        A Series indexed by name (``inf`` where the gradient norm is 0).
    """
    w, g = _aligned(_norms(weight, "weight", pattern), _norms(grad, "grad", pattern), "trust_ratio")
    return _ratio(w, g + weight_decay * w).rename("trust_ratio")


def update_ratio(
    update: SnapshotLike, weight: SnapshotLike, pattern: str | None = None
) -> pd.Series:
    """Update/weight ratio per layer: ``||update|| / ||weight||``.

    Arguments:
        update: ``W_after - W_before`` (``from_weight(model) - W0``), or a recomputed update
            such as ``-lr * m / (sqrt(v) + eps)``.
        weight: the weights the update is compared with (normally ``W_before``).
        pattern: only names matching this regular expression.
    """
    u, w = _aligned(
        _norms(update, "update", pattern), _norms(weight, "weight", pattern), "update_ratio"
    )
    return _ratio(u, w).rename("update_ratio")


# -- from a log -------------------------------------------------------------------------------
def log_norms(df: pd.DataFrame, tensor_type: str = "Weight") -> pd.DataFrame:
    """L2 norms of the tensors of one type in a tandv log, steps x names.

    ``||x|| = rm2 * sqrt(numel - nan_count - inf_count)`` is exact (to rounding) for the finite
    elements; a tensor with a NaN has norm NaN, one with an infinity (and no NaN) ``inf``.
    """
    for col in ("rm2", "numel", "nan_count", "inf_count"):
        if ("scalar_stats", col) not in df.columns:
            raise ValueError(
                f"log_norms: the log has no scalar_stats column {col!r} (the default "
                f"statistics are needed to compute norms)"
            )
    rows = df[df[("metadata", "tensor_type")] == tensor_type]
    if rows.empty:
        have = sorted(df[("metadata", "tensor_type")].unique())
        raise ValueError(f"log_norms: the log has no {tensor_type!r} rows; it holds {have}")
    s = rows["scalar_stats"]
    finite = (s["numel"] - s["nan_count"] - s["inf_count"]).astype(np.float64)
    norm = s["rm2"].astype(np.float64).where(finite > 0, 0.0) * np.sqrt(finite)
    norm = norm.where(s["inf_count"] == 0, np.inf).where(s["nan_count"] == 0, np.nan)
    out = pd.DataFrame(
        {
            "step": rows[("metadata", "step")].to_numpy(),
            "name": rows[("metadata", "name")].to_numpy(),
            "norm": norm.to_numpy(),
        }
    )
    table = out.pivot(index="step", columns="name", values="norm")
    table.columns.name = None
    return table[list(dict.fromkeys(out["name"]))]  # names in log order


def log_trust_ratio(df: pd.DataFrame, weight_decay: float = 0.0) -> pd.DataFrame:
    """LARS trust ratio per parameter and step from a log, steps x parameter names.

    Exact: the ``Weight`` row of step ``k`` is the parameter before update ``k`` and the
    parameter's ``Gradient`` row the gradient that update used. Only parameters with both
    rows at a step appear (activation gradients, named by module path, do not match).
    """
    w, g = log_norms(df, "Weight"), log_norms(df, "Gradient")
    names = [c for c in w.columns if c in g.columns]
    if not names:
        raise ValueError(
            "log_trust_ratio: no tensor has both Weight and Gradient rows; track "
            "weights and gradients"
        )
    w, g = w[names], g[names].reindex(w.index)
    return _ratio(w, g + weight_decay * w).dropna(how="all")


def log_update_ratio(df: pd.DataFrame, update_suffix: str = ".update") -> pd.DataFrame:
    """What a log tells about the update/weight ratio, one row per (parameter, logged step).

    A log holds the norms of the weights, not of the update, and ``||W_next - W||`` is not a
    function of ``||W||`` and ``||W_next||``. What is exact:

    * ``lower = | ||W_next|| - ||W|| | / ||W||`` and ``upper = (||W_next|| + ||W||) / ||W||``
      bound the ratio (triangle inequality); ``W_next`` is the next *logged* step's weight, so
      with ``every=n`` the bounds are on the sum of ``n`` updates (``next_step`` says which).
    * ``exact`` = ``||update|| / ||W||`` where the log also holds the update itself as rows
      named ``<parameter><update_suffix>`` (any tensor type) at the same step; NaN elsewhere.

    Returns:
        A DataFrame with columns ``name``, ``step``, ``next_step``, ``weight_norm``,
        ``lower``, ``upper``, ``exact``.
    """
    w = log_norms(df, "Weight")
    steps = w.index.to_numpy()
    updates: dict[str, pd.Series] = {}
    names = df[("metadata", "name")]
    for tt in df[("metadata", "tensor_type")].unique():
        if names[df[("metadata", "tensor_type")] == tt].str.endswith(update_suffix).any():
            n = log_norms(df, tt)
            for c in n.columns:
                if c.endswith(update_suffix) and c[: -len(update_suffix)] in w.columns:
                    updates[c[: -len(update_suffix)]] = n[c]
    parts = []
    for name in w.columns:
        if name.endswith(update_suffix):
            continue  # an update row logged as a Weight is not a parameter
        col = w[name].dropna()
        if len(col) < 2 and name not in updates:
            continue
        cur = col.to_numpy()
        nxt = np.append(cur[1:], np.nan)
        nstep = np.append(col.index.to_numpy()[1:], -1)
        u = updates.get(name, pd.Series(dtype=np.float64)).reindex(col.index).to_numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            parts.append(
                pd.DataFrame(
                    {
                        "name": name,
                        "step": col.index.to_numpy(),
                        "next_step": nstep,
                        "weight_norm": cur,
                        "lower": np.abs(nxt - cur) / cur,
                        "upper": (nxt + cur) / cur,
                        "exact": u / cur,
                    }
                )
            )
    if not parts:
        raise ValueError(
            f"log_update_ratio: no parameter has Weight rows at two logged steps "
            f"(steps logged: {list(steps)[:5]})"
        )
    return pd.concat(parts, ignore_index=True)


# -- gradient noise scale ---------------------------------------------------------------------
@dataclass(frozen=True)
class NoiseScaleEstimate:
    """Estimates of ``|G|^2`` (``g2``), ``tr(Sigma)`` (``trace``) and ``B_simple = trace / g2``.

    ``g2`` and ``trace`` are unbiased; their ratio is not (average them over steps, e.g. with
    :class:`NoiseScaleEMA`, before dividing). A single-step ``g2`` can be negative.
    """

    g2: float
    trace: float

    @property
    def b_simple(self) -> float:
        """The simple noise scale ``tr(Sigma) / |G|^2`` (NaN when ``g2`` is 0)."""
        return self.trace / self.g2 if self.g2 != 0 else math.nan


def _check_batches(b_small: float, b_big: float) -> None:
    if not (b_small > 0 and b_big > 0):
        raise ValueError(
            f"noise scale: batch sizes must be positive, got b_small={b_small}, b_big={b_big}"
        )
    if b_small == b_big:
        raise ValueError(f"noise scale: the two batch sizes must differ (both are {b_small})")


def noise_scale(
    small_sq_norm: float, b_small: float, big_sq_norm: float, b_big: float
) -> NoiseScaleEstimate:
    """Unbiased ``|G|^2`` and ``tr(Sigma)`` from squared gradient norms at two batch sizes.

    Arguments:
        small_sq_norm: ``|G_small|^2``, squared L2 norm of a gradient averaged over
            ``b_small`` examples (or the mean of several such squared norms).
        b_small: its batch size.
        big_sq_norm: ``|G_big|^2`` for a (mean) gradient over ``b_big`` examples.
        b_big: its batch size.

    Returns:
        ``g2 = (b_big |G_big|^2 - b_small |G_small|^2) / (b_big - b_small)`` and
        ``trace = (|G_small|^2 - |G_big|^2) / (1/b_small - 1/b_big)``.
    """
    g2, trace = two_batch_estimate(small_sq_norm, b_small, big_sq_norm, b_big)
    return NoiseScaleEstimate(float(g2), float(trace))


def two_batch_estimate(
    small_sq_norm: Any, b_small: float, big_sq_norm: Any, b_big: float
) -> tuple[Any, Any]:
    """The formulas of :func:`noise_scale` on any numbers that support arithmetic (floats,
    numpy or device arrays: a device tracker keeps its per-step estimates on the device,
    with no synchronisation). Returns ``(g2, trace)`` of the inputs' type."""
    _check_batches(b_small, b_big)
    g2 = (b_big * big_sq_norm - b_small * small_sq_norm) / (b_big - b_small)
    trace = (small_sq_norm - big_sq_norm) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


def smoothed_noise_scale(
    scalars: pd.DataFrame, beta: float = 0.99, g2: str = "noise_g2", trace: str = "noise_trace"
) -> pd.Series:
    """``B_simple`` per step from per-step ``|G|^2`` and ``tr(Sigma)`` estimates logged as
    training scalars (e.g. by ``tandv.track.torch.GradientNoiseScale``), smoothed with
    :class:`NoiseScaleEMA` (the ratio of the averages, as McCandlish et al. advise).

    Arguments:
        scalars: a table with a ``step`` column and the two estimate columns
            (``tandv.read_scalars(log)``); steps without both estimates are skipped.
        beta: the averages' decay per logged step.
        g2, trace: the columns' names.

    Returns:
        A Series of ``B_simple`` indexed by step.
    """
    missing = [c for c in ("step", g2, trace) if c not in scalars.columns]
    if missing:
        raise ValueError(
            f"smoothed_noise_scale: the scalars have no column(s) {missing} "
            f"(columns: {list(scalars.columns)}); log them with GradientNoiseScale"
        )
    rows = scalars[["step", g2, trace]].dropna().sort_values("step")
    ema = NoiseScaleEMA(beta)
    values = [
        ema.update(NoiseScaleEstimate(float(a), float(b))).b_simple
        for a, b in zip(rows[g2], rows[trace])
    ]
    return pd.Series(values, index=rows["step"].to_numpy(), name="b_simple", dtype=np.float64)


def noise_scale_from_microbatches(
    micro_sq_norms: Sequence[float], micro_batch_size: int, accumulated_sq_norm: float
) -> NoiseScaleEstimate:
    """The two-batch estimate from one gradient-accumulation step, at no extra cost.

    Arguments:
        micro_sq_norms: ``|g_i|^2`` of each micro-batch's own (mean) gradient; their mean is
            the small-batch value.
        micro_batch_size: examples per micro-batch (the small batch size).
        accumulated_sq_norm: ``|mean_i g_i|^2``, the squared norm of the step's gradient as
            the *mean* over micro-batches (divide the loss by the number of micro-batches, or
            divide a summed gradient's squared norm by that number squared); the big batch
            has ``len(micro_sq_norms) * micro_batch_size`` examples.
    """
    sq = np.asarray(micro_sq_norms, dtype=np.float64)
    if sq.ndim != 1 or sq.size < 2:
        raise ValueError(
            f"noise_scale_from_microbatches: need the squared norms of at least two "
            f"micro-batches, got {sq.size}"
        )
    return noise_scale(
        float(sq.mean()), micro_batch_size, accumulated_sq_norm, sq.size * micro_batch_size
    )


class NoiseScaleEMA:
    """Exponential moving averages of the ``|G|^2`` and ``tr(Sigma)`` estimates, as
    McCandlish et al. recommend (the ratio of averages, not the average of ratios).

    Arguments:
        beta: the averages' decay per update (0 keeps only the latest estimate). The averages
            are bias-corrected like Adam's, so the first update gives that step's estimate.
    """

    def __init__(self, beta: float = 0.99) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"NoiseScaleEMA(beta={beta}): beta must be in [0, 1)")
        self.beta = beta
        self._g2 = 0.0
        self._trace = 0.0
        self._weight = 0.0

    def update(self, estimate: NoiseScaleEstimate) -> NoiseScaleEstimate:
        """Fold in one step's estimate; returns the bias-corrected averages."""
        b = self.beta
        self._g2 = b * self._g2 + (1 - b) * estimate.g2
        self._trace = b * self._trace + (1 - b) * estimate.trace
        self._weight = b * self._weight + (1 - b)
        return self.value

    @property
    def value(self) -> NoiseScaleEstimate:
        """The current bias-corrected averages (NaN before the first update)."""
        if self._weight == 0:
            return NoiseScaleEstimate(math.nan, math.nan)
        return NoiseScaleEstimate(self._g2 / self._weight, self._trace / self._weight)


def hessian_sq_norm(grad: SnapshotLike, hessian: SnapshotLike) -> float:
    """``g^T H g`` for a diagonal ``H``: ``sum over names of sum(h * g**2)`` in float64 on the
    host, the squared norm the Hessian-weighted noise scale needs
    (``noise_scale(hessian_sq_norm(G_small, H), b_small, hessian_sq_norm(G_big, H),
    b_big).b_simple`` is ``B_noise = tr(H Sigma) / (G^T H G)``).

    Arguments:
        grad: a (mean) gradient, as from ``from_grad``.
        hessian: the diagonal of ``H`` by the same names (a curvature estimate such as
            Sophia's ``hessian`` state or a Hutchinson estimate, from ``from_optimizer_state``).

    Raises:
        ValueError: the snapshots hold different names or shapes.
    """
    for x, what in ((grad, "grad"), (hessian, "hessian")):
        if not isinstance(x, SnapshotLike):
            raise TypeError(
                f"hessian_sq_norm({what}=...): expected a tandv.snapshot.Snapshot, got "
                f"{type(x).__name__}"
            )
    if set(grad) != set(hessian):
        raise ValueError(
            f"hessian_sq_norm: the snapshots hold different names (only grad: "
            f"{[k for k in grad if k not in hessian][:5]}; only hessian: "
            f"{[k for k in hessian if k not in grad][:5]})"
        )
    g, h = grad.numpy(), hessian.numpy()
    total = 0.0
    for k in g:
        gk = np.asarray(g[k], dtype=np.float64)
        hk = np.asarray(h[k], dtype=np.float64)
        if gk.shape != hk.shape:
            raise ValueError(
                f"hessian_sq_norm: {k!r} has shape {gk.shape} in grad but {hk.shape} in hessian"
            )
        total += float(np.sum(hk * gk * gk))
    return total


def noise_scale_fit(batch_sizes: Sequence[float], sq_norms: Sequence[float]) -> NoiseScaleEstimate:
    """nnstat's curve-fit estimate: least squares of ``|G_B|^2 = |G|^2 + tr(Sigma) / B``.

    Arguments:
        batch_sizes: the batch size of each measurement (at least two distinct values).
        sq_norms: the squared norm of the mean gradient over each batch.

    Returns:
        The fitted intercept (``g2``) and slope in ``1/B`` (``trace``). With two batch sizes it
        equals :func:`noise_scale`; with more it uses them all.
    """
    b = np.asarray(batch_sizes, dtype=np.float64).ravel()
    y = np.asarray(sq_norms, dtype=np.float64).ravel()
    if b.shape != y.shape:
        raise ValueError(f"noise_scale_fit: {b.size} batch sizes but {y.size} squared norms")
    if np.any(b <= 0):
        raise ValueError(f"noise_scale_fit: batch sizes must be positive, got {b[b <= 0][:5]}")
    if np.unique(b).size < 2:
        raise ValueError("noise_scale_fit: need measurements at two or more distinct batch sizes")
    design = np.column_stack([np.ones_like(b), 1.0 / b])
    (g2, trace), *_ = np.linalg.lstsq(design, y, rcond=None)
    return NoiseScaleEstimate(float(g2), float(trace))


_BLOCK_COLUMNS = ("underflow", "subnormal", "saturated", "sq_err", "block_range")


def block_format_names(df: pd.DataFrame) -> list[str]:
    """The block-scaled formats whose columns a log holds (``track(block_formats=...)``), in
    column order."""
    stats = [c for g, c in df.columns if g == "scalar_stats"]
    have = set(stats)
    names = [c.rpartition(".")[0] for c in stats if c.endswith(".underflow")]
    return [n for n in names if all(f"{n}.{col}" in have for col in _BLOCK_COLUMNS)]


def block_shares(df: pd.DataFrame, fmt: str | Sequence[str] | None = None) -> pd.DataFrame:
    """What block-scaled formats would do to each logged tensor, as shares: one row per log
    row and format.

    Columns: ``step``, ``name``, ``tensor_type``, ``format``; ``underflow``, ``subnormal``
    and ``saturated``, each the share of the tensor's elements (of ``numel``);
    ``rel_err``, the relative error power ``sq_err / (rm2**2 * n)`` with ``n`` the finite
    elements (NaN for a tensor without a non-zero finite value), whose ``10 * log10`` is
    minus the format's signal-to-noise ratio in dB; ``block_range``, as logged.

    Arguments:
        df: a tandv log with the columns of ``track(block_formats=...)``.
        fmt: the format(s) to give (default: every one the log holds).

    Raises:
        ValueError: if the log holds no block format's columns, or not those of ``fmt``.
    """
    have = block_format_names(df)
    want = have if fmt is None else ([fmt] if isinstance(fmt, str) else list(fmt))
    missing = [f for f in want if f not in have]
    if not have or missing:
        raise ValueError(
            f"block_shares: the log holds no columns of {missing or 'any block format'} "
            f"(it has {have or 'none'}); track with block_formats=(...) to log them"
        )
    for col in ("rm2", "numel", "nan_count", "inf_count"):
        if ("scalar_stats", col) not in df.columns:
            raise ValueError(f"block_shares: the log has no scalar_stats column {col!r}")
    s = df["scalar_stats"]
    numel = s["numel"].to_numpy(dtype=np.float64)
    finite = (
        numel
        - s["nan_count"].to_numpy(dtype=np.float64)
        - s["inf_count"].to_numpy(dtype=np.float64)
    )
    power = s["rm2"].to_numpy(dtype=np.float64) ** 2 * finite
    meta = {
        "step": df[("metadata", "step")].to_numpy(),
        "name": df[("metadata", "name")].to_numpy(),
        "tensor_type": df[("metadata", "tensor_type")].to_numpy(),
    }
    parts = []
    with np.errstate(divide="ignore", invalid="ignore"):
        for f in want:
            vals = {c: s[f"{f}.{c}"].to_numpy(dtype=np.float64) for c in _BLOCK_COLUMNS}
            share = {c: np.where(numel > 0, vals[c] / numel, 0.0) for c in _BLOCK_COLUMNS[:3]}
            rel = np.where(power > 0, vals["sq_err"] / power, np.nan)
            parts.append(
                pd.DataFrame(
                    {
                        **meta,
                        "format": f,
                        **share,
                        "rel_err": rel,
                        "block_range": vals["block_range"],
                    }
                )
            )
    return pd.concat(parts, ignore_index=True)
