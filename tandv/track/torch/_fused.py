"""Fused one-pass summaries of device tensors, written in Triton.

One kernel reads each tensor once, in its own dtype, and writes a small *row*: counts of
NaN, inf, zeros and of values above the format's max, the extrema, scaled moments and
the counts of each exponent of the dtype. :func:`finish_rows` turns rows into the
layout's summary vectors (:mod:`tandv.stats.summary`) on the host.

How a program works
-------------------
A program reads a contiguous range of one tensor a *tile* at a time: each of its
:data:`SLOTS` threads loads 16 bytes (4 float32, 8 bfloat16 ...) per row of the tile,
one vector load, and keeps its own running state in registers, a *slot*. Per element
there is only in-thread work: the extrema (kept as the bits of ``|x|``, which order
magnitudes), the exponent's histogram key, and the powers of ``x / 2**E``. Per tile,
each slot merges its block of elements into float64 moments: the power sums of ``|x|``
and the mean and centred second moment by Chan's formula (the block's deviations from
its own mean, well conditioned even when ``|mean| >> std``). ``E`` is the slot's running
scale (every magnitude it has read is below ``2**E``, so no power overflows the compute
type); a block that raises it rescales the slot's sums by a power of two, exactly.
The slots are reduced across the program once, at its end.

Non-finite values count as zeros in the moments (one select instead of per-element
counting); :func:`finish_rows` removes them again from the NaN and inf counts.

Exponent counts
---------------
The zero count and the counts of each exponent come from a histogram per program of
:data:`WINDOW` bins, whose table the program adds to the tensor's row once: bin ``k``
counts the normal values of exponent field ``top - k`` (for ``k < WINDOW - 2``), bin
``WINDOW - 1`` the zeros, bin ``WINDOW - 2`` everything else (values outside the window,
subnormals, infinities and NaNs: *outliers*). The window's ``top`` is fixed per program: for
a dtype of at most ``WINDOW - 2`` exponents (float16, the 8-bit formats but
float8_e8m0fnu) the dtype's largest, else :data:`HEADROOM` fields above the largest
magnitude of the program's first tile that has a non-zero finite value (one reduction
across the program, once). A program that counted any outlier reads its range again and
counts every element in a histogram of all the dtype's exponents and of zeros, infinities
and NaNs (:func:`_all_counts`), exactly as a full histogram would, and adds that table
instead. So the dtype's exponent of every finite non-zero value is exact, subnormals
included, while the steady state stays narrow.

Compiled for an NVIDIA GPU, a program counts in a table of its own in shared memory
(:data:`SHARED_COUNTS`; declared, zeroed, added to and read by a few lines of inline PTX):
one shared-memory atomic per element, which the assembler aggregates per warp
(``ATOMS.POPC.INC``), a barrier after zeroing and one before reading, once per program.
``tl.histogram`` (the interpreter's path, and AMD's) costs more on the GPU: Triton 3.6
lowers it to a warp ballot per bit of the bin index plus a popcount per bin a lane owns
(about 2.5 warp instructions per float32 element on sm_90 with 64 bins, key and moments
included, against 1.3 with the table), Triton 3.9 to shared atomics, but with the table
zeroed and two barriers per tile.

The moments are computed in float32 (float64 for float64 tensors) per block and
accumulated in float64: relative error ~1e-7 per block, not per element.

With ``moments=4`` (the compile-time ``HOFF``, where ``m3`` lies in the row; 0 compiles
the kernel without any of this) each block also sums the cubes and fourth powers of its
deviations, and the slot's sums and the block's are shifted binomially to their merged mean
(float64); the slots, and the programs of a tensor (their partial rows hold ``m3``, ``m4``
in the fields of the counts, which go to the tensor's row directly), merge the same way
(Pébay's update). The row holds ``m3``, ``m4`` after the custom statistics, as the layout.

Programs of one tensor
----------------------
A tensor of up to :data:`ONE_PROGRAM` tiles is one program, which writes the tensor's
row. A larger one is split among programs of whole tiles, up to one tile each (a
262,144-element float32 activation gets 128 programs): each adds its counts to the row
with one atomic add per occupied bin, writes its other partials to a scratch row, and
counts itself done on an atomic counter; the last program merges the partial rows into
the tensor's row. So one launch per tensor (or per batch of tensors: :func:`launch_many`
takes a table of programs and the tensors' addresses), no second stage, no memset per
launch (the caller zeroes the row buffer once per step).

Views are read where they lie: a permuted dense tensor as its memory, a gappy one
(``x[:, ::2]``, a slice of columns) by its strides, and a broadcast dimension (stride 0,
``expand``) once, its counts and sums weighted by its size. A 1-element tensor (the
loss scale of a ``GradScaler``) can ride along into a custom statistic of the row.

Block-scaled formats
--------------------
With a layout's ``block_formats`` (:mod:`tandv.stats.blocks`), the summary kernel also
computes the MX formats' columns in its pass where a tensor is contiguous with rows of a
multiple of 32 elements (``C_E4M3`` .. ``C_E2M1``: each 32 consecutive elements of a tile
are a block; 0 compiles the kernel without any of this). :func:`_blocks_one` and
:func:`_blocks_many`, launched after it, read the tensor again, block-major, for NVFP4
(its tensor scale comes from the largest magnitude in the row) and for the MX formats of
the other tensors. Both add each program's sums to the row by atomics.

Everything here also runs on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``),
which the tests use against the numpy reference.
"""

from __future__ import annotations

import inspect
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from math import gcd
from typing import Any

import ml_dtypes
import numpy as np
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime import driver

from ...stats.blocks import BLOCK_COLUMNS, block_formats_of
from ...stats.formats import number_format
from ...stats.summary import CORE_FIELDS, Layout

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
    "launch_blocks",
    "block_columns_at",
]

# The fields of a row, in order; the exponent counts follow the counter. N_READ counts
# the elements the moments read (non-finite ones as zeros).
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
    N_READ,
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

NUM_WARPS = 8
#: Registers per thread at most: 3 programs of 256 threads per SM (the kernel needs ~100
#: unbounded; 80 costs no spills and ~1% more instructions).
MAXNREG = 80
#: Slots of a program: one per thread, each accumulating its own elements.
SLOTS = 32 * NUM_WARPS
#: Elements a thread reads per tile (one or more 16-byte loads).
PER_THREAD = 8
#: A tensor of at most this many tiles is one program.
ONE_PROGRAM = 4
#: Partial rows the last program of a tensor merges at once (one per thread).
GROUP = SLOTS
#: The table columns of :func:`launch_many`.
_TABLE = 7
#: Bins of a program's exponent histogram (a power of two): ``WINDOW - 2`` exponents,
#: outliers, zeros (see the module notes).
WINDOW = 64
#: Exponent fields the window reaches above the first tile's largest magnitude: a later
#: tile of values up to ``2**HEADROOM`` times larger keeps the narrow histogram.
HEADROOM = tl.constexpr(8)

_F32_MAX = float(np.finfo(np.float32).max)
_ADD = tl.standard._sum_combine
_MIN = tl.standard._elementwise_min
_MAX = tl.standard._elementwise_max


# ---------------------------------------------------------------------------- kernels


@triton.jit
def _pow2_f32(e):
    """2**e as float32, for integer e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _pow2_f64(e):
    """2**e as float64, for integer e <= 1023 (2**-1022 below -1022: a scale on sums of
    values so small next to the others that their share is below float64's resolution)."""
    return ((tl.maximum(e.to(tl.int64), -1022) + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _pow2(e, MODE: tl.constexpr):
    """2**e in the compute type: float64 for float64 tensors (mode 4), else float32."""
    if MODE == 4:
        p = _pow2_f64(e)
    else:
        p = _pow2_f32(e)
    return p


@triton.jit
def _inf_bits(MODE: tl.constexpr):
    """The bits of +inf in the compute type, as an integer."""
    if MODE == 4:
        b = tl.full([], 0x7FF0000000000000, tl.int64)
    else:
        b = tl.full([], 0x7F800000, tl.int32)
    return b


@triton.jit
def _magnitude_bits(x, MODE: tl.constexpr):
    """The bits of ``|x|`` as integers: they order magnitudes, with inf above every
    finite value and NaN above inf."""
    if MODE == 4:
        bits = x.to(tl.int64, bitcast=True) & 0x7FFFFFFFFFFFFFFF
    else:
        bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return bits


@triton.jit
def _exponent(bits, SUB: tl.constexpr, MODE: tl.constexpr):
    """floor(log2 m) (int32) of finite non-zero magnitudes m given by their bits; with
    ``SUB``, exact for subnormals too (their mantissa, an integer, converts exactly)."""
    if MODE == 4:
        field = (bits >> 52).to(tl.int32)
        e = field - 1023
        if SUB:
            lead = (bits.to(tl.float64).to(tl.int64, bitcast=True) >> 52).to(tl.int32)
            e = tl.where(field == 0, lead - 2097, e)
    else:
        field = bits >> 23
        e = field - 127
        if SUB:
            lead = bits.to(tl.float32).to(tl.int32, bitcast=True) >> 23
            e = tl.where(field == 0, lead - 276, e)
    return e


@triton.jit
def _field(bits, MODE: tl.constexpr):
    """The exponent field (int32) of magnitudes given by their bits."""
    if MODE == 4:
        f = (bits >> 52).to(tl.int32)
    else:
        f = bits >> 23
    return f


@triton.jit
def _anchor(x, MODE: tl.constexpr, WIN: tl.constexpr):
    """The window's top field for a program whose first tile with a non-zero finite value
    is ``x`` (0 when ``x`` has none): :data:`HEADROOM` fields above its largest magnitude,
    at least ``WIN - 2`` (the window's fields stay normal) and below the field of inf and
    NaN (which stay outliers). One reduction across the program."""
    bits = _magnitude_bits(x, MODE)
    big = tl.where(bits < _inf_bits(MODE), bits, 0)
    big = tl.reduce(tl.reduce(tl.reduce(big, 2, _MAX), 0, _MAX), 0, _MAX)
    if MODE == 4:
        ftop = 2046
    else:
        ftop = 254
    top = tl.minimum(tl.maximum(_field(big, MODE) + HEADROOM, WIN - 2), ftop)
    return tl.where(big > 0, top, 0)


@triton.jit
def _load(ptr, addr, m, lut_ptr, MODE: tl.constexpr, MASKED: tl.constexpr):
    """Elements ``addr`` of a tensor in the compute type (exactly): float32 and float64 as
    they are, float16 converted, bfloat16 from its bits (the top half of a float32), 8-bit
    formats through a table of their 256 values. Masked-off elements read as 0."""
    if MASKED:
        raw = tl.load(ptr + addr, mask=m, other=0)
    else:
        raw = tl.load(ptr + addr)
    if MODE == 0 or MODE == 4:
        x = raw
    elif MODE == 1:
        x = raw.to(tl.float32)
    elif MODE == 2:
        x = ((raw.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(lut_ptr + raw.to(tl.int32))
    return x


@triton.jit
def _tile(
    ptr,
    off,
    end,
    lut_ptr,
    geo,
    MODE: tl.constexpr,
    VEC: tl.constexpr,
    K: tl.constexpr,
    SLOTS: tl.constexpr,
    MASKED: tl.constexpr,
    STRIDED: tl.constexpr,
):
    """Elements ``off .. off + K * SLOTS * VEC`` (those below ``end`` when ``MASKED``) as
    a ``[K, SLOTS, VEC]`` tile: thread ``t`` holds ``VEC`` consecutive elements of each
    of ``K`` rows (one 16-byte load each). ``STRIDED``: the elements of a view of sizes
    ``(., s1, s2)`` and strides ``(t0, t1, t2)`` (``geo``), in row-major order (1: in
    32-bit arithmetic, 2: 64-bit)."""
    idx = off + tl.arange(0, K * SLOTS * VEC)
    m = idx < end
    if STRIDED:
        s1, s2, t0, t1, t2 = geo
        if STRIDED == 1:  # every index and offset below 2**31: 32-bit arithmetic
            idx = idx.to(tl.int32)
        outer = idx // s2
        addr = (outer // s1) * t0 + (outer % s1) * t1 + (idx % s2) * t2
    else:
        addr = idx
    x = _load(ptr, addr, m, lut_ptr, MODE, MASKED)
    return tl.reshape(x, [K, SLOTS, VEC]), tl.reshape(m, [K, SLOTS, VEC])


@triton.jit
def _finite(x, m, bits, inf, amin, MASKED: tl.constexpr):
    """The tile ``x`` with its non-finite (and, when ``MASKED``, masked-off) elements read
    as 0, and the slots' smallest magnitude bits ``amin`` with the tile's (non-finite
    values lie above inf: clipped at the end)."""
    fin = bits < inf
    if MASKED:
        fin = fin & m
        amin = tl.minimum(amin, tl.reduce(tl.reduce(tl.where(m, bits, inf), 2, _MIN), 0, _MIN))
    else:
        amin = tl.minimum(amin, tl.reduce(tl.reduce(bits, 2, _MIN), 0, _MIN))
    return tl.where(fin, x, 0.0), amin


@triton.jit
def _extrema(
    xf, m, amax, mn, mx, over, fmax, MODE: tl.constexpr, OVER: tl.constexpr, MASKED: tl.constexpr
):
    """The slots' signed extrema ``mn``, ``mx``, largest finite magnitude ``amax`` (and
    its bits) and, with ``OVER``, count of magnitudes above the format's ``fmax``, with the
    finite tile ``xf`` added (non-finite values read as 0 in the extrema: patched on the
    host, see :func:`finish_rows`). The tile's largest magnitude per slot comes from its
    extrema, ``max(hi, -lo)``, a few operations per slot instead of one per element; it is
    clamped at 0 for a slot whose elements are all masked off (``lo = inf``, ``hi = -inf``)
    and made positive, a zero's ``+0`` as ``|x|`` gives."""
    if MASKED:
        lo = tl.reduce(tl.reduce(tl.where(m, xf, float("inf")), 2, _MIN), 0, _MIN)
        hi = tl.reduce(tl.reduce(tl.where(m, xf, float("-inf")), 2, _MAX), 0, _MAX)
    else:
        lo = tl.reduce(tl.reduce(xf, 2, _MIN), 0, _MIN)
        hi = tl.reduce(tl.reduce(xf, 2, _MAX), 0, _MAX)
    mn = tl.minimum(mn, lo)
    mx = tl.maximum(mx, hi)
    amax = tl.maximum(amax, tl.abs(tl.maximum(tl.maximum(hi, -lo), 0.0)))
    top = _magnitude_bits(amax, MODE)
    if OVER:
        over += tl.reduce(tl.reduce((tl.abs(xf) > fmax).to(tl.int32), 2, _ADD), 0, _ADD)
    return amax, top, mn, mx, over


@triton.jit
def _rescaled(xf, E, top, SUB: tl.constexpr, MODE: tl.constexpr):
    """The slots' new scale ``En`` (every magnitude so far, ``top`` the bits of the
    largest, below ``2**En``), the tile ``xf / 2**En`` in two factors that each stay normal
    in the compute type, and ``r = 2**(E - En)``, the factor on the slots' old sums: powers
    of two, so rescaling is exact."""
    En = tl.maximum(E, _exponent(top, SUB, MODE) + 1)
    h = En >> 1
    q = (xf * _pow2(-h, MODE)[None, :, None]) * _pow2(h - En, MODE)[None, :, None]
    return En, q, _pow2_f64(E - En)


@triton.jit
def _block_moments(q, m, MASKED: tl.constexpr, PER: tl.constexpr):
    """Each slot's block of ``q``: its count ``nb``, its mean ``mb`` from a float64 sum
    (the mean may be far smaller than the spread), that mean rounded to the compute type
    ``c`` and its offset ``off = mb - c``, the deviations ``d = q - c`` (0 where masked
    off) and ``d2 = d * d``, their float64 sum ``s2`` and the centred sum ``m2b``
    (corrected for c's offset, exactly: ``sum (q - c)**2 = m2b + nb * off**2``)."""
    s = tl.reduce(tl.reduce(q.to(tl.float64), 2, _ADD), 0, _ADD)
    if MASKED:
        nb = tl.reduce(tl.reduce(m.to(tl.float32), 2, _ADD), 0, _ADD)
        mb = s / tl.maximum(nb, 1.0)
        c = mb.to(q.dtype)
        d = tl.where(m, q - c[None, :, None], 0.0)
    else:
        nb = tl.full(q.shape[1:2], PER, tl.float32)
        mb = s * (1.0 / PER)  # PER elements per slot, a power of two: exact
        c = mb.to(q.dtype)
        d = q - c[None, :, None]
    off = mb - c.to(tl.float64)
    d2 = d * d
    s2 = tl.reduce(tl.reduce(d2, 2, _ADD), 0, _ADD).to(tl.float64)
    m2b = tl.maximum(s2 - nb * off * off, 0.0)
    return nb, mb, c, off, d, d2, s2, m2b


@triton.jit
def _shifted_higher(m2, m3, m4, cnt, r, r2, r4, mean, delta, w, nb, c, off, d, d2, s2):
    """The slots' third and fourth centred sums ``m3``, ``m4`` (scaled by ``r``) with the
    block's merged, about the new mean: the slot's shifted by ``u`` (its old mean
    ``mean`` less the new), the block's from its float32 sums of ``d = q - c`` shifted by
    ``t = c -`` the new mean (binomially; ``sum d = nb * off``); ``u`` and ``t`` are
    within the spread."""
    c2 = m2 * r2
    c3 = m3 * (r2 * r)
    na = cnt.to(tl.float64)
    u = -delta * w
    t = c.to(tl.float64) - (mean + delta * w)
    s1 = nb * off
    s3 = tl.reduce(tl.reduce(d2 * d, 2, _ADD), 0, _ADD).to(tl.float64)
    s4 = tl.reduce(tl.reduce(d2 * d2, 2, _ADD), 0, _ADD).to(tl.float64)
    m3 = c3 + u * (3.0 * c2 + na * u * u) + s3 + t * (3.0 * s2 + t * (3.0 * s1 + nb * t))
    m4 = (
        m4 * r4
        + u * (4.0 * c3 + u * (6.0 * c2 + na * u * u))
        + s4
        + t * (4.0 * s3 + t * (6.0 * s2 + t * (4.0 * s1 + nb * t)))
    )
    return m3, m4


@triton.jit
def _smem_declare(MODE: tl.constexpr):
    """Declares the program's table of counts in shared memory (CUDA only; see the module
    notes): 513 words (4,097 for float64), room for :func:`_all_counts`'s ``NBP`` bins and a
    spare word after them. Called once, before any other ``_smem_*`` function: the
    assembler reads the declaration before the code that names it."""
    one = tl.zeros([1], tl.int32)
    if MODE == 4:
        tl.inline_asm_elementwise(
            ".shared .align 16 .b32 tandv_counts[4097];\n\tmov.u32 $0, 0;",
            "=r,r", [one], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        tl.inline_asm_elementwise(
            ".shared .align 16 .b32 tandv_counts[513];\n\tmov.u32 $0, 0;",
            "=r,r", [one], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def _smem_zero(NB: tl.constexpr):
    """Zeroes words ``[0, NB)`` of the table of counts (not the spare word after them,
    which takes masked-off elements and is never read), then a barrier: no thread counts
    before every word is zero (nor zeroes before every thread read the last counts: the
    caller's barrier)."""
    tl.inline_asm_elementwise(
        "{\n\t.reg .u32 a;\n\tmov.u32 a, tandv_counts;\n\tmad.lo.u32 a, $1, 4, a;\n\t"
        "st.shared.u32 [a], 0;\n\tmov.u32 $0, 0;\n\t}",
        "=r,r", [tl.arange(0, NB)], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip
    tl.debug_barrier()


@triton.jit
def _smem_count(key):
    """Adds one to word ``key`` of the table of counts for each element of ``key``: one
    shared-memory atomic per element (``red.shared.add``, which the assembler turns into a
    warp-aggregated ``ATOMS.POPC.INC``)."""
    tl.inline_asm_elementwise(
        "{\n\t.reg .u32 a;\n\tmov.u32 a, tandv_counts;\n\tmad.lo.u32 a, $1, 4, a;\n\t"
        "red.shared.add.u32 [a], 1;\n\tmov.u32 $0, 0;\n\t}",
        "=r,r", [key], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _smem_read(NB: tl.constexpr):
    """Words ``[0, NB)`` of the table of counts, after a barrier (every thread's atomics
    done)."""
    tl.debug_barrier()
    return tl.inline_asm_elementwise(
        "{\n\t.reg .u32 a;\n\tmov.u32 a, tandv_counts;\n\tmad.lo.u32 a, $1, 4, a;\n\t"
        "ld.shared.u32 $0, [a];\n\t}",
        "=r,r", [tl.arange(0, NB)], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _window(
    bits,
    m,
    wtop,
    hist,
    MODE: tl.constexpr,
    WIN: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK: tl.constexpr,
    SMEM: tl.constexpr,
):
    """The program's window histogram ``hist`` with the tile's keys added (the tile's
    magnitudes as ``bits``, those where ``m`` when ``MASKED``): field ``wtop - k`` in bin
    ``k``, zeros in ``WIN - 1``, the rest (fields outside the window, subnormals and zeros'
    field 0 below it, inf and NaN above it: ``wtop`` < their field) in ``WIN - 2`` by an
    unsigned min; keys in ``[0, WIN)`` by construction."""
    k = (wtop - _field(bits, MODE)).to(tl.uint32)
    key = tl.where(bits == 0, WIN - 1, tl.minimum(k, WIN - 2).to(tl.int32))
    if SMEM:  # counted in shared memory (masked-off elements in word WIN, never read)
        if MASKED:
            key = tl.where(m, key, WIN)
        _smem_count(key)
    elif MASKED:
        hist += _masked_histogram(key, m, WIN - 1, WIN, BLOCK)
    else:
        hist += tl.histogram(tl.reshape(key, [BLOCK]), WIN)
    return hist


@triton.jit
def _step(
    x,
    m,
    state,
    hist,
    wtop,
    fmax,
    MODE: tl.constexpr,
    SUB: tl.constexpr,
    WIN: tl.constexpr,
    OVER: tl.constexpr,
    MASKED: tl.constexpr,
    PER: tl.constexpr,
    BLOCK: tl.constexpr,
    HOFF: tl.constexpr,
    blk,
    C_E4M3: tl.constexpr,
    C_E5M2: tl.constexpr,
    C_E2M1: tl.constexpr,
    SMEM: tl.constexpr,
):
    """The slots' ``state`` and the program's window histogram ``hist`` (top field
    ``wtop``, see the module notes) with a tile ``x`` added (its elements where ``m`` when
    ``MASKED``); with ``HOFF`` (moments=4), the
    third and fourth centred sums too; with a ``C_*`` not 0, the MX formats' sums ``blk``
    (:func:`_mx_blocks`) too, the tile being whole blocks of 32 (rows of a multiple of 32).
    Each part is a jit function of its own, which Triton inlines: one straight-line
    program.

    (Reductions call ``tl.reduce`` with Triton's own combine functions rather than
    ``tl.sum`` and the like: the same code compiled, and many times faster in the
    interpreter, which patches its language module on every call of a jit function.)"""
    E, cnt, mean, m2, p1, p2, p4, p8, mn, mx, amin, amax, over, m3, m4 = state
    bits = _magnitude_bits(x, MODE)
    xf, amin = _finite(x, m, bits, _inf_bits(MODE), amin, MASKED)
    if C_E4M3 + C_E5M2 + C_E2M1:  # MX blocks: 32 consecutive elements of the tile each
        blk = _mx_blocks(
            tl.reshape(tl.abs(xf), [BLOCK // 32, 32]).to(tl.float32), blk, C_E4M3, C_E5M2, C_E2M1
        )
    amax, top, mn, mx, over = _extrema(xf, m, amax, mn, mx, over, fmax, MODE, OVER, MASKED)
    En, q, r = _rescaled(xf, E, top, SUB, MODE)
    r2 = r * r
    r4 = r2 * r2
    # the block's moments merged into the slot's by Chan's formula (scaled by r)
    nb, mb, c, off, d, d2, s2, m2b = _block_moments(q, m, MASKED, PER)
    a = tl.abs(q)
    a2 = a * a
    a4 = a2 * a2
    nt = cnt + nb
    w = (nb / tl.maximum(nt, 1.0)).to(tl.float64)
    mean = mean * r
    delta = mb - mean
    if HOFF:
        m3, m4 = _shifted_higher(m2, m3, m4, cnt, r, r2, r4, mean, delta, w, nb, c, off, d, d2, s2)
    m2 = m2 * r2 + m2b + delta * delta * (cnt.to(tl.float64) * w)
    mean = mean + delta * w
    p1 = p1 * r + tl.reduce(tl.reduce(a, 2, _ADD), 0, _ADD).to(tl.float64)
    p2 = p2 * r2 + tl.reduce(tl.reduce(a2, 2, _ADD), 0, _ADD).to(tl.float64)
    p4 = p4 * r4 + tl.reduce(tl.reduce(a4, 2, _ADD), 0, _ADD).to(tl.float64)
    p8 = p8 * (r4 * r4) + tl.reduce(tl.reduce(a4 * a4, 2, _ADD), 0, _ADD).to(tl.float64)
    hist = _window(bits, m, wtop, hist, MODE, WIN, MASKED, BLOCK, SMEM)
    return (En, nt, mean, m2, p1, p2, p4, p8, mn, mx, amin, amax, over, m3, m4), hist, blk


@triton.jit
def _scan(
    ptr,
    start,
    end,
    lut_ptr,
    fmax,
    geo,
    MODE: tl.constexpr,
    SUB: tl.constexpr,
    TOP: tl.constexpr,
    WIN: tl.constexpr,
    VEC: tl.constexpr,
    K: tl.constexpr,
    SLOTS: tl.constexpr,
    OVER: tl.constexpr,
    STRIDED: tl.constexpr,
    HOFF: tl.constexpr,
    C_E4M3: tl.constexpr,
    C_E5M2: tl.constexpr,
    C_E2M1: tl.constexpr,
    SMEM: tl.constexpr,
):
    """The slots' states after elements ``[start, end)`` of a tensor (``start`` a multiple
    of the tile), their window histogram and its top field (``TOP``, or anchored at the
    first tile with a non-zero finite value when ``TOP`` is 0: see the module notes):
    whole tiles unmasked, then the rest; and the MX formats' sums (:func:`_mx_blocks`; 0
    without)."""
    BLOCK: tl.constexpr = K * SLOTS * VEC
    if MODE == 4:
        ct = tl.float64
        it = tl.int64
        e0 = -1074  # below every exponent + 1, and 2**-e0 in two normal factors
    else:
        ct = tl.float32
        it = tl.int32
        e0 = -149
    zero = tl.zeros([SLOTS], tl.float64)
    state = (
        tl.full([SLOTS], e0, tl.int32),
        tl.zeros([SLOTS], tl.float32),
        zero,
        zero,
        zero,
        zero,
        zero,
        zero,
        tl.full([SLOTS], float("inf"), ct),
        tl.full([SLOTS], float("-inf"), ct),
        tl.zeros([SLOTS], it) + _inf_bits(MODE),
        tl.zeros([SLOTS], ct),
        tl.zeros([SLOTS], tl.int32),
        zero,
        zero,
    )
    hist = tl.zeros([WIN], tl.int32)
    if SMEM:
        _smem_declare(MODE)
        _smem_zero(WIN)
    wtop = tl.full([], TOP, tl.int32)
    if C_E4M3 + C_E5M2 + C_E2M1:
        blk = _mx_zeros(BLOCK // 32)
    else:
        blk = 0
    full_end = start + ((end - start) // BLOCK) * BLOCK
    for off in range(start, full_end, BLOCK):
        x, m = _tile(
            ptr, tl.multiple_of(off, BLOCK), end, lut_ptr, geo, MODE, VEC, K, SLOTS, False, STRIDED
        )
        if TOP == 0:
            if wtop == 0:
                wtop = _anchor(x, MODE, WIN)
        state, hist, blk = _step(
            x, m, state, hist, wtop, fmax, MODE, SUB, WIN, OVER, False, K * VEC, BLOCK, HOFF,
            blk, C_E4M3, C_E5M2, C_E2M1, SMEM,
        )  # fmt: skip
    if full_end < end:
        x, m = _tile(ptr, full_end, end, lut_ptr, geo, MODE, VEC, K, SLOTS, True, STRIDED)
        if TOP == 0:
            if wtop == 0:
                wtop = _anchor(x, MODE, WIN)
        state, hist, blk = _step(
            x, m, state, hist, wtop, fmax, MODE, SUB, WIN, OVER, True, K * VEC, BLOCK, HOFF,
            blk, C_E4M3, C_E5M2, C_E2M1, SMEM,
        )  # fmt: skip
    if SMEM:
        hist = _smem_read(WIN)
    return state, hist, wtop, blk


@triton.jit
def _all_counts(
    ptr,
    start,
    end,
    lut_ptr,
    geo,
    MODE: tl.constexpr,
    SUB: tl.constexpr,
    DMIN: tl.constexpr,
    NBP: tl.constexpr,
    VEC: tl.constexpr,
    K: tl.constexpr,
    SLOTS: tl.constexpr,
    STRIDED: tl.constexpr,
    SMEM: tl.constexpr,
):
    """The counts of every exponent of the dtype and of zeros, infinities and NaNs among
    elements ``[start, end)`` (the second read of a program that counted outliers): bins
    ``[0, NBD)`` for the exponents; zeros, infinities and NaNs land in bins of their own as
    they are (the exponent formula gives inf and NaN the exponent one above the largest,
    zeros one far below the smallest, wrapped around by the mask: ``NBP`` leaves room, see
    ``Spec.keys``)."""
    BLOCK: tl.constexpr = K * SLOTS * VEC
    hist = tl.zeros([NBP], tl.int32)
    if SMEM:  # (after a barrier: every thread has read the window's counts)
        tl.debug_barrier()
        _smem_zero(NBP)
    inf = _inf_bits(MODE)
    zkey = (_exponent(tl.zeros([1, 1, 1], inf.dtype), SUB, MODE) - DMIN) & (NBP - 1)
    for off in range(start, end, BLOCK):
        x, m = _tile(ptr, off, end, lut_ptr, geo, MODE, VEC, K, SLOTS, True, STRIDED)
        bits = _magnitude_bits(x, MODE)
        key = (_exponent(bits, SUB, MODE) - DMIN + (bits > inf).to(tl.int32)) & (NBP - 1)
        if SMEM:  # masked-off elements in word NBP, never read
            _smem_count(tl.where(m, key, NBP))
        else:
            hist += _masked_histogram(key, m, zkey, NBP, BLOCK)
    if SMEM:
        hist = _smem_read(NBP)
    return hist


@triton.jit
def _masked_histogram(key, m, spare, NB: tl.constexpr, BLOCK: tl.constexpr):
    """``tl.histogram`` of the ``[K, SLOTS, VEC]`` tile's ``key`` where ``m``, in ``NB``
    bins: masked-off elements are counted in bin ``spare`` (a scalar or a ``[1, 1, 1]``
    tile) and taken out of it. (``tl.histogram``'s own mask counted the wrong elements on
    an H200 with Triton 3.6, while the interpreter counted right: it is not used.)"""
    counts = tl.histogram(tl.reshape(tl.where(m, key, spare), [BLOCK]), NB)
    off = BLOCK - tl.reduce(tl.reduce(tl.reduce(m.to(tl.int32), 2, _ADD), 0, _ADD), 0, _ADD)
    bins = tl.arange(0, NB)[:, None, None]
    return counts - tl.reduce(tl.reduce(tl.where(bins == spare, off, 0), 2, _ADD), 1, _ADD)


@triton.jit
def _pebay(na, nb, delta, a2, a3, a4, b2, b3, b4):
    """The third and fourth centred sums of two parts merged (Pebay 2008: Chan et al.'s
    update one and two orders up): counts ``na``, ``nb``, ``delta`` the second part's mean
    less the first's, ``a2 .. a4`` and ``b2 .. b4`` their centred sums (one scale)."""
    n = na + nb
    dn = delta / tl.maximum(n, 1.0)
    nab = na * nb
    m3 = a3 + b3 + delta * dn * dn * nab * (na - nb) + 3.0 * dn * (na * b2 - nb * a2)
    m4 = (
        a4
        + b4
        + delta * dn * dn * dn * nab * (na * na - nab + nb * nb)
        + 6.0 * dn * dn * (na * na * b2 + nb * nb * a2)
        + 4.0 * dn * (na * b3 - nb * a3)
    )
    return m3, m4


@triton.jit
def _merged(E, n, mean, m2, p1, p2, p4, p8, m3, m4, HOFF: tl.constexpr):
    """The moments of parts ``(E, n, mean, m2, p1, p2, p4, p8, m3, m4)`` (vectors; each
    part's sums scaled by ``2**-E``) as one part scaled by the largest ``2**-E`` (``m3``,
    ``m4`` with ``HOFF`` only: each part's sums shifted to the total mean, exactly)."""
    Et = tl.max(E)
    r = _pow2_f64(E - Et)
    r2 = r * r
    r4 = r2 * r2
    nt = tl.sum(n)
    mean = mean * r
    mt = tl.sum(n * mean) / tl.maximum(nt, 1.0)
    dev = mean - mt
    m2 = m2 * r2
    m2t = tl.sum(m2 + n * dev * dev)
    if HOFF:
        m3 = m3 * (r2 * r)
        m3t = tl.sum(m3 + dev * (3.0 * m2 + n * dev * dev))
        m4t = tl.sum(m4 * r4 + dev * (4.0 * m3 + dev * (6.0 * m2 + n * dev * dev)))
    else:
        m3t = tl.sum(m3)
        m4t = tl.sum(m4)
    p4t = tl.sum(p4 * r4)
    p8t = tl.sum(p8 * (r4 * r4))
    return Et, nt, mt, m2t, tl.sum(p1 * r), tl.sum(p2 * r2), p4t, p8t, m3t, m4t


@triton.jit
def _merge(a, b, HOFF: tl.constexpr):
    """Merge two partial moment sets ``(E, n, mean, m2, p1, p2, p4, p8, m3, m4)``, their
    sums scaled by ``2**-E`` and ``2**-Eb``, into one scaled by ``2**-max(E, Eb)`` (Chan et
    al. for the centred second moment, Pebay for ``m3``, ``m4`` with ``HOFF``)."""
    E, n, mean, m2, p1, p2, p4, p8, m3, m4 = a
    Eb, nb, meanb, m2b, p1b, p2b, p4b, p8b, m3b, m4b = b
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
    if HOFF:
        m3, m4 = _pebay(
            n, nb, delta, m2 * r2, m3 * (r2 * r), m4 * r4, m2b * rb2, m3b * (rb2 * rb), m4b * rb4
        )
    m2 = m2 * r2 + m2b * rb2 + delta * delta * n * w
    mean = mean + delta * w
    p1 = p1 * r + p1b * rb
    p2 = p2 * r2 + p2b * rb2
    p4 = p4 * r4 + p4b * rb4
    p8 = p8 * (r4 * r4) + p8b * (rb4 * rb4)
    return Ec, nt, mean, m2, p1, p2, p4, p8, m3, m4


@triton.jit
def _store_fields(ptr, fields):
    """Writes fields ``OVER .. P8`` (3 .. 15) of a (partial) row at ``ptr`` as float64."""
    for i in tl.static_range(13):
        tl.store(ptr + 3 + i, fields[i].to(tl.float64))


@triton.jit
def _add_counts(row, dest, hist, kept, wt, n_parts):
    """Adds the counts ``hist`` (times ``wt``) to ``row + dest`` where ``kept``: stored by
    a tensor's only program (the row is zeros), else by one atomic add per occupied bin
    (read only by the host, after the kernel)."""
    counts = hist.to(tl.float64) * wt
    if n_parts == 1:
        tl.store(row + dest, counts, mask=kept)
    else:
        tl.atomic_add(row + dest, counts, mask=kept & (hist != 0), sem="relaxed")


@triton.jit
def _window_counts(
    row,
    hist,
    wtop,
    wt,
    n_parts,
    MODE: tl.constexpr,
    DMIN: tl.constexpr,
    NBD: tl.constexpr,
    WIN: tl.constexpr,
):
    """Adds a window histogram without outliers (top field ``wtop``) to the row: bin ``k``
    (exponent ``wtop - k - bias``) after the header (``HEADER``: 17), zeros to the ZERO
    field."""
    k = tl.arange(0, WIN)
    if MODE == 4:
        idx = wtop - k - 1023 - DMIN
    else:
        idx = wtop - k - 127 - DMIN
    dest = tl.where(k == WIN - 1, 2, 17 + idx)
    kept = (k == WIN - 1) | ((k < WIN - 2) & (idx >= 0) & (idx < NBD))
    _add_counts(row, dest, hist, kept, wt, n_parts)


@triton.jit
def _all_to_row(
    row,
    hist,
    wt,
    n_parts,
    NBD: tl.constexpr,
    NBP: tl.constexpr,
    ZKEY: tl.constexpr,
    IKEY: tl.constexpr,
):
    """Adds a histogram of :func:`_all_counts` to the row: exponents after the header,
    then the ZERO, INF and NAN fields."""
    bins = tl.arange(0, NBP)
    dest = tl.where(bins < NBD, 17 + bins, tl.where(bins == ZKEY, 2, (bins == IKEY).to(tl.int32)))
    kept = (bins < NBD) | (bins == ZKEY) | (bins == IKEY) | (bins == IKEY + 1)
    _add_counts(row, dest, hist, kept, wt, n_parts)


@triton.jit
def _merge_parts(base, n_parts, GROUP: tl.constexpr, HOFF: tl.constexpr):
    """Fields ``OVER .. P8`` of the merge of the ``n_parts`` partial rows at ``base``
    (written by other programs: read past the caches), then ``m3``, ``m4`` (with ``HOFF``,
    from the partial rows' first two fields; else zeros)."""
    g = tl.arange(0, GROUP)
    over = tl.full([], 0.0, tl.float64)
    mn = tl.full([], float("inf"), tl.float64)
    mx = tl.full([], float("-inf"), tl.float64)
    amin = tl.full([], float("inf"), tl.float64)
    amax = tl.full([], 0.0, tl.float64)
    zero = tl.full([], 0.0, tl.float64)
    moments = (tl.full([], -1074, tl.int32), zero, zero, zero, zero, zero, zero, zero, zero, zero)
    for i0 in range(0, n_parts, GROUP):
        ok = (i0 + g) < n_parts
        rows = base + (i0 + g) * 16
        over += tl.sum(tl.load(rows + 3, mask=ok, other=0.0, volatile=True))
        mn = tl.minimum(mn, tl.min(tl.load(rows + 4, mask=ok, other=float("inf"), volatile=True)))
        mx = tl.maximum(mx, tl.max(tl.load(rows + 5, mask=ok, other=float("-inf"), volatile=True)))
        amin = tl.minimum(
            amin, tl.min(tl.load(rows + 6, mask=ok, other=float("inf"), volatile=True))
        )
        amax = tl.maximum(amax, tl.max(tl.load(rows + 7, mask=ok, other=0.0, volatile=True)))
        group = _merged(
            tl.load(rows + 8, mask=ok, other=-1074.0, volatile=True).to(tl.int32),
            tl.load(rows + 9, mask=ok, other=0.0, volatile=True),
            tl.load(rows + 10, mask=ok, other=0.0, volatile=True),
            tl.load(rows + 11, mask=ok, other=0.0, volatile=True),
            tl.load(rows + 12, mask=ok, other=0.0, volatile=True),
            tl.load(rows + 13, mask=ok, other=0.0, volatile=True),
            tl.load(rows + 14, mask=ok, other=0.0, volatile=True),
            tl.load(rows + 15, mask=ok, other=0.0, volatile=True),
            _load_higher(rows, ok, 0, HOFF),
            _load_higher(rows, ok, 1, HOFF),
            HOFF,
        )
        moments = _merge(moments, group, HOFF)
    E, n, mean, m2, p1, p2, p4, p8, m3, m4 = moments
    return (over, mn, mx, amin, amax, E, n, mean, m2, p1, p2, p4, p8, m3, m4)


@triton.jit
def _load_higher(rows, ok, i: tl.constexpr, HOFF: tl.constexpr):
    """Field ``i`` of partial rows ``rows`` (``m3``, ``m4`` with ``HOFF``: a partial row's
    first fields, whose counts go to the tensor's row directly), zeros without."""
    if HOFF:
        v = tl.load(rows + i, mask=ok, other=0.0, volatile=True)
    else:
        v = tl.zeros(ok.shape, tl.float64)
    return v


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
    weight,
    ext_ptr,
    ext_off,
    geo,
    MODE: tl.constexpr,
    SUB: tl.constexpr,
    DMIN: tl.constexpr,
    NBD: tl.constexpr,
    NBP: tl.constexpr,
    ZKEY: tl.constexpr,
    IKEY: tl.constexpr,
    TOP: tl.constexpr,
    WIN: tl.constexpr,
    VEC: tl.constexpr,
    K: tl.constexpr,
    SLOTS: tl.constexpr,
    OVER: tl.constexpr,
    STRIDED: tl.constexpr,
    EXT: tl.constexpr,
    GROUP: tl.constexpr,
    HOFF: tl.constexpr,
    C_E4M3: tl.constexpr,
    C_E5M2: tl.constexpr,
    C_E2M1: tl.constexpr,
    SMEM: tl.constexpr,
):
    """One program's share ``[start, end)`` of a tensor whose row is at ``row``; with
    ``n_parts > 1`` programs, its partial row goes to ``part_ptr`` and the last program
    merges the ``n_parts`` rows at ``parts_ptr`` into ``row``. Counts and sums are
    multiplied by ``weight`` (the size of broadcast dimensions); with ``EXT``, the value
    at ``ext_ptr`` is written to ``row + ext_off``; with ``HOFF`` (moments=4), ``m3`` and
    ``m4`` to ``row + HOFF`` and ``+ HOFF + 1`` (a partial row's first two fields); with a
    ``C_*`` not 0, that MX format's columns are added to the row at ``row + C_*`` (each
    program's, by atomics)."""
    state, hist, wtop, blk = _scan(
        ptr,
        start,
        end,
        lut_ptr,
        fmax,
        geo,
        MODE,
        SUB,
        TOP,
        WIN,
        VEC,
        K,
        SLOTS,
        OVER,
        STRIDED,
        HOFF,
        C_E4M3,
        C_E5M2,
        C_E2M1,
        SMEM,
    )
    if C_E4M3 + C_E5M2 + C_E2M1:
        _mx_columns(row, blk, C_E4M3, C_E5M2, C_E2M1)
    E, cnt, mean, m2, p1, p2, p4, p8, mn, mx, amin, amax, over, m3, m4 = state
    wt = weight * tl.full([], 1.0, tl.float64)
    Et, n, mt, m2t, p1t, p2t, p4t, p8t, m3t, m4t = _merged(
        E, cnt.to(tl.float64), mean, m2, p1, p2, p4, p8, m3, m4, HOFF
    )
    amin_t = tl.minimum(tl.min(amin), _inf_bits(MODE))
    if MODE == 4:
        amin_f = amin_t.to(tl.float64, bitcast=True)
    else:
        amin_f = amin_t.to(tl.float32, bitcast=True)
    fields = (
        tl.sum(over).to(tl.float64) * wt,
        tl.min(mn),
        tl.max(mx),
        amin_f,
        tl.max(amax),
        Et,
        n * wt,
        mt,
        m2t * wt,
        p1t * wt,
        p2t * wt,
        p4t * wt,
        p8t * wt,
    )
    if tl.sum(tl.where(tl.arange(0, WIN) == WIN - 2, hist, 0)) == 0:
        _window_counts(row, hist, wtop, wt, n_parts, MODE, DMIN, NBD, WIN)
    else:  # outliers: every element counted again, by a histogram of all the keys
        every = _all_counts(
            ptr, start, end, lut_ptr, geo, MODE, SUB, DMIN, NBP, VEC, K, SLOTS, STRIDED, SMEM
        )
        _all_to_row(row, every, wt, n_parts, NBD, NBP, ZKEY, IKEY)
    if n_parts == 1:
        _store_fields(row, fields)
        if EXT:
            tl.store(row + ext_off, tl.load(ext_ptr).to(tl.float64))
        if HOFF:
            tl.store(row + HOFF, m3t * wt)
            tl.store(row + HOFF + 1, m4t * wt)
    else:
        _store_fields(part_ptr, fields)
        if HOFF:
            tl.store(part_ptr, m3t * wt)
            tl.store(part_ptr + 1, m4t * wt)
        # every thread's stores before the counter's release (a barrier, then the atomic)
        tl.debug_barrier()
        done = tl.atomic_add(row + 16, 1.0, sem="acq_rel")  # COUNTER
        if done == n_parts - 1:
            # the last program of the tensor
            merged = _merge_parts(parts_ptr, n_parts, GROUP, HOFF)
            _store_fields(row, merged)
            if EXT:
                tl.store(row + ext_off, tl.load(ext_ptr).to(tl.float64))
            if HOFF:
                tl.store(row + HOFF, merged[13])
                tl.store(row + HOFF + 1, merged[14])


@triton.jit(do_not_specialize=["n", "tiles", "row_off", "ext_off", "s1", "s2", "t0", "t1", "t2"])
def _summarize_one(
    x_ptr,
    n,
    tiles,
    rows_ptr,
    row_off,
    scratch_ptr,
    lut_ptr,
    fmax,
    weight,
    ext_ptr,
    ext_off,
    s1,
    s2,
    t0,
    t1,
    t2,
    MODE: tl.constexpr,
    SUB: tl.constexpr,
    DMIN: tl.constexpr,
    NBD: tl.constexpr,
    NBP: tl.constexpr,
    ZKEY: tl.constexpr,
    IKEY: tl.constexpr,
    TOP: tl.constexpr,
    WIN: tl.constexpr,
    VEC: tl.constexpr,
    K: tl.constexpr,
    SLOTS: tl.constexpr,
    OVER: tl.constexpr,
    STRIDED: tl.constexpr,
    EXT: tl.constexpr,
    GROUP: tl.constexpr,
    HOFF: tl.constexpr,
    C_E4M3: tl.constexpr,
    C_E5M2: tl.constexpr,
    C_E2M1: tl.constexpr,
    SMEM: tl.constexpr,
):
    """One tensor ``x_ptr`` of ``n`` elements, ``tiles`` tiles per program, into the row
    at ``rows_ptr + row_off``; ``STRIDED``: the elements of the view of sizes ``(., s1,
    s2)`` and strides ``(t0, t1, t2)``."""
    pid = tl.program_id(0)
    per_prog = tiles.to(tl.int64) * (K * SLOTS * VEC)  # the tile's multiple: aligned
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
        weight,
        ext_ptr,
        ext_off,
        (s1, s2, t0, t1, t2),
        MODE,
        SUB,
        DMIN,
        NBD,
        NBP,
        ZKEY,
        IKEY,
        TOP,
        WIN,
        VEC,
        K,
        SLOTS,
        OVER,
        STRIDED,
        EXT,
        GROUP,
        HOFF,
        C_E4M3,
        C_E5M2,
        C_E2M1,
        SMEM,
    )


@triton.jit
def _typed(addr, MODE: tl.constexpr, ALIGNED: tl.constexpr):
    """The address ``addr`` (int64) as a pointer to the elements :func:`_load` reads
    (known to be 16-byte aligned when ``ALIGNED``)."""
    if MODE == 0:
        p = addr.to(tl.pointer_type(tl.float32))
    elif MODE == 1:
        p = addr.to(tl.pointer_type(tl.float16))
    elif MODE == 2:
        p = addr.to(tl.pointer_type(tl.int16))
    elif MODE == 4:
        p = addr.to(tl.pointer_type(tl.float64))
    else:
        p = addr.to(tl.pointer_type(tl.uint8))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _summarize_many(
    table_ptr,
    addr_ptr,
    rows_ptr,
    scratch_ptr,
    lut_ptr,
    fmax,
    MODE: tl.constexpr,
    SUB: tl.constexpr,
    DMIN: tl.constexpr,
    NBD: tl.constexpr,
    NBP: tl.constexpr,
    ZKEY: tl.constexpr,
    IKEY: tl.constexpr,
    TOP: tl.constexpr,
    WIN: tl.constexpr,
    VEC: tl.constexpr,
    K: tl.constexpr,
    SLOTS: tl.constexpr,
    OVER: tl.constexpr,
    ALIGNED: tl.constexpr,
    GROUP: tl.constexpr,
    HOFF: tl.constexpr,
    C_E4M3: tl.constexpr,
    C_E5M2: tl.constexpr,
    C_E2M1: tl.constexpr,
    SMEM: tl.constexpr,
):
    """Many tensors of one dtype: program ``i`` reads row ``i`` of the table ``(tensor,
    start, end, row offset, part, parts, first part)`` and the tensor's address at
    ``addr_ptr + tensor`` (the table stays while the tensors move: only their addresses
    are written again); ``ALIGNED``: every address is a multiple of 16 bytes."""
    t = table_ptr + tl.program_id(0) * 7
    part = tl.load(t + 4)
    first = tl.load(t + 6)
    _summarize(
        _typed(tl.load(addr_ptr + tl.load(t)), MODE, ALIGNED),
        tl.multiple_of(tl.load(t + 1), K * SLOTS * VEC),
        tl.load(t + 2),
        rows_ptr + tl.load(t + 3),
        scratch_ptr + (first + part) * 16,
        scratch_ptr + first * 16,
        tl.load(t + 5),
        lut_ptr,
        fmax,
        1.0,
        rows_ptr,
        0,
        (1, 1, 0, 0, 0),
        MODE,
        SUB,
        DMIN,
        NBD,
        NBP,
        ZKEY,
        IKEY,
        TOP,
        WIN,
        VEC,
        K,
        SLOTS,
        OVER,
        False,
        False,
        GROUP,
        HOFF,
        C_E4M3,
        C_E5M2,
        C_E2M1,
        SMEM,
    )


# ------------------------------------------------------------------ block-scaled formats


@triton.jit
def _round_grid(v, M: tl.constexpr, EMIN: tl.constexpr):
    """``v >= 0`` (float32, at most ``2**(EMIN + 23 - M)`` times the grid's top binade)
    rounded to nearest-even onto the grid of an element format with ``M`` mantissa bits
    and smallest normal ``2**EMIN`` (no saturation). Adding ``k``, a power of two whose
    float32 spacing is the grid's spacing at ``v``, rounds (IEEE, to even); subtracting it
    is exact. Only additions: no multiply-add can be contracted into the rounding."""
    field = v.to(tl.int32, bitcast=True) >> 23
    k = ((tl.maximum(field, EMIN + 127) + (23 - M)) << 23).to(tl.float32, bitcast=True)
    return (v + k) - k


@triton.jit
def _sum1(v):
    """Sum along axis 1 (the elements of each block)."""
    return tl.reduce(v, 1, _ADD)


@triton.jit
def _counts(c0, c1, c2):
    """The per-block counts of three conditions on a tile of blocks, in one reduction:
    packed into one integer per element (a block holds at most 32 elements: 8 bits each)."""
    packed = _sum1(c0.to(tl.int32) | (c1.to(tl.int32) << 8) | (c2.to(tl.int32) << 16))
    return packed & 255, (packed >> 8) & 255, packed >> 16


@triton.jit
def _mx_tile(
    a, e, big, EMAX: tl.constexpr, EMIN: tl.constexpr, M: tl.constexpr, FMAX: tl.constexpr
):
    """One MX format's per-block sums of a ``[blocks, 32]`` tile of magnitudes ``a`` (0
    where no finite value), ``e`` ``[blocks, 1]`` the floor(log2) of each block's largest
    (0 for a block without a non-zero value): ``(underflow, subnormal, saturated)`` counts
    and the squared errors of the ``big`` elements (those at least ``2**(e - 32)``) as
    ``sum((q - y)**2) * 2**(120 - 2 EMAX)``, float32: ``y = a / 2**(e - EMAX)`` is exact
    (two power-of-two factors, each a normal float32) for every element that can round to a
    non-zero element, and so is ``q - y``; the scaled squares of the big elements are
    normal floats below ``2**122``. The others are zero in every MX format; their error
    (``a`` itself) is summed apart (:func:`_small_err`)."""
    k = EMAX - e
    h = k >> 1
    y = (a * _pow2_f32(h)) * _pow2_f32(k - h)
    q = _round_grid(tl.minimum(y, FMAX), M, EMIN)
    under, subn, sat = _counts(
        (a > 0) & (q == 0), (q > 0) & (q < _pow2_f32(EMIN + 0 * h)), y > FMAX
    )
    d = tl.where(big, (q - y) * _pow2_f32(60 - EMAX + 0 * h), 0.0)
    return under, subn, sat, _sum1(d * d)


@triton.jit
def _small_err(a, ea, e, small):
    """Per block, the float64 sum of ``a**2`` over the ``small`` elements (non-zero, below
    ``2**(e - 32)``: zero in every MX format, so their squared error is ``a**2``), exact to
    float32's rounding: in two float32 sums of squares scaled into the normal range (by
    ``2**(93 - e)``, and ``2**(217 - e)`` for elements below ``2**(e - 156)``)."""
    tiny = ea < e - 156
    t = tl.minimum(tl.where(tiny, 217 - e, 93 - e), 250)
    h = t >> 1
    v = (tl.where(small, a, 0.0) * _pow2_f32(h)) * _pow2_f32(t - h)
    v2 = v * v
    s2 = _sum1(tl.where(small & ~tiny, v2, 0.0)).to(tl.float64)
    s3 = _sum1(tl.where(small & tiny, v2, 0.0)).to(tl.float64)
    eb = tl.reshape(e, [e.shape[0]])
    return s2 * _pow2_f64(2 * eb - 186) + s3 * _pow2_f64(2 * eb - 434)


@triton.jit
def _nv_tile(a, s_t, st_ok):
    """NVFP4's per-block ``(underflow, subnormal, saturated, squared error, max/min)`` of
    a ``[blocks, 16]`` tile of magnitudes ``a``, given the tensor's scale ``s_t`` (1 where
    ``st_ok`` is false: the tensor scale is 0, every block's scale too). float32 in the
    definition's order (divisions rounded to nearest); the error in float64, where the
    dequantized value ``q * (s_b * s_t)`` and its difference from ``a`` are exact."""
    amax = tl.reduce(a, 1, _MAX)
    amin = tl.reduce(tl.where(a > 0, a, float("inf")), 1, _MIN)
    ratio = tl.where(amax > 0, amax.to(tl.float64) / amin.to(tl.float64), 0.0)
    u = tl.math.div_rn(tl.math.div_rn(amax, 6.0), s_t)
    u = tl.where(st_ok, tl.where(amax > 0, tl.minimum(u, 448.0), 0.0), 0.0)
    scale = _round_grid(u, 3, -6) * s_t
    ok = scale > 0
    y = tl.math.div_rn(a, tl.where(ok, scale, 1.0)[:, None])
    q = tl.where(ok[:, None], _round_grid(tl.minimum(y, 6.0), 1, 0), 0.0)
    under, subn, sat = _counts((a > 0) & (q == 0), (q > 0) & (q < 1.0), ok[:, None] & (y > 6.0))
    d = q.to(tl.float64) * tl.where(ok, scale, 0.0).to(tl.float64)[:, None] - a.to(tl.float64)
    return under, subn, sat, _sum1(d * d), ratio


@triton.jit
def _add_columns(ptr, under, subn, sat, err, ratio):
    """Adds one program's columns of a format to the row's (``ptr``: its first column);
    the block range as the largest ``max/min`` ratio (its float64 bits: positive floats
    order as integers), turned into log2 by :func:`finish_rows`."""
    tl.atomic_add(ptr, tl.sum(under.to(tl.float64)), sem="relaxed")
    tl.atomic_add(ptr + 1, tl.sum(subn.to(tl.float64)), sem="relaxed")
    tl.atomic_add(ptr + 2, tl.sum(sat.to(tl.float64)), sem="relaxed")
    tl.atomic_add(ptr + 3, tl.sum(err), sem="relaxed")
    bits = ptr.to(tl.pointer_type(tl.int64), bitcast=True) + 4
    tl.atomic_max(bits, tl.max(ratio).to(tl.int64, bitcast=True), sem="relaxed")


@triton.jit
def _mx_zeros(NB: tl.constexpr):
    """The MX formats' per-block sums of :func:`_mx_blocks` for tiles of ``NB`` blocks, zero."""
    zi = tl.zeros([NB], tl.int32)
    zf = tl.zeros([NB], tl.float64)
    return (zi, zi, zi, zf, zi, zi, zi, zf, zi, zi, zi, zf, zf, zf)


@triton.jit
def _mx_blocks(a, acc, C_E4M3: tl.constexpr, C_E5M2: tl.constexpr, C_E2M1: tl.constexpr):
    """``acc``, the MX formats' sums per block of tile (underflow, subnormal, saturated,
    scaled error of each format, the error of the small elements, the largest max/min
    ratio), with the ``[blocks, 32]`` tile of magnitudes ``a`` (0: no finite value) added:
    the formats whose ``C_*`` is not 0. Each block's error is taken back to float64 and
    its scale here."""
    u1, s1, t1, e1, u2, s2, t2, e2, u3, s3, t3, e3, es, rmx = acc
    NB: tl.constexpr = a.shape[0]
    amax = tl.reduce(a, 1, _MAX)
    amin = tl.reduce(tl.where(a > 0, a, float("inf")), 1, _MIN)
    rmx = tl.maximum(rmx, tl.where(amax > 0, amax.to(tl.float64) / amin.to(tl.float64), 0.0))
    e = tl.where(amax > 0, _exponent(amax.to(tl.int32, bitcast=True), True, 0), 0)[:, None]
    ea = _exponent(a.to(tl.int32, bitcast=True), True, 0)
    big = ea >= e - 32
    es += _small_err(a, ea, e, (a > 0) & ~big)
    back = _pow2_f64(2 * tl.reshape(e, [NB]) - 120)  # the scaled errors' factor
    if C_E4M3:
        du, ds, dt, de = _mx_tile(a, e, big, 8, -6, 3, 448.0)
        u1, s1, t1, e1 = u1 + du, s1 + ds, t1 + dt, e1 + de.to(tl.float64) * back
    if C_E5M2:
        du, ds, dt, de = _mx_tile(a, e, big, 15, -14, 2, 57344.0)
        u2, s2, t2, e2 = u2 + du, s2 + ds, t2 + dt, e2 + de.to(tl.float64) * back
    if C_E2M1:
        du, ds, dt, de = _mx_tile(a, e, big, 2, 0, 1, 6.0)
        u3, s3, t3, e3 = u3 + du, s3 + ds, t3 + dt, e3 + de.to(tl.float64) * back
    return (u1, s1, t1, e1, u2, s2, t2, e2, u3, s3, t3, e3, es, rmx)


@triton.jit
def _mx_columns(row, acc, C_E4M3: tl.constexpr, C_E5M2: tl.constexpr, C_E2M1: tl.constexpr):
    """Adds a program's MX sums (:func:`_mx_blocks`) to the row ``row``."""
    u1, s1, t1, e1, u2, s2, t2, e2, u3, s3, t3, e3, es, rmx = acc
    if C_E4M3:
        _add_columns(row + C_E4M3, u1, s1, t1, e1 + es, rmx)
    if C_E5M2:
        _add_columns(row + C_E5M2, u2, s2, t2, e2 + es, rmx)
    if C_E2M1:
        _add_columns(row + C_E2M1, u3, s3, t3, e3 + es, rmx)


@triton.jit
def _nv_zeros(NB: tl.constexpr):
    """NVFP4's per-block sums of :func:`_nv_blocks` for tiles of ``NB`` blocks of 32 (``2 NB``
    blocks of 16), zero."""
    zi = tl.zeros([2 * NB], tl.int32)
    zf = tl.zeros([2 * NB], tl.float64)
    return (zi, zi, zi, zf, zf)


@triton.jit
def _nv_blocks(a, acc, s_t, st_ok):
    """``acc``, NVFP4's sums per block of 16 (underflow, subnormal, saturated, squared
    error, the largest max/min ratio), with the ``[blocks, 32]`` tile of magnitudes ``a``
    added (:func:`_nv_tile`, tensor scale ``s_t`` and ``st_ok``: :func:`_tensor_scale`)."""
    un, sn, tn, en, rnv = acc
    du, ds, dt, de, dr = _nv_tile(tl.reshape(a, [2 * a.shape[0], 16]), s_t, st_ok)
    return (un + du, sn + ds, tn + dt, en + de, tl.maximum(rnv, dr))


@triton.jit
def _nv_columns(row, acc, C_NV: tl.constexpr):
    """Adds a program's NVFP4 sums (:func:`_nv_blocks`) to the row ``row`` (if ``C_NV``)."""
    if C_NV:
        un, sn, tn, en, rnv = acc
        _add_columns(row + C_NV, un, sn, tn, en, rnv)


@triton.jit
def _tensor_scale(row):
    """NVFP4's tensor scale ``s_t``: the tensor's largest magnitude (``MAX_ABS`` in its row
    ``row``, written by the summary kernel) over ``6 * 448``; and ``st_ok``, whether that
    is above 0 (where it is not, ``s_t`` is 1 and :func:`_nv_tile` gives every block the
    scale 0)."""
    amax_t = tl.load(row + 7).to(tl.float32)  # MAX_ABS
    st_ok = amax_t > 0
    s_t = tl.math.div_rn(tl.where(st_ok, amax_t, 2688.0), 2688.0)
    st_ok = s_t > 0  # (a tensor maximum below 2688 * 2**-149 gives 0)
    return tl.where(st_ok, s_t, 1.0), st_ok


@triton.jit
def _block_tile(
    ptr,
    t0,
    j,
    length,
    per_row,
    b_end,
    rs,
    cs,
    lut_ptr,
    MODE: tl.constexpr,
    NB: tl.constexpr,
    DENSE: tl.constexpr,
):
    """The ``[NB, 32]`` tile of magnitudes of blocks ``t0`` to ``t0 + NB`` (the layout and
    arguments of :func:`_blocks`; ``j``: ``[1, 32]``, 0 to 31), 0 for an element masked
    off (block ``b_end`` and after, past its row's end) and for an infinite or NaN one."""
    b = t0 + tl.arange(0, NB).to(tl.int64)[:, None]
    r = b // per_row
    col = (b - r * per_row) * 32 + j
    if DENSE:  # whole blocks of consecutive elements, DENSE-aligned: vector loads
        m = tl.broadcast_to(b < b_end, [NB, 32])
        x = _load(ptr, r * rs * DENSE + col, m, lut_ptr, MODE, True)  # rs: in DENSE units
    else:
        m = (b < b_end) & (col < length)
        x = _load(ptr, r * rs + col * cs, m, lut_ptr, MODE, True)
    return tl.where(m & (_magnitude_bits(x, 0) < _inf_bits(0)), tl.abs(x), 0.0)


@triton.jit
def _blocks(
    ptr,
    length,
    per_row,
    b0,
    b_end,
    rs,
    cs,
    row,
    lut_ptr,
    MODE: tl.constexpr,
    NB: tl.constexpr,
    DENSE: tl.constexpr,
    C_E4M3: tl.constexpr,
    C_E5M2: tl.constexpr,
    C_E2M1: tl.constexpr,
    C_NV: tl.constexpr,
):
    """One program's share, blocks ``[b0, b_end)``, of the block-scaled formats' columns of
    one tensor whose row is at ``row`` (written by :func:`_summarize_one` or
    :func:`_summarize_many` before: NVFP4 takes the tensor's largest magnitude from it), a
    second read: rows of ``length`` elements (row stride ``rs``, element stride ``cs``),
    ``per_row`` blocks of 32 per row, read as tiles of ``NB`` blocks (tile row ``b`` is
    block ``b``: row ``b // per_row``, elements from ``(b % per_row) * 32``, masked past
    the row's end). ``C_*``: the row column of each format's first column (0: not
    computed). ``DENSE``: the element stride is 1 and the row length a multiple of 32 and
    of ``DENSE`` (16 bytes of elements; ``rs`` is then in units of ``DENSE``), so that the
    compiler reads each block's elements by vector loads (a mask per block row, not per
    element). Each tile's magnitudes (:func:`_block_tile`) add to the MX formats' sums per
    block (:func:`_mx_blocks`) and NVFP4's (:func:`_nv_blocks`, with the tensor scale of
    :func:`_tensor_scale`); the program then adds its sums to the row (atomics; the row
    starts at zero)."""
    MX: tl.constexpr = C_E4M3 + C_E5M2 + C_E2M1
    s_t, st_ok = _tensor_scale(row)
    acc = (_mx_zeros(NB), _nv_zeros(NB))
    j = tl.arange(0, 32)[None, :]
    for t0 in range(b0, b_end, NB):
        a = _block_tile(ptr, t0, j, length, per_row, b_end, rs, cs, lut_ptr, MODE, NB, DENSE)
        mx, nv = acc
        if MX:
            mx = _mx_blocks(a, mx, C_E4M3, C_E5M2, C_E2M1)
        if C_NV:
            nv = _nv_blocks(a, nv, s_t, st_ok)
        acc = (mx, nv)
    mx, nv = acc
    _mx_columns(row, mx, C_E4M3, C_E5M2, C_E2M1)
    _nv_columns(row, nv, C_NV)


@triton.jit(do_not_specialize=["length", "per_row", "blocks", "per_prog", "rs", "cs", "row_off"])
def _blocks_one(
    x_ptr,
    length,
    per_row,
    blocks,
    per_prog,
    rs,
    cs,
    rows_ptr,
    row_off,
    lut_ptr,
    MODE: tl.constexpr,
    NB: tl.constexpr,
    DENSE: tl.constexpr,
    C_E4M3: tl.constexpr,
    C_E5M2: tl.constexpr,
    C_E2M1: tl.constexpr,
    C_NV: tl.constexpr,
):
    """:func:`_blocks` of one tensor of ``blocks`` blocks, ``per_prog`` per program, into
    the row at ``rows_ptr + row_off``."""
    b0 = tl.program_id(0).to(tl.int64) * per_prog
    if MODE == 2:  # bfloat16: read as int16 bits
        ptr = x_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
    else:
        ptr = x_ptr
    _blocks(
        ptr,
        length,
        per_row,
        b0,
        tl.minimum(b0 + per_prog, blocks),
        rs,
        cs,
        rows_ptr + row_off,
        lut_ptr,
        MODE,
        NB,
        DENSE,
        C_E4M3,
        C_E5M2,
        C_E2M1,
        C_NV,
    )


@triton.jit
def _blocks_many(
    table_ptr,
    rows_ptr,
    lut_ptr,
    MODE: tl.constexpr,
    NB: tl.constexpr,
    DENSE: tl.constexpr,
    C_E4M3: tl.constexpr,
    C_E5M2: tl.constexpr,
    C_E2M1: tl.constexpr,
    C_NV: tl.constexpr,
):
    """:func:`_blocks` of many contiguous tensors of one dtype: program ``i`` reads row
    ``i`` of the table ``(address, row length, blocks per row, first block, end block,
    row stride (in units of DENSE with DENSE), row offset)``."""
    t = table_ptr + tl.program_id(0) * 7
    _blocks(
        _typed(tl.load(t), MODE, DENSE > 0),
        tl.load(t + 1),
        tl.load(t + 2),
        tl.load(t + 3),
        tl.load(t + 4),
        tl.load(t + 5),
        1,
        rows_ptr + tl.load(t + 6),
        lut_ptr,
        MODE,
        NB,
        DENSE,
        C_E4M3,
        C_E5M2,
        C_E2M1,
        C_NV,
    )


#: Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when this module
#: was imported), which reads CPU tensors; compiled kernels read CUDA tensors.
INTERPRETED = not isinstance(_summarize_one, triton.runtime.JITFunction)
#: Whether the summary kernels count exponents in a table of their own in shared memory
#: (inline PTX: compiled for NVIDIA GPUs) rather than by ``tl.histogram`` (the
#: interpreter, and ROCm's builds of torch, whose Triton compiles for AMD GPUs).
SHARED_COUNTS = not INTERPRETED and torch.version.hip is None


# ---------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class Spec:
    """How the kernel reads one torch dtype.

    Attributes:
        dtype: the torch dtype.
        mode: 0 float32, 1 float16, 2 bfloat16 (as int16 bits), 3 an 8-bit format (as
            uint8 codes through a table of their values), 4 float64.
        sub: whether values can be subnormal in the compute type (float32, float64 for
            mode 4): their exponents need more work.
        dmin, nbd: the dtype's smallest exponent and its number of exponents: a row
            holds ``nbd`` counts, of exponents ``dmin .. dmin + nbd - 1``.
        vmax: the dtype's largest finite value (values above a format's max exist only
            when it is larger).
        lut: the 256 values of an 8-bit format as float32 (mode 3), else ``None``.
    """

    dtype: torch.dtype
    mode: int
    sub: bool
    dmin: int
    nbd: int
    vmax: float
    lut: np.ndarray | None = field(default=None, compare=False)

    @cached_property
    def keys(self) -> tuple[int, int, int]:
        """``(bins, zero's bin, inf's bin)`` of a program's histogram (NaN's is inf's + 1).

        The kernel's key of a value is ``(e - dmin + isnan) & (bins - 1)`` for the
        exponent ``e`` its formula gives: the exponent for finite non-zero values, one
        above the compute type's largest for inf and NaN, a fixed one far below the
        smallest for zeros (wrapped around by the mask). ``bins`` is the smallest power
        of two that keeps those three bins apart and above the exponents' ``nbd``."""
        top, low = (1024, -2097) if self.mode == 4 else (128, -276 if self.sub else -127)
        bins = 16
        while True:
            zero, inf = (low - self.dmin) % bins, (top - self.dmin) % bins
            if len({zero, inf, (inf + 1) % bins}) == 3 and min(zero, inf, inf + 1) >= self.nbd:
                return bins, zero, inf
            bins *= 2

    @cached_property
    def window_top(self) -> int:
        """The exponent field (of the compute type) of the window's first bin when every
        exponent of the dtype fits in the window: ``WINDOW - 2`` fields ending at the
        dtype's largest exponent; 0 when the kernel anchors the window at run time."""
        if self.nbd > WINDOW - 2 or self.mode == 4:
            return 0
        return self.dmin + self.nbd - 1 + 127

    @cached_property
    def vec(self) -> int:
        """Elements of one load: 16 bytes, 8 bytes of 8-bit formats."""
        return min(16 // self.dtype.itemsize, PER_THREAD)

    @cached_property
    def k(self) -> int:
        """Loads per thread and tile."""
        return PER_THREAD // self.vec

    @cached_property
    def maxnreg(self) -> int | None:
        """The register cap of the kernels (none for float64: it would spill)."""
        return None if self.mode == 4 else MAXNREG

    @cached_property
    def block(self) -> int:
        """Elements of a tile."""
        return self.k * SLOTS * self.vec

    @property
    def row_size(self) -> int:
        """Length of a row, custom statistics excluded."""
        return HEADER + self.nbd


_MODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 4}


@cache
def spec_for(dtype: torch.dtype) -> Spec | None:
    """The :class:`Spec` of ``dtype``, or ``None`` if the kernel does not read it (formats
    wider than 8 bits other than float64, float32, float16 and bfloat16)."""
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
    sub = fmt.min_exponent < (-1022 if mode == 4 else -126)
    return Spec(dtype, mode, sub, fmt.min_exponent, fmt.num_bins, fmt.max, lut)


def row_size(spec: Spec, layout: Layout) -> int:
    """Length of a row of ``spec``'s tensors in ``layout`` (custom statistics included, and
    ``m3``, ``m4`` after them with ``layout.moments == 4``)."""
    return spec.row_size + len(layout.extras) + layout.num_higher


def _hoff(spec: Spec, layout: Layout) -> int:
    """The kernels' ``HOFF``: where ``m3`` lies in a row (0: the layout has no ``m3``)."""
    return spec.row_size + len(layout.extras) if layout.num_higher else 0


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


def _parts(n: int, max_parts: int, block: int) -> tuple[int, int]:
    """``(programs, elements per program)`` for a tensor of ``n`` elements and tiles of
    ``block``: one program up to :data:`ONE_PROGRAM` tiles, else up to ``max_parts`` of
    whole tiles, as many as there are tiles (mid-size tensors fill the GPU)."""
    if n <= ONE_PROGRAM * block:
        return 1, n
    tiles = -(-n // block)
    parts = min(tiles, max_parts)
    per = -(-tiles // parts) * block
    return -(-n // per), per


def scratch_rows(n: int, max_parts: int, spec: Spec | None = None) -> int:
    """Scratch rows (of :data:`PART` float64) one tensor of ``n`` elements of ``spec``'s
    dtype needs (without ``spec``: enough for any dtype)."""
    block = spec.block if spec is not None else SLOTS * PER_THREAD  # every dtype's tile
    parts = _parts(n, max_parts, block)[0]
    return parts if parts > 1 else 0


@dataclass(frozen=True, eq=False)
class _Consts:
    """A kernel variant: its compile-time arguments and launch options (``kwargs``), and
    their values in the order of the kernel's parameters after the runtime ones (``tail``:
    what a prebuilt launcher takes after them)."""

    kwargs: dict[str, Any]
    tail: tuple[Any, ...]


@cache
def _consts(
    spec: Spec,
    over: bool,
    strided: int = 0,
    ext: bool = False,
    aligned: bool | None = None,
    hoff: int = 0,
    mx: tuple[int, int, int] = (0, 0, 0),
) -> _Consts:
    """The variant of ``spec``'s kernels: ``over``, values above the layout format's max
    are counted; ``strided``, a gappy view (1: offsets below 2**31, 2: larger; no
    register cap: its index arithmetic would
    spill); ``ext``, a statistic is copied in; ``aligned`` (:func:`launch_many` only):
    every tensor address it reads is 16-byte aligned; ``hoff``: the third and fourth moments
    are computed into the row at ``hoff`` (:func:`_hoff`; 0: not computed); ``mx``: the row
    columns of the MX formats computed in the pass (``C_E4M3, C_E5M2, C_E2M1``; 0: not)."""
    bins, zkey, ikey = spec.keys
    kw: dict[str, Any] = dict(
        MODE=spec.mode,
        SUB=spec.sub,
        DMIN=spec.dmin,
        NBD=spec.nbd,
        NBP=bins,
        ZKEY=zkey,
        IKEY=ikey,
        TOP=spec.window_top,
        WIN=WINDOW,
        VEC=spec.vec,
        K=spec.k,
        SLOTS=SLOTS,
        OVER=over,
    )
    if aligned is None:
        kw.update(STRIDED=strided, EXT=ext)
    else:
        kw.update(ALIGNED=aligned)
    kw["GROUP"] = GROUP
    kw["HOFF"] = hoff
    kw.update(zip(("C_E4M3", "C_E5M2", "C_E2M1"), mx))
    kw["SMEM"] = SHARED_COUNTS
    tail = tuple(kw.values())
    # no register cap for a gappy view (its index arithmetic would spill) nor with m3, m4
    # (their float64 state and update: ~120 registers, 2 programs per SM, no spills) nor
    # with MX formats in the pass (~210 registers; a cap of 128 spills inside the loop)
    cap = None if strided or hoff or any(mx) else spec.maxnreg
    kw.update(num_warps=NUM_WARPS, maxnreg=cap, enable_fp_fusion=True)
    return _Consts(kw, tail)


_dtype = operator.attrgetter("dtype")

#: Prebuilt launchers: the compiled kernel of each variant, device and pointer alignment.
_launchers: dict[tuple[Any, ...], Any] = {}


def _launch(
    kernel: Any,
    programs: int,
    args: tuple[Any, ...],
    consts: _Consts,
    ptrs: tuple[torch.Tensor, ...],
) -> Any:
    """``kernel[(programs,)](*args, **consts.kwargs)`` on the current stream; returns the
    compiled kernel launched (``None`` in the interpreter).

    Triton's ``kernel[grid](...)`` binds and specializes the arguments on every call. The
    first call of a variant does that (and compiles); later calls launch the compiled
    kernel directly, keyed by everything Triton specializes these kernels on: the variant
    (compile-time arguments), the device, and the element type and 16-byte alignment of
    each pointer ``ptrs`` (every integer argument is ``do_not_specialize``, floats never
    are). The kernel is keyed by its identity (the module's kernels live as long as the
    module): a Triton kernel's own hash is a Python method that takes a lock, about a
    microsecond a launch."""
    if INTERPRETED:
        kernel[(programs,)](*args, **consts.kwargs)
        return None
    aligned = 0  # (bit i from the right: pointer i from the end is 16-byte aligned)
    for address in map(torch.Tensor.data_ptr, ptrs):
        aligned += aligned + (address % 16 == 0)
    device = ptrs[0].device.index
    key = (id(kernel), consts, device, *map(_dtype, ptrs), aligned)
    compiled = _launchers.get(key)
    if compiled is None:
        compiled = kernel[(programs,)](*args, **consts.kwargs)
        if compiled is not None:  # (None: a compile-only stand-in)
            _launchers[key] = compiled
        return compiled
    stream = driver.active.get_current_stream(device)
    full = (*args, *consts.tail)
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if launch_hooked(enter, leave):
        meta = compiled.launch_metadata((programs, 1, 1), stream, *full)
    else:  # (no launch metadata to build, no empty hook chain to call)
        meta = enter = leave = None
    compiled.run(
        programs,
        1,
        1,
        stream,
        compiled.function,
        compiled.packed_metadata,
        meta,
        enter,
        leave,
        *full,
    )
    return compiled


def launch_hooked(enter: Any, leave: Any) -> bool:
    """Whether Triton's launch hooks (``knobs.runtime.launch_enter_hook`` and
    ``launch_exit_hook``: a profiler's) would do anything: each is ``None``, a function, or
    a chain of functions (Triton >= 3.4: always a chain, empty unless a profiler added
    one)."""
    return (enter is not None and bool(getattr(enter, "calls", True))) or (
        leave is not None and bool(getattr(leave, "calls", True))
    )


def _over(spec: Spec, layout: Layout) -> bool:
    """Whether ``spec``'s dtype holds finite values above the layout format's max."""
    return spec.vmax > layout.format.max


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


def _reach(n: int, geo: tuple[int, ...]) -> int:
    """The largest element index or offset the kernel computes for ``n`` elements of a
    view of geometry ``geo`` (sizes ``(., s1, s2)``, strides ``(t0, t1, t2)``)."""
    s1, s2, t0, t1, t2 = geo
    return max(n + 8 * SLOTS * PER_THREAD, (n // (s1 * s2)) * t0 + s1 * t1 + s2 * t2)


def _view(x: torch.Tensor, spec: Spec) -> tuple[torch.Tensor, int, tuple[int, ...] | None]:
    """``(base, weight, geometry)``: how the kernel reads ``x`` without a copy.

    Broadcast dimensions (stride 0) are read once and weighted by their sizes' product.
    ``geometry`` is ``None`` when the rest covers its memory densely (in any order: the
    statistics ignore order), else ``(s1, s2, t0, t1, t2)``: the rest as a view of at
    most three dimensions, sizes ``(., s1, s2)`` and strides ``(t0, t1, t2)`` in
    elements from ``base``'s data pointer. A view that needs more dimensions is copied
    (rare: a gappy slice of a gappy slice). A lazily negated view, whose memory holds the
    values' negatives, is resolved into a copy. 8-bit formats are viewed as bytes."""
    if x.is_neg():
        x = x.resolve_neg()
    weight = 1
    if 0 in x.stride():
        idx = tuple(
            slice(0, 1) if st == 0 and sz > 1 else slice(None)
            for sz, st in zip(x.shape, x.stride())
        )
        for sz, st in zip(x.shape, x.stride()):
            if st == 0:
                weight *= sz
        x = x[idx]
    if spec.mode == 3:
        x = x.view(torch.uint8)
    if x.is_contiguous() or _dense(x):
        return x, weight, None
    dims = sorted(((sz, st) for sz, st in zip(x.shape, x.stride()) if sz != 1), key=lambda p: -p[1])
    merged: list[list[int]] = []
    for sz, st in dims:  # join a dimension to the one before when it continues it
        if merged and merged[-1][1] == st * sz:
            merged[-1] = [merged[-1][0] * sz, st]
        else:
            merged.append([sz, st])
    if len(merged) > 3:
        return x.contiguous(), weight, None
    while len(merged) < 3:
        merged.insert(0, [1, 0])
    (_, t0), (s1, t1), (s2, t2) = merged
    return x, weight, (s1, s2, t0, t1, t2)


def clear_caches() -> None:
    """Forget the kernel variants, launchers and dtype specs (after a change of the tile
    constants: tests and tuning)."""
    _consts.cache_clear()
    _block_consts.cache_clear()
    _block_cols.cache_clear()
    _block_names.cache_clear()
    _block_tables.clear()
    spec_for.cache_clear()
    _fold.cache_clear()
    _fold_runs.cache_clear()
    _plans.clear()
    _plans_many.clear()
    _tables.clear()
    _table_layouts.clear()
    _launchers.clear()


#: launch_one's variant and format max per (spec, layout, strided, statistic copied), by
#: identity (hashing the dataclasses on every hook would cost more than the rest).
_plans: dict[tuple[int, int, int, bool, bool], tuple[_Consts, float, Spec, Layout]] = {}


def launch_one(
    x: torch.Tensor,
    spec: Spec,
    layout: Layout,
    rows: torch.Tensor,
    offset: int,
    scratch: torch.Tensor,
    max_parts: int,
    *,
    extra: tuple[int, torch.Tensor] | None = None,
) -> None:
    """Summarize ``x`` (dtype ``spec.dtype``, not empty) into ``rows[offset:]`` (zeros) in
    one launch, on the current stream; ``scratch`` holds :func:`scratch_rows` rows.

    ``extra``: ``(column, value)``: the kernel also writes the 1-element tensor ``value``
    (on ``x``'s device; a ``GradScaler``'s scale) to custom statistic ``column`` of the
    layout, instead of a copy of its own per call."""
    base, weight, geo = _view(x, spec)
    n = base.numel()
    parts, per = _parts(n, max_parts, spec.block)
    if extra is None:
        ext, ext_off = rows, 0
    else:
        ext_off = block_columns_at(spec, layout) + extra[0]
        ext = extra[1]
    lut = _lut(spec, x.device, rows)
    strided = 0 if geo is None else 1 if _reach(n, geo) < 2**31 else 2
    mx = bool(layout.extras) and _mx_in_pass(x, spec, layout)
    consts, fmax = plan_one(spec, layout, strided, extra is not None, mx)
    args: tuple[Any, ...] = (base, n, -(-per // spec.block), rows, offset, scratch, lut)
    args += (fmax, float(weight), ext, ext_off, *(geo or (1, 1, 0, 0, 0)))
    _launch(_summarize_one, parts, args, consts, (base, rows, scratch, lut, ext))
    launch_blocks(x, spec, layout, rows, offset, max_parts, mx_done=mx)


def plan_one(
    spec: Spec, layout: Layout, strided: int, ext: bool, mx: bool = False
) -> tuple[_Consts, float]:
    """:func:`launch_one`'s kernel variant and format max for ``spec``'s tensors in
    ``layout`` (``strided``, ``ext``: see :func:`_consts`; ``mx``: the layout's MX formats
    in the pass), looked up by identity."""
    plan = _plans.get((id(spec), id(layout), strided, ext, mx))
    if plan is None:  # (the key's objects are kept alive with the plan)
        cols = _mx_cols(spec, layout) if mx else (0, 0, 0)
        consts = _consts(spec, _over(spec, layout), strided, ext, hoff=_hoff(spec, layout), mx=cols)
        plan = (consts, _fmax(layout), spec, layout)
        _plans[(id(spec), id(layout), strided, ext, mx)] = plan
    return plan[0], plan[1]


#: The block formats the block kernel computes, in the order of its ``C_*`` arguments.
_BLOCK_KERNEL_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1", "nvfp4")
#: Blocks of 32 per tile of the block kernel.
BLOCK_TILE = 64


def block_columns_at(spec: Spec, layout: Layout) -> int:
    """Where the layout's custom statistics that the caller writes start in a row of
    ``spec``'s tensors: after the block formats' columns, which the kernels write."""
    return spec.row_size + len(BLOCK_COLUMNS) * len(_names_of(layout.extras))


@cache
def _block_names(extras: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """The names of the block formats whose columns lead a layout's ``extras``."""
    return tuple(f.name for f in block_formats_of(extras))


def _names_of(extras: Any) -> tuple[str, ...]:
    """:func:`_block_names` (cached) of a layout's extras, also where they are not
    hashable (lists)."""
    try:
        return _block_names(extras)
    except TypeError:
        return tuple(f.name for f in block_formats_of(extras))


@cache
def _block_cols(spec: Spec, names: tuple[str, ...]) -> tuple[int, int, int, int]:
    """The row column of the first column of each of :data:`_BLOCK_KERNEL_FORMATS` for
    ``spec``'s tensors and the block formats ``names`` (in the layout's order; 0: absent)."""
    cols = [0] * len(_BLOCK_KERNEL_FORMATS)
    for i, name in enumerate(names):
        cols[_BLOCK_KERNEL_FORMATS.index(name)] = spec.row_size + len(BLOCK_COLUMNS) * i
    return cols[0], cols[1], cols[2], cols[3]


def _mx_cols(spec: Spec, layout: Layout) -> tuple[int, int, int]:
    """The summary kernels' ``C_E4M3, C_E5M2, C_E2M1`` for ``layout``'s MX formats."""
    return _block_cols(spec, _names_of(layout.extras))[:3]


def _mx_in_pass(x: torch.Tensor, spec: Spec, layout: Layout) -> bool:
    """Whether the summary kernel computes ``layout``'s MX formats of ``x`` in its pass:
    there are some, and ``x`` lies in memory in its own order (contiguous) in rows of a
    multiple of 32 elements, so that each 32 consecutive elements of a tile are a block
    (not float64, whose block columns take the torch-op path)."""
    return (
        spec.mode != 4
        and any(_mx_cols(spec, layout))
        and x.is_contiguous()
        and (x.shape[-1] if x.dim() else 1) % 32 == 0
    )


@cache
def _block_consts(spec: Spec, names: tuple[str, ...], dense: bool, mx_done: bool) -> _Consts | None:
    """The block kernel's variant for ``spec``'s tensors and the block formats ``names`` (in
    the layout's order; NVFP4 alone with ``mx_done``; ``None`` if none); ``dense``: see
    ``DENSE``."""
    cols = _block_cols(spec, names)
    if mx_done:
        cols = (0, 0, 0, cols[3])
    if not any(cols):
        return None
    vec = 16 // spec.dtype.itemsize
    # (per-element loads spread each block over a warp: fewer blocks a tile, fewer registers)
    nb = BLOCK_TILE if dense else BLOCK_TILE // 4
    kw: dict[str, Any] = dict(MODE=spec.mode, NB=nb, DENSE=vec if dense else 0)
    kw.update(zip(("C_E4M3", "C_E5M2", "C_E2M1", "C_NV"), cols))
    tail = tuple(kw.values())
    kw.update(num_warps=NUM_WARPS, enable_fp_fusion=True)
    return _Consts(kw, tail)


def launch_blocks(
    x: torch.Tensor,
    spec: Spec,
    layout: Layout,
    rows: torch.Tensor,
    offset: int,
    max_parts: int,
    *,
    mx_done: bool = False,
) -> None:
    """Queue the block formats' columns of ``x`` (not empty; its row at ``offset`` already
    queued: NVFP4 reads the tensor's largest magnitude there) on the current stream: a
    second read of ``x``, by :func:`_blocks_one`; nothing without block formats, or with
    ``mx_done`` (the summary kernel computed the MX formats in its pass) without NVFP4.
    Rows are read by the strides of ``x`` viewed as ``(rows, last dimension)``; a view
    whose leading dimensions do not merge into one is copied."""
    names = _names_of(layout.extras)
    if not names or (mx_done and "nvfp4" not in names):
        return
    length = x.shape[-1] if x.dim() else 1
    if spec.mode == 3:
        x = x.view(torch.uint8)
    if x.dim() <= 1:
        v, rs, cs = x, 0, x.stride(0) if x.dim() else 1
    else:
        try:
            v = x.view(-1, length)
        except RuntimeError:  # leading dimensions that do not merge: a copy
            v = x.contiguous().view(-1, length)
        rs, cs = v.stride()
    per_row = -(-length // 32)
    blocks = (x.numel() // length) * per_row
    tiles = -(-blocks // BLOCK_TILE)
    per_prog = -(-tiles // min(tiles, max_parts)) * BLOCK_TILE
    lut = _lut(spec, x.device, rows)
    dense = cs == 1 and length % 32 == 0 and rs % (16 // spec.dtype.itemsize) == 0
    consts = _block_consts(spec, names, dense, mx_done)
    assert consts is not None
    if dense:
        rs //= 16 // spec.dtype.itemsize
    args = (v, length, per_row, blocks, per_prog, rs, cs, rows, offset, lut)
    _launch(_blocks_one, -(-blocks // per_prog), args, consts, (v, rows, lut))


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
    ``rows[offsets[i]:]`` in one launch, on the current stream; a tensor that does not
    cover its memory densely (rare among parameters and their state) gets its own launch
    (:func:`launch_one`), which reads it in place.

    ``scratch_for(k)`` must return a float64 tensor of at least ``k`` partial rows. The
    table of programs is kept for the next launch of the same tensors (:data:`_tables`),
    by stream: when it is dropped, the caching allocator reuses its memory only for work
    queued after it on that stream."""
    flats: Sequence[torch.Tensor]
    offs: Sequence[int]
    if not any(map(torch.Tensor.is_neg, tensors)) and all(
        map(torch.Tensor.is_contiguous, tensors)
    ):  # (the common case, told without a Python loop per tensor)
        flats = [t.view(torch.uint8) for t in tensors] if spec.mode == 3 else tensors
        offs = offsets
    else:
        flats, offs = _split_many(tensors, spec, layout, rows, offsets, scratch_for, max_parts)
    if not flats:
        return
    addresses = tuple(map(torch.Tensor.data_ptr, flats))
    ns = tuple(map(torch.Tensor.numel, flats))
    device = rows.device
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream, spec.block, max_parts, addresses, ns, tuple(offs))
    table = _tables.get(key)
    if table is None:  # new tensors, sizes or rows: built once, reused while they stay
        if len(_tables) >= _TABLES_KEPT:
            _tables.clear()
        table = _tables[key] = _table(addresses, ns, offs, spec.block, max_parts, device)
    dev_table, dev_addrs, programs, scratch_parts, aligned = table
    scratch = scratch_for(scratch_parts)
    lut = _lut(spec, device, rows)
    mx = bool(layout.extras) and all(_mx_in_pass(t, spec, layout) for t in flats)
    plan_key = (id(spec), id(layout), aligned, mx)
    plan = _plans_many.get(plan_key)
    if plan is None:  # (the key's objects are kept alive with the plan)
        cols = _mx_cols(spec, layout) if mx else (0, 0, 0)
        consts = _consts(
            spec, _over(spec, layout), aligned=aligned, hoff=_hoff(spec, layout), mx=cols
        )
        plan = _plans_many[plan_key] = (consts, _fmax(layout), spec, layout)
    args = (dev_table, dev_addrs, rows, scratch, lut, plan[1])
    _launch(_summarize_many, programs, args, plan[0], (dev_table, dev_addrs, rows, scratch, lut))
    if layout.extras and _names_of(layout.extras):
        _launch_blocks_many(flats, spec, layout, rows, offs, max_parts, mx, stream)


def _launch_blocks_many(
    tensors: Sequence[torch.Tensor],
    spec: Spec,
    layout: Layout,
    rows: torch.Tensor,
    offsets: Sequence[int],
    max_parts: int,
    mx_done: bool,
    stream: int,
) -> None:
    """:func:`launch_blocks` of many tensors: the contiguous ones in one launch of
    :func:`_blocks_many` (its table kept, as :func:`launch_many`'s, for the next launch of
    the same tensors into the same rows), each other one on its own."""
    names = _names_of(layout.extras)
    if not names or (mx_done and "nvfp4" not in names):
        return
    flat: list[torch.Tensor] = []
    offs: list[int] = []
    for t, off in zip(tensors, offsets):
        if t.is_contiguous():
            flat.append(t)
            offs.append(off)
        else:  # (a permuted dense tensor: by its strides)
            launch_blocks(t, spec, layout, rows, off, max_parts, mx_done=mx_done)
    if not flat:
        return
    device = rows.device
    addresses = tuple(map(torch.Tensor.data_ptr, flat))
    shapes = tuple(t.shape for t in flat)
    key = (device, stream, max_parts, addresses, shapes, tuple(offs))
    got = _block_tables.get(key)
    if got is None:
        if len(_block_tables) >= _TABLES_KEPT:
            _block_tables.clear()
        got = _block_tables[key] = _block_table(addresses, shapes, offs, spec, max_parts, device)
    table, programs, dense = got
    consts = _block_consts(spec, names, dense, mx_done)
    assert consts is not None
    lut = _lut(spec, device, rows)
    _launch(_blocks_many, programs, (table, rows, lut), consts, (table, rows, lut))


#: :func:`_launch_blocks_many`'s tables on their devices, with their program counts and
#: whether they read whole aligned blocks (``DENSE``), by (device, stream, max programs,
#: addresses, shapes, row offsets).
_block_tables: dict[tuple[Any, ...], tuple[torch.Tensor, int, bool]] = {}


def _block_table(
    addresses: tuple[int, ...],
    shapes: tuple[torch.Size, ...],
    offsets: Sequence[int],
    spec: Spec,
    max_parts: int,
    device: torch.device,
) -> tuple[torch.Tensor, int, bool]:
    """:func:`_blocks_many`'s table (on ``device``) for contiguous tensors at ``addresses``
    of ``shapes`` with rows at ``offsets``: programs of up to ``max_parts`` per tensor,
    each of whole tiles of blocks; and whether every tensor is read by ``DENSE`` loads."""
    vec = 16 // spec.dtype.itemsize
    length = np.array([s[-1] if len(s) else 1 for s in shapes], dtype=np.int64)
    numel = np.array([math.prod(s) for s in shapes], dtype=np.int64)
    address = np.array(addresses, dtype=np.int64)
    dense = bool(((length % 32 == 0) & (length % vec == 0) & (address % 16 == 0)).all())
    per_row = -(-length // 32)
    blocks = numel // length * per_row
    tiles = -(-blocks // BLOCK_TILE)
    per_prog = -(-tiles // np.minimum(tiles, max_parts)) * BLOCK_TILE
    parts = -(-blocks // per_prog)
    owner = np.repeat(np.arange(len(shapes)), parts)
    part = np.arange(owner.size) - (np.cumsum(parts) - parts)[owner]
    table = np.empty((owner.size, 7), dtype=np.int64)
    table[:, 0] = address[owner]
    table[:, 1] = length[owner]
    table[:, 2] = per_row[owner]
    table[:, 3] = part * per_prog[owner]
    table[:, 4] = np.minimum(table[:, 3] + per_prog[owner], blocks[owner])
    table[:, 5] = (length // vec if dense else length)[owner]
    table[:, 6] = np.asarray(offsets, dtype=np.int64)[owner]
    return _to_device(torch.from_numpy(table), device), int(owner.size), dense


def _split_many(
    tensors: Sequence[torch.Tensor],
    spec: Spec,
    layout: Layout,
    rows: torch.Tensor,
    offsets: Sequence[int],
    scratch_for: Any,
    max_parts: int,
) -> tuple[list[torch.Tensor], list[int]]:
    """:func:`launch_many`'s tensors that it reads as flat memory, with their row offsets;
    each of the others (not covering its memory densely, or a negated view) is launched
    here on its own (:func:`launch_one`), which reads it in place."""
    flats: list[torch.Tensor] = []
    offs: list[int] = []
    for t, off in zip(tensors, offsets):
        if t.is_neg() or not (t.is_contiguous() or _dense(t)):
            launch_one(
                t,
                spec,
                layout,
                rows,
                off,
                scratch_for(scratch_rows(t.numel(), max_parts, spec)),
                max_parts,
            )
        else:
            flats.append(t.view(torch.uint8) if spec.mode == 3 else t)
            offs.append(off)
    return flats, offs


#: launch_many's tables on their devices, by (device, stream, tile, max programs,
#: addresses, sizes, row offsets): a training loop summarizes the same weights and optimizer state
#: (and, with a caching allocator, gradients at the same addresses) into the same rows
#: every step, so the table is built and copied to the device once. A table depends on
#: nothing else; it is only read by the kernel, never written after its copy.
_tables: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, int, int, bool]] = {}
#: Tables kept at most (all are dropped when one more is needed: a loop that keeps
#: changing its tensors' addresses rebuilds its few tables each step, as without a cache).
_TABLES_KEPT = 64
#: launch_many's variant and format max per (spec, layout, aligned), by identity.
_plans_many: dict[tuple[int, int, bool, bool], tuple[_Consts, float, Spec, Layout]] = {}


def _table(
    addresses: tuple[int, ...],
    sizes: tuple[int, ...],
    offsets: Sequence[int],
    block: int,
    max_parts: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, int, int, bool]:
    """launch_many's table of programs for tensors at ``addresses`` of ``sizes`` elements
    summarized into rows at ``offsets``, on ``device``: ``(table, addresses, programs,
    scratch rows, every address 16-byte aligned)``. The table depends on the sizes and
    offsets alone (:func:`_table_layout`), the addresses are an array of their own: a
    loop's gradients come back at new addresses every step on the CPU."""
    template, owner, scratch_parts = _table_layout(sizes, tuple(offsets), block, max_parts)
    table = _to_device(torch.from_numpy(template), device)  # (the cached layout: never written)
    addrs = _to_device(torch.tensor(addresses, dtype=torch.int64), device)
    return table, addrs, int(owner.size), scratch_parts, _aligned(addresses)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor that a kernel on ``device`` reads (a launch table, the tensors'
    addresses): itself on the CPU; on a GPU its copy from pinned memory, which does not
    wait."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _aligned(addresses: Sequence[int]) -> bool:
    """Whether every address is a multiple of 16 bytes (an ``aligned`` launch's loads)."""
    return not gcd(*addresses) & 15


def _table_layout(
    sizes: tuple[int, ...], offsets: tuple[int, ...], block: int, max_parts: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """A :func:`_table` (column 0: the tensor of each program, whose address the kernel
    reads from an array of the tensors' addresses), the tensor of each program, and the
    scratch rows (cached: the last few; not to be written)."""
    key = (sizes, offsets, block, max_parts)
    got = _table_layouts.get(key)
    if got is not None:
        return got
    ns = np.array(sizes, dtype=np.int64)
    split = [_parts(k, max_parts, block) for k in sizes]
    parts = np.array([p for p, _ in split], dtype=np.int64)
    per = np.array([q for _, q in split], dtype=np.int64)
    owner = np.repeat(np.arange(len(sizes)), parts)
    first_of = np.cumsum(parts) - parts
    part = np.arange(owner.size) - first_of[owner]
    multi = parts > 1
    scratch_first = np.cumsum(np.where(multi, parts, 0)) - np.where(multi, parts, 0)
    table = np.zeros((owner.size, _TABLE), dtype=np.int64)
    table[:, 0] = owner
    table[:, 1] = part * per[owner]
    table[:, 2] = np.minimum(table[:, 1] + per[owner], ns[owner])
    table[:, 3] = np.asarray(offsets, dtype=np.int64)[owner]
    table[:, 4] = part
    table[:, 5] = parts[owner]
    table[:, 6] = scratch_first[owner]
    if len(_table_layouts) >= _TABLES_KEPT:
        _table_layouts.clear()
    got = _table_layouts[key] = (table, owner, int(parts[multi].sum()))
    return got


#: :func:`_table_layout`'s results by (sizes, offsets, tile, max programs).
_table_layouts: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray, int]] = {}


def finish_rows(rows: Any, spec: Spec, layout: Layout, xp: Any = np) -> Any:
    """The layout's summary vectors (``CORE_FIELDS``, exponent counts, custom statistics)
    from rows of ``spec``'s tensors, one per row of the 2-D array ``rows``.

    The kernel read non-finite values as zeros in the moments and the extrema; here they
    are taken out again: ``n`` values of mean ``mean`` and centred second moment ``m2``
    of which ``z`` are such zeros hold ``n - z`` finite values of mean
    ``mean * n / (n - z)`` and second moment ``m2 - mean_f**2 * (n - z) * z / n``
    (Chan's formula backwards); a 0 that is no value changes the min or max only when
    there are no zeros, where the min of positive values is ``min|x|`` (and the max of
    negative ones ``-min|x|``).

    Arguments:
        rows: float64 rows of :func:`row_size` values (numpy, or torch with ``xp=torch``).
        xp: the array module: ``numpy`` (host) or ``torch`` (on the rows' device).
    """
    col = [rows[:, i] for i in range(PART)]
    numel = col[N_READ]
    z = col[NAN] + col[INF]
    nfin = numel - z
    has = nfin > 0
    s = col[MAX_ABS]
    e = col[SCALE_EXP]
    # moments were summed of x / 2**E; the layout's are of x / max|x| (1 when 0); 2**E
    # in halves: it reaches 2**1024 for float64 tensors near their max
    h = 2.0 ** (e - 1)
    r = h / xp.where(s > 0, s, 1.0) * 2.0
    r2 = r * r
    mean_f = col[MEAN] * numel / xp.where(has, nfin, 1.0)
    m2 = col[M2] - mean_f * mean_f * nfin * z / xp.where(numel > 0, numel, 1.0)
    patched = (z > 0) & (col[ZERO] == 0)
    mn, mx, amin = col[MIN], col[MAX], col[MIN_ABS]
    inf = float("inf")
    core = {
        "numel": numel,
        "nan_count": col[NAN],
        "inf_count": col[INF],
        "zero_count": col[ZERO],
        "min": xp.where(has, xp.where(patched & (mn >= 0), amin, mn), inf),
        "max": xp.where(has, xp.where(patched & (mx <= 0), -amin, mx), -inf),
        "min_abs": xp.where(has, amin, inf),
        "max_abs": xp.where(has, s, 0.0),
        "mean": xp.where(has, mean_f * h * 2.0, 0.0),
        "m2": xp.where(m2 > 0, m2, 0.0) * r2,
        "p1": col[P1] * r,
        "p2": col[P2] * r2,
        "p4": col[P4] * r2 * r2,
        "p8": col[P8] * (r2 * r2) ** 2,
    }
    fold, above, runs, _, unwritten = _folding(spec, layout)
    hist = rows[:, HEADER : HEADER + spec.nbd]
    # the summaries are written into one array, column block by column block, rather than
    # packed from parts (their stack and concatenation were half of this function's time
    # on the writer thread, whose interpreter time a GPU step's host thread waits for)
    if xp is np:
        out = np.empty((hist.shape[0], layout.size))
    else:
        out = rows.new_empty((hist.shape[0], layout.size))
    for i, name in enumerate(CORE_FIELDS):
        out[:, i] = core[name]
    counts = out[:, layout.exponent_counts]
    if xp is np:
        # the fold as runs of adjacent dtype exponents (each format bin takes one run): the
        # same exact integer sums as ``hist @ fold`` without its multiply-adds over the
        # whole 0/1 matrix (a BLAS call that took most of a step's finishing), and the
        # one-exponent runs copied as slices (``np.add.reduceat`` over them cost the writer
        # thread about a millisecond per step of 300 rows)
        counts[:, unwritten] = 0.0
        for first, end, to, summed in runs:
            if summed:
                counts[:, to] = hist[:, first:end].sum(axis=1)
            else:
                counts[:, to : to + end - first] = hist[:, first:end]
        beyond = hist[:, above:].sum(axis=1)
    else:
        counts[...] = hist @ torch.from_numpy(fold).to(rows.device)
        beyond = hist[:, above:].sum(dim=1)
    # the kernel counted every finite value above the format's max; those whose exponent
    # is the format's top one (float8_e4m3fn: 448 < x < 512) sit in the top bin: move them
    move = col[OVER] - beyond
    top, over = layout.format.num_bins, layout.format.num_bins + 1
    counts[:, top] = counts[:, top] - move
    counts[:, over] = counts[:, over] + move + col[INF]
    extras = rows[:, spec.row_size : spec.row_size + len(layout.extras)]
    n_formats = len(_names_of(layout.extras))
    if n_formats:  # the block kernel kept each format's largest max/min ratio: its log2
        extras = extras.clone() if xp is torch else extras.copy()
        at = [len(BLOCK_COLUMNS) * i + len(BLOCK_COLUMNS) - 1 for i in range(n_formats)]
        ratio = extras[:, at]
        extras[:, at] = xp.log2(xp.where(ratio > 1.0, ratio, 1.0))
    out[:, layout.extra_values] = extras
    if not layout.num_higher:
        return out
    # m3, m4 likewise: the z zeros taken out by Pebay's update backwards (the finite part
    # a and the zeros b merged gave the kernel's sums; delta = 0 - mean_f)
    hoff = _hoff(spec, layout)
    a2 = xp.where(m2 > 0, m2, 0.0)
    dn = -mean_f / xp.where(numel > 0, numel, 1.0)
    na_nb = nfin * z
    m3 = rows[:, hoff] + dn * (3.0 * z * a2 - dn * dn * numel * na_nb * (nfin - z))
    m4 = (
        rows[:, hoff + 1]
        - dn * dn * dn * dn * numel * na_nb * (nfin * nfin - na_nb + z * z)
        - 6.0 * dn * dn * z * z * a2
        + 4.0 * dn * z * m3
    )
    out[:, layout.higher_start] = xp.where(has, m3, 0.0) * (r2 * r)
    out[:, layout.higher_start + 1] = xp.where(has, m4, 0.0) * (r2 * r2)
    return out


#: :func:`_folding`'s answers by (id(spec), id(layout)), with the two (kept alive by it)
_foldings: dict[tuple[int, int], tuple[Spec, Layout, Any]] = {}


#: What :func:`_folding` gives: the fold matrix, the first dtype exponent above the
#: format, the runs (:func:`_fold_runs`), the same runs as an int64 array of rows (what
#: compiled code reads), and the format's count bins no run writes.
_Folding = tuple[np.ndarray, int, tuple[tuple[int, int, int, bool], ...], np.ndarray, np.ndarray]


def _folding(spec: Spec, layout: Layout) -> _Folding:
    """:func:`_fold` and :func:`_fold_runs` of ``spec`` and ``layout``'s format, the runs
    as an array, and the format's count bins no run writes (zero in every row), found by
    the identities of the two: finishing a step's rows asks once per row kind, and hashing
    a Spec (a torch dtype among its fields) costs about ten microseconds on the writer
    thread."""
    got = _foldings.get((id(spec), id(layout)))
    if got is None or got[0] is not spec or got[1] is not layout:
        fold, above = _fold(spec, layout.format.name)
        runs = _fold_runs(spec, layout.format.name)
        table = np.array(runs, dtype=np.int64).reshape(-1, 4)
        written = np.zeros(fold.shape[1], bool)
        for first, end, to, summed in runs:
            written[to : to + (1 if summed else end - first)] = True
        unwritten = np.flatnonzero(~written)
        got = _foldings[(id(spec), id(layout))] = (
            spec,
            layout,
            (fold, above, runs, table, unwritten),
        )
    folding: _Folding = got[2]
    return folding


@cache
def _fold_runs(spec: Spec, fmt_name: str) -> tuple[tuple[int, int, int, bool], ...]:
    """:func:`_fold` as slices of a row's dtype exponents: ``(first, end, bin, summed)``
    each, either a run of several exponents summed into one format bin (``summed``), or
    consecutive exponents that each land in a bin of their own, copied to the bins from
    ``bin`` on (the bins of successive exponents never decrease)."""
    fold, _ = _fold(spec, fmt_name)
    bins = fold.argmax(axis=1)
    starts = np.flatnonzero(np.r_[True, bins[1:] != bins[:-1]])
    ends = np.r_[starts[1:], len(bins)]
    runs: list[tuple[int, int, int, bool]] = []
    for first, end, to in zip(starts.tolist(), ends.tolist(), bins[starts].tolist()):
        if end - first > 1:
            runs.append((first, end, to, True))
        elif (
            runs
            and not runs[-1][3]
            and runs[-1][1] == first
            and runs[-1][2] + first - runs[-1][0] == to
        ):
            runs[-1] = (runs[-1][0], end, runs[-1][2], False)  # the copy goes on
        else:
            runs.append((first, end, to, False))
    return tuple(runs)


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
