"""Send a log's rows to TensorBoard or Weights & Biases, live from a tracker or after the
fact from a log.

``tensorboard(log, logdir)`` writes a finished log; ``TensorBoardSink(logdir)`` passed as
``track(..., sinks=[sink])`` writes each batch of rows as the tracker flushes them. Each
row gives one scalar per statistic, tagged ``<tensor_type>/<name>/<statistic>``, and its
exponent counts as a histogram of magnitudes, tagged ``<tensor_type>/<name>/exponents``,
whose bucket edges are powers of two: the bucket ending at ``2**(n+1)`` counts the values
with ``2**n <= |x| < 2**(n+1)``. Values that underflow the log's number format fill one
bucket below the lowest exponent column, values that overflow it one bucket ending at the
largest double. Needs the ``tensorboard`` package (not TensorFlow).

``WandbSink(run)`` / ``wandb(log, run)`` log the same scalars to a W&B run, one
``run.log`` per step, and the exponent counts as a histogram of ``log2|x|`` with one bin
per exponent (a linear axis of magnitudes would crush them), underflow and overflow in a
bin just below and above. The step travels as a metric of tandv's own, ``tandv/step``,
declared (``run.define_metric``) as the x-axis of every ``<tensor_type>/*`` key, never
as ``run.log(step=...)``: W&B drops a row whose ``step=`` is below its current step, and
a live sink's rows arrive ``flush_every`` steps late, after the user's own ``run.log``
calls have moved that step on. A call W&B refuses (a finished run) is reported once as a
warning, with the steps lost, and the log on disk is not affected.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Sequence
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

__all__ = ["TensorBoardSink", "tensorboard", "WandbSink", "wandb", "DEFAULT_SCALARS", "STEP_METRIC"]

#: The W&B metric that carries a row's tandv step (the x-axis of tandv's keys).
STEP_METRIC = "tandv/step"

#: The statistics written as scalars by default.
DEFAULT_SCALARS: tuple[str, ...] = (
    "mean",
    "std",
    "rm2",
    "max_abs",
    "min_abs",
    "zero_count",
    "nan_count",
    "inf_count",
)


class TensorBoardSink:
    """Writes log rows as TensorBoard scalars and magnitude histograms into ``logdir``.

    Arguments:
        logdir: the TensorBoard log directory (created if absent).
        scalars: the statistics to write as scalars (``None``: every statistic column).
        histograms: also write the exponent counts as histograms.

    Call it with a DataFrame of rows (the tracker does, at each flush), then :meth:`close`.
    """

    def __init__(
        self,
        logdir: str | os.PathLike,
        scalars: Sequence[str] | None = DEFAULT_SCALARS,
        histograms: bool = True,
    ) -> None:
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as e:
            raise ImportError(
                "TensorBoardSink needs the `tensorboard` package: pip install tensorboard"
            ) from e
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self.logdir))
        self.scalars = None if scalars is None else tuple(scalars)
        self.histograms = histograms

    def __call__(self, rows: pd.DataFrame) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary

        if rows.empty:
            return
        stat_cols = _stat_columns(rows, self.scalars)
        exps, counts = _exponent_matrix(rows)
        # bucket upper edges: underflow below the lowest exponent, 2**(n+1), then overflow
        limits = [
            2.0 ** exps[0] if exps else 0.0,
            *(2.0 ** (e + 1) for e in exps),
            sys.float_info.max,
        ]
        meta = rows[METADATA]
        stats = rows[SCALAR_STATS][stat_cols].to_numpy(dtype=np.float64)
        wall = time.time()
        for i, (name, kind, step) in enumerate(
            zip(meta["name"], meta["tensor_type"], meta["step"])
        ):
            values = [
                Summary.Value(tag=f"{kind}/{name}/{s}", simple_value=float(v))
                for s, v in zip(stat_cols, stats[i])
            ]
            if self.histograms and counts[i].any():
                values.append(
                    Summary.Value(
                        tag=f"{kind}/{name}/exponents",
                        histo=_histogram(HistogramProto, rows.iloc[i], counts[i], limits),
                    )
                )
            self._writer.add_event(
                Event(wall_time=wall, step=int(step), summary=Summary(value=values))
            )

    def close(self) -> None:
        """Write everything to disk and close the event file."""
        self._writer.close()


def _stat_columns(rows: pd.DataFrame, wanted: tuple[str, ...] | None) -> list[str]:
    """The rows' statistics a sink sends: those in ``wanted`` (all with ``None``)."""
    return [c for c in rows[SCALAR_STATS].columns if wanted is None or c in wanted]


def _exponent_matrix(rows: pd.DataFrame) -> tuple[list[int], np.ndarray]:
    """The rows' exponent counts over a contiguous range: ``(exponents, counts)`` with
    ``counts[:, 0]`` the underflow, then one column per exponent of ``exponents`` (a log
    may omit all-zero columns: they count zero here), then the overflow."""
    table = rows[EXPONENT_COUNTS]
    ints = sorted(int(lab) for lab in table.columns if lab not in (UNDERFLOW, OVERFLOW))
    exps = list(range(ints[0], ints[-1] + 1)) if ints else []
    out = np.zeros((len(rows), len(exps) + 2))
    for lab in table.columns:
        j = 0 if lab == UNDERFLOW else len(exps) + 1 if lab == OVERFLOW else int(lab) - exps[0] + 1
        out[:, j] = table[lab].to_numpy(dtype=np.float64)
    return exps, out


def _histogram(proto: Any, row: pd.Series, counts: np.ndarray, limits: list[float]) -> Any:
    """The magnitude histogram of one row: buckets from the first to the last non-empty."""
    nz = np.flatnonzero(counts)
    lo, hi = nz[0], nz[-1] + 1
    n = counts.sum()
    stat = row[SCALAR_STATS]
    finite = float(stat["numel"] - stat["nan_count"] - stat["inf_count"])
    lower = limits[lo - 1] if lo > 0 else 0.0
    return proto(
        min=lower,
        max=float(stat["max_abs"]) if stat["max_abs"] > 0 else limits[hi - 1],
        num=float(n),
        sum=float(stat["mean_abs"]) * finite,
        sum_squares=float(stat["rm2"]) ** 2 * finite,
        bucket_limit=limits[lo:hi],
        bucket=[float(c) for c in counts[lo:hi]],
    )


def tensorboard(
    log: str | os.PathLike | pd.DataFrame,
    logdir: str | os.PathLike,
    scalars: Sequence[str] | None = DEFAULT_SCALARS,
    histograms: bool = True,
    *,
    trust_pickle: bool = False,
) -> Path:
    """Write a log (a path or a DataFrame) as TensorBoard events into ``logdir``; returns
    ``logdir``. See :class:`TensorBoardSink` for what is written. A pickle log is read only
    with ``trust_pickle=True`` (unpickling runs code stored in the file)."""
    if isinstance(log, pd.DataFrame):
        df = log
    else:
        from .schema import read_log

        df = read_log(log, trust_pickle=trust_pickle)
    sink = TensorBoardSink(logdir, scalars, histograms)
    try:
        sink(df)
    finally:
        sink.close()
    return Path(logdir)


class WandbSink:
    """Logs rows to a Weights & Biases run (see the module notes): one W&B row per tandv
    step, its step in the metric ``tandv/step`` (the x-axis of tandv's keys), so no row is
    dropped whatever else logs to the run; :attr:`refused_steps` lists the steps whose
    call W&B refused (told once as a warning).

    Arguments:
        run: a run from ``wandb.init(...)`` (offline mode works); the caller finishes it.
        scalars: the statistics to log (``None``: every statistic column).
        histograms: also log the exponent counts as histograms of log2|x|.
    """

    def __init__(
        self, run: Any, scalars: Sequence[str] | None = DEFAULT_SCALARS, histograms: bool = True
    ) -> None:
        if not callable(getattr(run, "log", None)):
            raise TypeError(
                f"WandbSink(run=...): expected a run from wandb.init(); got {type(run).__name__}"
            )
        self.run = run
        self.scalars = None if scalars is None else tuple(scalars)
        self.histograms = histograms
        self._declared = False
        self._refused: list[int] = []  # steps W&B refused (told once)

    def _declare(self) -> None:
        """Make ``tandv/step`` the x-axis of tandv's keys (once, before the first row)."""
        self._declared = True
        define = getattr(self.run, "define_metric", None)
        if define is None:  # a run-like object without custom axes: the step still travels
            return
        define(STEP_METRIC)
        for kind in TENSOR_TYPES:
            define(f"{kind}/*", step_metric=STEP_METRIC)

    def __call__(self, rows: pd.DataFrame) -> None:
        if rows.empty:
            return
        import wandb as wb

        stat_cols = _stat_columns(rows, self.scalars)
        exps, counts = _exponent_matrix(rows)
        first = exps[0] if exps else 0
        edges = np.arange(first - 1, first + len(exps) + 2, dtype=np.float64)  # log2|x|
        meta = rows[METADATA]
        stats = rows[SCALAR_STATS][stat_cols].to_numpy(dtype=np.float64)
        steps = meta["step"].to_numpy()
        for step in np.unique(steps):
            logged: dict[str, Any] = {}
            for i in np.flatnonzero(steps == step):
                base = f"{meta['tensor_type'].iat[i]}/{meta['name'].iat[i]}"
                logged.update({f"{base}/{s}": float(v) for s, v in zip(stat_cols, stats[i])})
                if self.histograms and counts[i].any():
                    logged[f"{base}/log2_abs"] = wb.Histogram(np_histogram=(counts[i], edges))
            logged[STEP_METRIC] = int(step)
            self._send(logged, int(step))

    def _send(self, logged: dict[str, Any], step: int) -> None:
        """One ``run.log`` call (a W&B row of its own); a refusal is told once and counted."""
        try:
            if not self._declared:
                self._declare()
            self.run.log(logged)
        except Exception as e:  # W&B refused the call: say so, keep the log going
            self._refused.append(step)
            if len(self._refused) == 1:
                warnings.warn(
                    f"tandv: WandbSink: W&B refused the rows of step {step} "
                    f"({type(e).__name__}: {e}); later refusals are counted in "
                    f"sink.refused_steps, not told. The tandv log on disk has every row.",
                    RuntimeWarning,
                    stacklevel=2,
                )

    @property
    def refused_steps(self) -> list[int]:
        """The steps whose ``run.log`` call W&B refused (raised)."""
        return list(self._refused)


def wandb(
    log: str | os.PathLike | pd.DataFrame,
    run: Any,
    scalars: Sequence[str] | None = DEFAULT_SCALARS,
    histograms: bool = True,
    *,
    trust_pickle: bool = False,
) -> None:
    """Log a log (a path or a DataFrame) to the W&B ``run``; see :class:`WandbSink`. A
    pickle log is read only with ``trust_pickle=True`` (unpickling runs code stored in
    the file)."""
    if isinstance(log, pd.DataFrame):
        df = log
    else:
        from .schema import read_log

        df = read_log(log, trust_pickle=trust_pickle)
    WandbSink(run, scalars, histograms)(df)
