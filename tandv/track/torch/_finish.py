"""The fused path's rows finished on the host in one compiled call per row kind.

A step's rows reach the host in one buffer; :func:`finish_at` reads each row where it lies
(no gathered copy) and writes its summary vector: the same arithmetic, in the same order,
as :func:`tandv.track.torch._fused.finish_rows` with numpy, which stays the reference (and
the path of rows with block formats or higher moments, and of rows on a device).

Why compiled: the log's writer thread finishes every step's rows, and numpy's
column-by-column form of it is some sixty calls on arrays of a few hundred values, each
holding the interpreter lock that the training thread needs (on a GPU host the training
thread is the bottleneck, and each call hands the lock over and back). One call of a
``nogil`` numba function holds it once, for a few microseconds.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from ...stats.formats import number_format
from ...stats.summary import Layout
from . import _fused

__all__ = ["finish_at", "takes", "warm"]

#: The header fields a row's finishing reads, in the order :func:`_finish` takes them.
_AT = np.array(
    [
        _fused.N_READ,
        _fused.NAN,
        _fused.INF,
        _fused.ZERO,
        _fused.OVER,
        _fused.MIN,
        _fused.MAX,
        _fused.MIN_ABS,
        _fused.MAX_ABS,
        _fused.SCALE_EXP,
        _fused.MEAN,
        _fused.M2,
        _fused.P1,
        _fused.P2,
        _fused.P4,
        _fused.P8,
    ],
    dtype=np.int64,
)


def takes(layout: Layout) -> bool:
    """Whether :func:`finish_at` finishes rows in ``layout`` (of any tensor's spec): all
    but those with block formats (their ratio columns take a logarithm) or higher
    moments."""
    return not layout.num_higher and not _fused._names_of(layout.extras)


def finish_at(
    values: np.ndarray, offsets: np.ndarray, spec: _fused.Spec, layout: Layout
) -> np.ndarray:
    """The summary vectors (float64, one row each) of the rows at ``offsets`` of the 1-D
    float64 ``values`` (a step's rows on the host), rows of ``spec``'s tensors in
    ``layout`` (:func:`takes` must hold): :func:`~tandv.track.torch._fused.finish_rows`
    of the gathered rows, value for value."""
    _, above, _, runs, unwritten = _fused._folding(spec, layout)
    out = np.empty((len(offsets), layout.size))
    _finish(
        values,
        offsets,
        _AT,
        _fused.HEADER,
        spec.nbd,
        above,
        runs,
        unwritten,
        layout.counts_start,
        layout.format.num_bins,
        spec.row_size,
        len(layout.extras),
        out,
    )
    return out


def warm() -> None:
    """Load (the first time ever: compile) :func:`finish_at`'s compiled code in this
    process, by finishing one empty row."""
    spec = _fused.spec_for(torch.float32)
    assert spec is not None
    layout = Layout(number_format("float32"))
    finish_at(np.zeros(_fused.row_size(spec, layout)), np.zeros(1, np.int64), spec, layout)


@numba.njit(cache=True, nogil=True)
def _finish(
    values: np.ndarray,
    offsets: np.ndarray,
    at: np.ndarray,
    header: int,
    nbd: int,
    above: int,
    runs: np.ndarray,
    unwritten: np.ndarray,
    counts_at: int,
    top: int,
    extras_from: int,
    n_extras: int,
    out: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """``finish_rows``'s numpy arithmetic, row by row (each expression as numpy evaluates
    it, so the results are the same bit for bit)."""
    inf = np.inf
    for r in range(offsets.size):
        o = offsets[r]
        numel = values[o + at[0]]
        nan = values[o + at[1]]
        infs = values[o + at[2]]
        zero = values[o + at[3]]
        over_at = values[o + at[4]]
        mn = values[o + at[5]]
        mx = values[o + at[6]]
        amin = values[o + at[7]]
        s = values[o + at[8]]
        e = values[o + at[9]]
        z = nan + infs
        nfin = numel - z
        has = nfin > 0
        h = 2.0 ** (e - 1)
        q = h / (s if s > 0 else 1.0) * 2.0
        q2 = q * q
        mean_f = values[o + at[10]] * numel / (nfin if has else 1.0)
        m2 = values[o + at[11]] - mean_f * mean_f * nfin * z / (numel if numel > 0 else 1.0)
        patched = z > 0 and zero == 0
        row = out[r]
        row[0] = numel
        row[1] = nan
        row[2] = infs
        row[3] = zero
        row[4] = (amin if patched and mn >= 0 else mn) if has else inf
        row[5] = (-amin if patched and mx <= 0 else mx) if has else -inf
        row[6] = amin if has else inf
        row[7] = s if has else 0.0
        row[8] = mean_f * h * 2.0 if has else 0.0
        row[9] = (m2 if m2 > 0 else 0.0) * q2
        row[10] = values[o + at[12]] * q
        row[11] = values[o + at[13]] * q2
        row[12] = values[o + at[14]] * q2 * q2
        q4 = q2 * q2
        row[13] = values[o + at[15]] * (q4 * q4)
        h0 = o + header
        for k in range(unwritten.size):
            row[counts_at + unwritten[k]] = 0.0
        for k in range(runs.shape[0]):
            first, end, to, summed = runs[k, 0], runs[k, 1], runs[k, 2], runs[k, 3]
            if summed:
                total = 0.0
                for j in range(first, end):
                    total += values[h0 + j]
                row[counts_at + to] = total
            else:
                for j in range(first, end):
                    row[counts_at + to + j - first] = values[h0 + j]
        beyond = 0.0
        for j in range(above, nbd):
            beyond += values[h0 + j]
        move = over_at - beyond
        row[counts_at + top] = row[counts_at + top] - move
        row[counts_at + top + 1] = row[counts_at + top + 1] + move + infs
        x0 = counts_at + top + 2
        for j in range(n_extras):
            row[x0 + j] = values[o + extras_from + j]
