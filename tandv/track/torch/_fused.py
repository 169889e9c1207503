"""Fused one-pass summaries of device tensors, written in Triton.

One kernel reads each tensor once, in its own dtype, and writes a small *row*: counts of
NaN, inf, zeros and of values above the format's max, the extrema, scaled moments and
the counts of each exponent of the dtype. :func:`finish_rows` turns rows into the
layout's summary vectors (:mod:`tandv.stats.summary`) on the host.

How a program works
-------------------
A program reads a contiguous range of one tensor, :data:`BLOCK` elements at a time,
into registers. Per block it reduces the counts and extrema, and sums the moments of the
block's values scaled by a power of two ``2**-E`` (``E`` the running scale: every
magnitude is below ``2**E``, so no power overflows float32): the power sums of ``|x|``,
and the mean and centred second moment by Chan's formula, the block's deviations taken
from its own rounded mean (well conditioned even when ``|mean| >> std``). Blocks merge
into float64 scalars; a larger ``E`` rescales what came before (a power of two: exact).

Exponent counts without contended global atomics: each program counts its blocks with
``tl.histogram`` (which Triton 3.9 lowers to shared-memory atomics, one per element) into
its own registers, and adds its table to the tensor's row once. The dtype's exponent of
every finite non-zero value is exact, float32 subnormals included.

Programs of one tensor
----------------------
A tensor of up to :data:`MIN_CHUNK` elements is one program, which writes the tensor's
row. A larger tensor is split among programs: each adds its exponent counts to the row
with one atomic add per occupied bin, writes its other partials to a scratch row, and
counts itself done on an atomic counter; the last program merges the partial rows into
the tensor's row. So one launch per tensor (or per batch of tensors: :func:`launch_many`
takes a table of addresses), no second stage, no memset per launch (the caller zeroes
the row buffer once per step).

Everything here also runs on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``),
which the tests use against the numpy reference.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import ml_dtypes
import numpy as np
import torch
import triton
import triton.language as tl

from ...stats.formats import number_format
from ...stats.summary import Layout, pack_summary

if "mask" not in inspect.signature(tl.histogram).parameters:
    raise ImportError(
        f"tandv's fused kernels need Triton >= 3.4 (masked tl.histogram); "
        f"found {triton.__version__}"
    )

__all__ = [
    "HEADER",
    "Spec",
    "spec_for",
    "launch_one",
    "launch_many",
    "finish_rows",
    "row_size",
    "scratch_rows",
]

# The fields of a row, in order; the exponent counts follow the counter.
(
    NAN,
    INF,
    ZERO,
    OVER,
    MIN,
    MAX,
    MIN_ABS,
    MAX_ABS,
    SCALE_EXP,
    N_FINITE,
    MEAN,
    M2,
    P1,
    P2,
    P4,
    P8,
) = range(16)
#: Length of a partial row (a program's share of a tensor).
PART = 16
#: Index of the counter of finished programs.
COUNTER = 16
#: Length of a row before its exponent counts.
HEADER = 17

#: Elements a program holds in registers at once.
BLOCK = 2048
#: A tensor of at most this many elements is one program (a multiple of BLOCK).
MIN_CHUNK = 8 * BLOCK
#: Partial rows the last program of a tensor merges per iteration.
GROUP = 32
NUM_WARPS = 8
#: The table columns of :func:`launch_many`.
_TABLE = 7

_F32_MAX = float(np.finfo(np.float32).max)


# ---------------------------------------------------------------------------- kernels


@triton.jit
def _pow2_f32(e):
    """2**e as float32, for integer e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _pow2_f64(e):
    """2**e as float64, for integer e in [-1022, 1023]."""
    return ((e.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _exponent(bits, SUB: tl.constexpr):
    """floor(log2 m) of finite non-zero float32 magnitudes m given by their bits; with
    ``SUB``, exact for subnormals too (their mantissa, an integer, converts exactly)."""
    field = bits >> 23
    e = field - 127
    if SUB:
        lead = (bits.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
        e = tl.where(field == 0, lead - 149, e)
    return e


@triton.jit
def _typed(addr, MODE: tl.constexpr):
    """The address ``addr`` (int64) as a pointer to the elements :func:`_load` reads."""
    if MODE == 0:
        p = addr.to(tl.pointer_type(tl.float32))
    elif MODE == 1:
        p = addr.to(tl.pointer_type(tl.float16))
    elif MODE == 2:
        p = addr.to(tl.pointer_type(tl.int16))
    else:
        p = addr.to(tl.pointer_type(tl.uint8))
    return p


@triton.jit
def _load(ptr, idx, m, lut_ptr, MODE: tl.constexpr):
    """Elements ``idx`` of a tensor as float32 (exact): float32 and float16 as they are,
    bfloat16 from its bits (the top half of a float32), 8-bit formats through a table of
    their 256 values."""
    if MODE == 0:
        x = tl.load(ptr + idx, mask=m, other=0.0)
    elif MODE == 1:
        x = tl.load(ptr + idx, mask=m, other=0.0).to(tl.float32)
    elif MODE == 2:
        b = tl.load(ptr + idx, mask=m, other=0)
        x = ((b.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        b = tl.load(ptr + idx, mask=m, other=0)
        x = tl.load(lut_ptr + b.to(tl.int32), mask=m, other=0.0)
    return x


@triton.jit
def _no_moments():
    """The moments of no values: scale exponent (below any float32's), count, mean, m2
    and the power sums."""
    zero = tl.full([], 0.0, tl.float64)
    return tl.full([], -149, tl.int32), zero, zero, zero, zero, zero, zero, zero


@triton.jit
def _merge(a, b):
    """Merge two partial moment sets ``(E, n, mean, m2, p1, p2, p4, p8)``, their sums
    scaled by ``2**-E`` and ``2**-Eb``, into one scaled by ``2**-max(E, Eb)`` (Chan et al.
    for the centred second moment)."""
    E, n, mean, m2, p1, p2, p4, p8 = a
    Eb, nb, meanb, m2b, p1b, p2b, p4b, p8b = b
    Ec = tl.maximum(E, Eb)
    r = _pow2_f64(E - Ec)
    rb = _pow2_f64(Eb - Ec)
    r2 = r * r
    rb2 = rb * rb
    r4 = r2 * r2
    rb4 = rb2 * rb2
    mean = mean * r
    meanb = meanb * rb
    nt = n + nb
    w = nb / tl.maximum(nt, 1.0)
    delta = meanb - mean
    m2 = m2 * r2 + m2b * rb2 + delta * delta * n * w
    mean = mean + delta * w
    p1 = p1 * r + p1b * rb
    p2 = p2 * r2 + p2b * rb2
    p4 = p4 * r4 + p4b * rb4
    p8 = p8 * (r4 * r4) + p8b * (rb4 * rb4)
    return Ec, nt, mean, m2, p1, p2, p4, p8


@triton.jit
def _scan(
    ptr,
    start,
    end,
    lut_ptr,
    fmax,
    MODE: tl.constexpr,
    SUB: tl.constexpr,
    DMIN: tl.constexpr,
    NBP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The partial summary of elements ``[start, end)`` of a tensor, and its exponent
    counts (index ``e - DMIN`` for exponent ``e``) in ``NBP`` registers."""
    ar = tl.arange(0, BLOCK)
    nan_c = tl.full([], 0, tl.int64)
    inf_c = tl.full([], 0, tl.int64)
    zero_c = tl.full([], 0, tl.int64)
    over_c = tl.full([], 0, tl.int64)
    mn = tl.full([], float("inf"), tl.float32)
    mx = tl.full([], float("-inf"), tl.float32)
    amin = tl.full([], 0x7F800000, tl.int32)  # bits of the smallest finite magnitude
    amax = tl.full([], 0, tl.int32)
    E, n, mean, m2, p1, p2, p4, p8 = _no_moments()
    hist = tl.zeros([NBP], tl.int32)
    for off in range(start, end, BLOCK):
        idx = off + ar
        m = idx < end
        x = _load(ptr, idx, m, lut_ptr, MODE)
        bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        fin = m & (bits < 0x7F800000)
        zero = m & (bits == 0)
        nan_c += tl.sum((m & (bits > 0x7F800000)).to(tl.int32))
        inf_c += tl.sum((m & (bits == 0x7F800000)).to(tl.int32))
        zero_c += tl.sum(zero.to(tl.int32))
        xf = tl.where(fin, x, 0.0)
        a = tl.abs(xf)
        over_c += tl.sum((a > fmax).to(tl.int32))
        mn = tl.minimum(mn, tl.min(tl.where(fin, x, float("inf"))))
        mx = tl.maximum(mx, tl.max(tl.where(fin, x, float("-inf"))))
        amin = tl.minimum(amin, tl.min(tl.where(fin, bits, 0x7F800000)))
        top_bits = tl.max(tl.where(fin, bits, 0))
        amax = tl.maximum(amax, top_bits)

        # moments of the block, scaled by 2**-Eb, Eb the block's largest exponent + 1 (at
        # least the running E; subnormals exactly: -148 for 2**-149), in two factors that
        # each stay a normal float32
        Eb = tl.maximum(E, _exponent(top_bits, SUB) + 1)
        h = Eb >> 1
        q_signed = (xf * _pow2_f32(-h)) * _pow2_f32(h - Eb)
        q = tl.abs(q_signed)
        nb = tl.sum(fin.to(tl.int32)).to(tl.float64)
        # float64 sum for the mean (it may be far smaller than the spread); the centred
        # sum from deviations of the float32-rounded mean c, corrected for c's offset
        meanb = tl.sum(q_signed.to(tl.float64)) / tl.maximum(nb, 1.0)
        c = meanb.to(tl.float32)
        d = tl.where(fin, q_signed - c, 0.0)
        shift = meanb - c.to(tl.float64)
        m2b = tl.sum(d * d).to(tl.float64) - nb * shift * shift
        q2 = q * q
        q4 = q2 * q2
        p1b = tl.sum(q).to(tl.float64)
        p2b = tl.sum(q2).to(tl.float64)
        p4b = tl.sum(q4).to(tl.float64)
        p8b = tl.sum(q4 * q4).to(tl.float64)
        block = (Eb, nb, meanb, tl.maximum(m2b, 0.0), p1b, p2b, p4b, p8b)
        E, n, mean, m2, p1, p2, p4, p8 = _merge((E, n, mean, m2, p1, p2, p4, p8), block)

        # exponent counts
        ex = _exponent(bits, SUB) - DMIN
        hist += tl.histogram(ex, NBP, mask=fin & ~zero)
    amin_f, amax_f = amin.to(tl.float32, bitcast=True), amax.to(tl.float32, bitcast=True)
    counts = (nan_c, inf_c, zero_c, over_c, mn, mx, amin_f, amax_f)
    return counts, (E, n, mean, m2, p1, p2, p4, p8), hist


@triton.jit
def _store_part(ptr, counts, moments):
    """Writes the 16 fields of a (partial) row at ``ptr`` as float64: the 8 ``counts``
    ``(nan, inf, zero, over, min, max, min|x|, max|x|)``, then the 8 ``moments``."""
    for i in tl.static_range(8):
        tl.store(ptr + i, counts[i].to(tl.float64))
    for i in tl.static_range(8):
        tl.store(ptr + 8 + i, moments[i].to(tl.float64))


@triton.jit
def _column(tile, cols, c: tl.constexpr):
    """Column ``c`` of a ``[GROUP, 16]`` tile of partial rows."""
    return tl.sum(tl.where(cols[None, :] == c, tile, 0.0), axis=1)


@triton.jit
def _merge_parts(base, n_parts, GROUP: tl.constexpr):
    """The merge of the ``n_parts`` partial rows at ``base`` (written by other programs:
    read past the caches)."""
    g = tl.arange(0, GROUP)
    cols = tl.arange(0, 16)
    nan_c = tl.full([], 0.0, tl.float64)
    inf_c = tl.full([], 0.0, tl.float64)
    zero_c = tl.full([], 0.0, tl.float64)
    over_c = tl.full([], 0.0, tl.float64)
    mn = tl.full([], float("inf"), tl.float64)
    mx = tl.full([], float("-inf"), tl.float64)
    amin = tl.full([], float("inf"), tl.float64)
    amax = tl.full([], 0.0, tl.float64)
    E, n, mean, m2, p1, p2, p4, p8 = _no_moments()
    for i0 in range(0, n_parts, GROUP):
        ok = (i0 + g) < n_parts
        tile = tl.load(
            base + (i0 + g)[:, None] * 16 + cols[None, :],
            mask=ok[:, None],
            other=0.0,
            volatile=True,
        )
        nan_c += tl.sum(_column(tile, cols, 0))
        inf_c += tl.sum(_column(tile, cols, 1))
        zero_c += tl.sum(_column(tile, cols, 2))
        over_c += tl.sum(_column(tile, cols, 3))
        mn = tl.minimum(mn, tl.min(tl.where(ok, _column(tile, cols, 4), float("inf"))))
        mx = tl.maximum(mx, tl.max(tl.where(ok, _column(tile, cols, 5), float("-inf"))))
        amin = tl.minimum(amin, tl.min(tl.where(ok, _column(tile, cols, 6), float("inf"))))
        amax = tl.maximum(amax, tl.max(_column(tile, cols, 7)))
        Ei = tl.where(ok, _column(tile, cols, 8), -149.0).to(tl.int32)
        ni = _column(tile, cols, 9)
        Eg = tl.max(Ei)
        r = _pow2_f64(Ei - Eg)
        r2 = r * r
        r4 = r2 * r2
        meani = _column(tile, cols, 10) * r
        ng = tl.sum(ni)
        meang = tl.sum(ni * meani) / tl.maximum(ng, 1.0)
        dev = meani - meang
        m2g = tl.sum(_column(tile, cols, 11) * r2 + ni * dev * dev)
        p1g = tl.sum(_column(tile, cols, 12) * r)
        p2g = tl.sum(_column(tile, cols, 13) * r2)
        p4g = tl.sum(_column(tile, cols, 14) * r4)
        p8g = tl.sum(_column(tile, cols, 15) * (r4 * r4))
        group = (Eg, ng, meang, m2g, p1g, p2g, p4g, p8g)
        E, n, mean, m2, p1, p2, p4, p8 = _merge((E, n, mean, m2, p1, p2, p4, p8), group)
    return (nan_c, inf_c, zero_c, over_c, mn, mx, amin, amax), (E, n, mean, m2, p1, p2, p4, p8)


@triton.jit
def _summarize(
    ptr,
    start,
    end,
    row,
    part_ptr,
    parts_ptr,
    n_parts,
    lut_ptr,
    fmax,
    MODE: tl.constexpr,
    SUB: tl.constexpr,
    DMIN: tl.constexpr,
    NBD: tl.constexpr,
    NBP: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
):
    """One program's share ``[start, end)`` of a tensor whose row is at ``row``; with
    ``n_parts > 1`` programs, its partial row goes to ``part_ptr`` and the last program
    merges the ``n_parts`` rows at ``parts_ptr`` into ``row``."""
    counts, moments, hist = _scan(ptr, start, end, lut_ptr, fmax, MODE, SUB, DMIN, NBP, BLOCK)
    bins = tl.arange(0, NBP)
    if n_parts == 1:
        _store_part(row, counts, moments)
        tl.store(row + 17 + bins, hist.to(tl.float64), mask=bins < NBD)
    else:
        _store_part(part_ptr, counts, moments)
        tl.atomic_add(
            row + 17 + bins, hist.to(tl.float64), mask=(bins < NBD) & (hist != 0), sem="relaxed"
        )  # read only by the host, after the kernel
        # every thread's stores before the counter's release (a barrier, then the atomic)
        tl.debug_barrier()
        done = tl.atomic_add(row + 16, 1.0, sem="acq_rel")
        if done == n_parts - 1:
            # the last program of the tensor (new names: a branch may not retype a value)
            all_counts, all_moments = _merge_parts(parts_ptr, n_parts, GROUP)
            _store_part(row, all_counts, all_moments)


@triton.jit(do_not_specialize=["n", "row_off"])
def _summarize_one(
    x_ptr,
    n,
    per_prog,
    rows_ptr,
    row_off,
    scratch_ptr,
    lut_ptr,
    fmax,
    MODE: tl.constexpr,
    SUB: tl.constexpr,
    DMIN: tl.constexpr,
    NBD: tl.constexpr,
    NBP: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
):
    """One tensor ``x_ptr`` of ``n`` elements, ``per_prog`` per program, into the row at
    ``rows_ptr + row_off``."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * per_prog
    end = tl.minimum(start + per_prog, n)
    if MODE == 2:  # bfloat16: read as int16 bits
        ptr = x_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
    else:
        ptr = x_ptr
    _summarize(
        ptr,
        start,
        end,
        rows_ptr + row_off,
        scratch_ptr + pid * 16,
        scratch_ptr,
        tl.num_programs(0),
        lut_ptr,
        fmax,
        MODE,
        SUB,
        DMIN,
        NBD,
        NBP,
        BLOCK,
        GROUP,
    )


@triton.jit
def _summarize_many(
    table_ptr,
    rows_ptr,
    scratch_ptr,
    lut_ptr,
    fmax,
    MODE: tl.constexpr,
    SUB: tl.constexpr,
    DMIN: tl.constexpr,
    NBD: tl.constexpr,
    NBP: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Many tensors of one dtype: program ``i`` reads row ``i`` of the table ``(address,
    start, end, row offset, part, parts, first part)``."""
    t = table_ptr + tl.program_id(0) * 7
    ptr = _typed(tl.load(t), MODE)
    part = tl.load(t + 4)
    first = tl.load(t + 6)
    _summarize(
        ptr,
        tl.load(t + 1),
        tl.load(t + 2),
        rows_ptr + tl.load(t + 3),
        scratch_ptr + (first + part) * 16,
        scratch_ptr + first * 16,
        tl.load(t + 5),
        lut_ptr,
        fmax,
        MODE,
        SUB,
        DMIN,
        NBD,
        NBP,
        BLOCK,
        GROUP,
    )


#: Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when this module
#: was imported), which reads CPU tensors; compiled kernels read CUDA tensors.
INTERPRETED = not isinstance(_summarize_one, triton.runtime.JITFunction)


# ---------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class Spec:
    """How the kernel reads one torch dtype.

    Attributes:
        dtype: the torch dtype.
        mode: 0 float32, 1 float16, 2 bfloat16 (as int16 bits), 3 an 8-bit format (as
            uint8 codes through a table of their values).
        sub: whether values can be float32 subnormals (their exponents need more work).
        dmin, nbd: the dtype's smallest exponent and its number of exponents: a row
            holds ``nbd`` counts, of exponents ``dmin .. dmin + nbd - 1``.
        lut: the 256 values of an 8-bit format as float32 (mode 3), else ``None``.
    """

    dtype: torch.dtype
    mode: int
    sub: bool
    dmin: int
    nbd: int
    lut: np.ndarray | None = field(default=None, compare=False)

    @property
    def nbp(self) -> int:
        """Registers of a program's exponent table: ``nbd`` rounded up to a power of two."""
        return 1 << max(4, (self.nbd - 1).bit_length())

    @property
    def row_size(self) -> int:
        """Length of a row, custom statistics excluded."""
        return HEADER + self.nbd


_MODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@cache
def spec_for(dtype: torch.dtype) -> Spec | None:
    """The :class:`Spec` of ``dtype``, or ``None`` if the kernel does not read it (float64,
    and formats wider than 8 bits that are not float32, float16 or bfloat16)."""
    name = str(dtype).removeprefix("torch.")
    mode = _MODES.get(dtype)
    lut = None
    if mode is None and (dtype.itemsize != 1 or not hasattr(ml_dtypes, name)):
        return None
    try:
        fmt = number_format(name)
    except ValueError:  # an 8-bit type tandv has no number format for
        return None
    if mode is None:
        mode = 3
        lut = np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, name)).astype(np.float32)
    return Spec(dtype, mode, fmt.min_exponent < -126, fmt.min_exponent, fmt.num_bins, lut)


def row_size(spec: Spec, layout: Layout) -> int:
    """Length of a row of ``spec``'s tensors in ``layout`` (custom statistics included)."""
    return spec.row_size + len(layout.extras)


def _fmax(layout: Layout) -> float:
    """The format's largest finite value as the kernel compares it (float32: a format
    wider than float32 has no float32 value above its max)."""
    return layout.format.max if layout.format.max <= _F32_MAX else math.inf


_luts: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _lut(spec: Spec, device: torch.device, fallback: torch.Tensor) -> torch.Tensor:
    """The value table of an 8-bit format on ``device`` (``fallback`` when none is read)."""
    if spec.lut is None:
        return fallback
    key = (spec.dtype, device)
    t = _luts.get(key)
    if t is None:
        t = _luts[key] = torch.from_numpy(spec.lut).to(device)
    return t


def _parts(n: int, max_parts: int) -> tuple[int, int]:
    """``(parts, elements per part)`` for a tensor of ``n`` elements: one part up to
    :data:`MIN_CHUNK` elements, at most ``max_parts``, each a multiple of :data:`BLOCK`."""
    parts = min(max(1, -(-n // MIN_CHUNK)), max_parts)
    per_part = -(-n // parts)
    per = -(-per_part // BLOCK) * BLOCK
    return -(-n // per), per


def scratch_rows(n: int, max_parts: int) -> int:
    """Scratch rows (of :data:`PART` float64) one tensor of ``n`` elements needs."""
    parts = _parts(n, max_parts)[0]
    return parts if parts > 1 else 0


@cache
def _consts(spec: Spec) -> dict[str, Any]:
    """The compile-time arguments and launch options of ``spec``'s kernels."""
    return dict(
        MODE=spec.mode,
        SUB=spec.sub,
        DMIN=spec.dmin,
        NBD=spec.nbd,
        NBP=spec.nbp,
        BLOCK=BLOCK,
        GROUP=GROUP,
        num_warps=NUM_WARPS,
        enable_fp_fusion=True,
    )


def _flat(x: torch.Tensor, spec: Spec) -> torch.Tensor:
    """``x``'s elements as one dense range of memory: ``x`` itself when it covers its
    memory without gaps in any order (the statistics ignore order), else a contiguous
    copy (and a lazily negated view, whose memory holds the values' negatives, is resolved
    into one). 8-bit formats are viewed as bytes."""
    if x.is_neg():
        x = x.resolve_neg()
    if not (x.is_contiguous() or _dense(x)):
        x = x.contiguous()
    if spec.mode == 3:
        x = x.view(torch.uint8)
    return x


def _dense(x: torch.Tensor) -> bool:
    """Whether ``x``'s elements fill ``numel`` consecutive memory slots starting at its
    data pointer (a permuted contiguous tensor: ``x.t()``, channels-last)."""
    expect = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expect:
            return False
        expect *= size
    return True


def launch_one(
    x: torch.Tensor,
    spec: Spec,
    layout: Layout,
    rows: torch.Tensor,
    offset: int,
    scratch: torch.Tensor,
    max_parts: int,
) -> None:
    """Summarize ``x`` (dtype ``spec.dtype``, not empty) into ``rows[offset:]`` (zeros) in
    one launch, on the current stream; ``scratch`` holds :func:`scratch_rows` rows."""
    flat = _flat(x, spec)
    n = flat.numel()
    parts, per = _parts(n, max_parts)
    _summarize_one[(parts,)](
        flat,
        n,
        per,
        rows,
        offset,
        scratch,
        _lut(spec, x.device, rows),
        _fmax(layout),
        **_consts(spec),
    )


def launch_many(
    tensors: Sequence[torch.Tensor],
    spec: Spec,
    layout: Layout,
    rows: torch.Tensor,
    offsets: Sequence[int],
    scratch_for: Any,
    max_parts: int,
) -> None:
    """Summarize non-empty tensors of dtype ``spec.dtype`` on one device into
    ``rows[offsets[i]:]`` in one launch, on the current stream.

    ``scratch_for(k)`` must return a float64 tensor of at least ``k`` partial rows. The
    table (and any contiguous copy of a gappy view) may be dropped once launched: the
    caching allocator reuses memory only for work queued after it on this stream."""
    flats = [_flat(t, spec) for t in tensors]
    ns = np.array([f.numel() for f in flats], dtype=np.int64)
    split = [_parts(int(k), max_parts) for k in ns]
    parts = np.array([p for p, _ in split], dtype=np.int64)
    per = np.array([q for _, q in split], dtype=np.int64)
    owner = np.repeat(np.arange(len(flats)), parts)
    first_of = np.cumsum(parts) - parts
    part = np.arange(owner.size) - first_of[owner]
    multi = parts > 1
    scratch_first = np.cumsum(np.where(multi, parts, 0)) - np.where(multi, parts, 0)
    table = np.empty((owner.size, _TABLE), dtype=np.int64)
    table[:, 0] = np.array([f.data_ptr() for f in flats], dtype=np.int64)[owner]
    table[:, 1] = part * per[owner]
    table[:, 2] = np.minimum(table[:, 1] + per[owner], ns[owner])
    table[:, 3] = np.asarray(offsets, dtype=np.int64)[owner]
    table[:, 4] = part
    table[:, 5] = parts[owner]
    table[:, 6] = scratch_first[owner]
    scratch = scratch_for(int(parts[multi].sum()))
    host_table = torch.from_numpy(table)
    if rows.device.type == "cuda":  # pinned by the caching host allocator: reused once copied
        host_table = host_table.pin_memory()
    dev_table = host_table.to(rows.device, non_blocking=True)
    _summarize_many[(owner.size,)](
        dev_table, rows, scratch, _lut(spec, rows.device, rows), _fmax(layout), **_consts(spec)
    )


def finish_rows(rows: Any, spec: Spec, layout: Layout, xp: Any = np) -> Any:
    """The layout's summary vectors (``CORE_FIELDS``, exponent counts, custom statistics)
    from rows of ``spec``'s tensors, one per row of the 2-D array ``rows``.

    Arguments:
        rows: float64 rows of :func:`row_size` values (numpy, or torch with ``xp=torch``).
        xp: the array module: ``numpy`` (host) or ``torch`` (on the rows' device).
    """
    col = [rows[:, i] for i in range(PART)]
    nfin = col[N_FINITE]
    has = nfin > 0
    numel = nfin + col[NAN] + col[INF]
    s = col[MAX_ABS]
    e = col[SCALE_EXP]
    # moments were summed of x / 2**E; the layout's are of x / max|x| (1 when 0)
    r = 2.0**e / xp.where(s > 0, s, 1.0)
    r2 = r * r
    inf = float("inf")
    core = {
        "numel": numel,
        "nan_count": col[NAN],
        "inf_count": col[INF],
        "zero_count": col[ZERO],
        "min": xp.where(has, col[MIN], inf),
        "max": xp.where(has, col[MAX], -inf),
        "min_abs": xp.where(has, col[MIN_ABS], inf),
        "max_abs": xp.where(has, s, 0.0),
        "mean": xp.where(has, col[MEAN] * 2.0**e, 0.0),
        "m2": col[M2] * r2,
        "p1": col[P1] * r,
        "p2": col[P2] * r2,
        "p4": col[P4] * r2 * r2,
        "p8": col[P8] * (r2 * r2) ** 2,
    }
    fold, above = _fold(spec, layout.format.name)
    hist = rows[:, HEADER : HEADER + spec.nbd]
    if xp is np:
        counts = hist @ fold
        beyond = hist[:, above:].sum(axis=1)
    else:
        counts = hist @ torch.from_numpy(fold).to(rows.device)
        beyond = hist[:, above:].sum(dim=1)
    # the kernel counted every finite value above the format's max; those whose exponent
    # is the format's top one (float8_e4m3fn: 448 < x < 512) sit in the top bin: move them
    move = col[OVER] - beyond
    top, over = layout.format.num_bins, layout.format.num_bins + 1
    counts[:, top] = counts[:, top] - move
    counts[:, over] = counts[:, over] + move + col[INF]
    extras = rows[:, spec.row_size : spec.row_size + len(layout.extras)]
    return pack_summary(core, counts, extras, xp)


@cache
def _fold(spec: Spec, fmt_name: str) -> tuple[np.ndarray, int]:
    """The 0/1 matrix taking a row's dtype exponent counts to the format's count bins, and
    the index of the first dtype exponent above the format's largest."""
    fmt = number_format(fmt_name)
    exps = spec.dmin + np.arange(spec.nbd)
    bins = np.where(exps < fmt.min_exponent, 0, exps - fmt.min_exponent + 1).clip(
        max=fmt.num_bins + 1
    )
    fold = np.zeros((spec.nbd, fmt.num_bins + 2))
    fold[np.arange(spec.nbd), bins] = 1.0
    return fold, int(np.searchsorted(exps, fmt.max_exponent, side="right"))
