"""``summarize_torch``: the summary vector of a tensor, computed where the tensor lies.

The result equals :func:`tandv.stats.summarize` (the numpy reference) applied to the
same values: counts, extrema and exponent counts exactly, moments to ~1e-6 relative.

Three paths
-----------
- The *fused path* (CUDA tensors of float32, float16, bfloat16 and 8-bit formats):
  one Triton kernel reads the tensor once in its own dtype (:mod:`._fused`); the tracker
  batches a step's parameters, gradients and optimizer state into one launch per dtype.
- The *host path* (CPU tensors of at most float32 precision) hands the tensor's memory to
  the compiled one-pass kernel :func:`tandv.stats.host.host_summaries`: on the CPU there
  is no device to wait for.
- The *torch-op path* (everything else: float64, tensor subclasses such as ``DTensor``,
  devices other than CUDA, CUDA without Triton) builds the summary from a dozen torch
  operations, in scratch buffers as large as the largest such tensor. It never waits for
  the device (no ``.item()``, ``.cpu()`` or ``bool(tensor)``): every choice it makes is
  branch-free arithmetic on device tensors. The rest of this note describes it.

All paths give the same results; the tests run each on the same inputs (the fused kernel
in Triton's interpreter on the CPU), sending CPU tensors down the path they check with the
test hook :func:`cpu_path`.

Exponent counts in one scatter
------------------------------
The magnitudes are copied to float64 once. Every float32, bfloat16, float16 and float8
value is a *normal* float64 (its subnormals included), so the float64 exponent field
``bits >> 52`` is exactly ``floor(log2|x|) + 1023``. We keep one more bit, ``bits >> 51``:
the top mantissa bit separates ``inf`` (mantissa 0) from NaN (conversion to float64
always yields a quiet NaN, top mantissa bit 1). One ``scatter_add_`` of these keys into
a fixed 4096-entry table (no data-dependent size, so no sync, unlike ``bincount``) gives
the zero, NaN, inf and per-exponent counts at once; a cached index folds the table into
the layout's bins. Two cases need more: float64 inputs (their subnormals and signalling
NaNs do not fit the trick; ``torch.frexp`` and ``isnan`` handle them) and a simulated
format whose max is not the top of its binade (``float8_e4m3fn``: 448 < 512), where one
comparison counts the values above the max.

Moments
-------
Elementwise passes run in float32 in reusable scratch buffers, non-finite values
replaced by 0 (neutral for the power sums). Values are scaled by a power of two
``2**e >= max|x|`` (exact) so that no power overflows, squared repeatedly for the 2nd,
4th and 8th powers, and summed with float32 cascade sums (the plain sum for the mean in
float64). The second moment is centred on the mean. The device produces a *raw* head
(:func:`raw_device`) that :func:`finish_head` turns into the layout's fields;
the tracker finishes all of a step's heads on the host after its single transfer.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from contextlib import nullcontext
from types import TracebackType
from typing import Any, Literal

import ml_dtypes
import numpy as np
import torch

from ...stats.blocks import BLOCK_COLUMNS, block_formats_of
from ...stats.formats import NumberFormat
from ...stats.host import host_higher_moments, host_summaries
from ...stats.summary import Layout, append_extras, pack_fields, unpack_fields
from ._blocks import block_columns

__all__ = [
    "summarize_torch",
    "higher_moments_torch",
    "raw_device",
    "host_vectors",
    "fused_spec",
    "cpu_path",
    "current_cpu_path",
    "finish_head",
    "finish_raw",
    "RAW_FIELDS",
    "RAW_HEAD",
    "dtype_name",
    "custom_names",
]

_F64_BIAS = 1023
_NUM_KEYS = 4096  # (biased float64 exponent, top mantissa bit)
_INF_KEY = 2047 * 2  # exponent field all ones, top mantissa bit 0: +-inf
_NAN_KEY = 2047 * 2 + 1  # quiet NaN
#: Rows of the scatter table: the key tensor is split into this many rows so that
#: scatter_add_ runs in parallel on CPU (one row per thread), then the rows are summed.
_SCATTER_ROWS = 4

_fold_cache: dict[tuple[str, str], torch.Tensor] = {}
_workspace = threading.local()


def dtype_name(dtype: torch.dtype) -> str:
    """The log's name of a torch floating dtype: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _fold_index(fmt: NumberFormat, device: torch.device) -> torch.Tensor:
    """Index mapping each of the 4096 keys to a layout count bin (``num_bins + 2`` is a
    discard bin for zeros and NaN)."""
    ck = (fmt.name, str(device))
    idx = _fold_cache.get(ck)
    if idx is None:
        nb = fmt.num_bins
        discard = nb + 2
        biased = torch.arange(_NUM_KEYS) // 2
        exp = biased - _F64_BIAS
        idx = torch.where(exp < fmt.min_exponent, 0, exp - fmt.min_exponent + 1)
        idx = idx.clamp(max=nb + 1)  # above max_exponent: overflow
        idx[0:2] = discard  # biased exponent 0: zeros (no float64 subnormals arise here)
        idx[_INF_KEY] = nb + 1
        idx[_NAN_KEY] = discard
        idx = idx.to(device)
        _fold_cache[ck] = idx
    return idx


class _Scratch:
    """Reusable buffers and views for summarizing vectors of one length on one device.

    Allocating fresh multi-megabyte buffers for every tensor costs more than the
    arithmetic (page faults), and building the same views again costs Python time, so
    each thread keeps, per device, one growing float64 workspace and, per vector length
    and compute dtype, the views into it. Reuse is safe: on CPU every op has finished
    when it returns, and on an accelerator one thread's kernels run in stream order."""

    def __init__(self, base: torch.Tensor, ones: torch.Tensor, n: int, dtype: torch.dtype) -> None:
        if dtype == torch.float64:
            self.A, self.B = base[0, :n], base[1, :n]
            self.A_bits = self.A.view(torch.int64)
        else:
            f32 = base[0].view(torch.float32)
            self.A, self.B = f32[:n], f32[n : 2 * n]
            self.A_bits = self.A.view(torch.int32)
        self.K = base[2, :n]
        self.K_bits = self.K.view(torch.int64)
        rows = _SCATTER_ROWS if n % _SCATTER_ROWS == 0 and n >= 1 << 14 else 1
        # float32 inputs leave row 1 free (A and B share row 0): the keys go there
        self.keys_flat = base[1, :n].view(torch.int64)
        self.keys = self.keys_flat.view(rows, -1)
        self.ones = ones[:n].view(rows, -1)
        self.rows = rows
        self.one = torch.ones((), dtype=dtype, device=base.device)
        self.zero32 = torch.zeros((), dtype=torch.float32, device=base.device)
        self.numel = torch.full((1,), float(n), dtype=torch.float64, device=base.device)
        self.special_keys = torch.tensor([_NAN_KEY, _INF_KEY, 0], device=base.device)


def _scratch(n: int, device: torch.device, dtype: torch.dtype) -> _Scratch:
    """The thread's :class:`_Scratch` for ``n`` elements of ``dtype`` on ``device``."""
    spaces = getattr(_workspace, "spaces", None)
    if spaces is None:
        spaces = _workspace.spaces = {}
    key = str(device)
    space: tuple[torch.Tensor, torch.Tensor, dict[tuple[int, torch.dtype], _Scratch]] | None
    space = spaces.get(key)
    if space is None or space[0].shape[1] < n:
        size = max(n, 1 << 12)
        space = (
            torch.empty(3, size, dtype=torch.float64, device=device),
            torch.ones(size, dtype=torch.int64, device=device),
            {},
        )
        spaces[key] = space
    views = space[2].get((n, dtype))
    if views is None:
        views = space[2][(n, dtype)] = _Scratch(space[0], space[1], n, dtype)
    return views


def _key_counts(w: _Scratch) -> torch.Tensor:
    """Counts of the 4096 (exponent, top mantissa bit) keys of the float64 magnitudes in
    ``w.K`` (float32 inputs only: the keys are written to row 1 of the workspace)."""
    torch.bitwise_right_shift(w.K_bits, 51, out=w.keys_flat)
    table = torch.zeros(w.rows, _NUM_KEYS, dtype=torch.int64, device=w.K.device)
    table.scatter_add_(1, w.keys, w.ones)
    return table.sum(0) if w.rows > 1 else table[0]


def _exponent_counts_f64(ad: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """Layout count bins of float64 magnitudes that may hold float64 subnormals or
    signalling NaNs (float64 inputs): exact via ``torch.frexp``."""
    nb = fmt.num_bins
    nan = torch.isnan(ad)
    over = ad > fmt.max  # includes inf
    exp = torch.frexp(ad).exponent.to(torch.int64) - 1
    idx = torch.where(exp < fmt.min_exponent, 0, exp - fmt.min_exponent + 1).clamp_(max=nb + 1)
    idx = torch.where(over, nb + 1, idx)
    idx = torch.where(nan | (ad == 0), nb + 2, idx)
    out = torch.zeros(nb + 3, dtype=torch.int64, device=ad.device)
    out.scatter_add_(0, idx, torch.ones_like(idx))
    return out


#: The fields of the raw head of a torch-op path vector (see :func:`raw_device`), in the
#: order :func:`_raw_core` writes them: the element count, the NaN, inf and zero counts,
#: the extrema with non-finite values read as 0, the largest finite magnitude ``s``, the
#: power sums of ``|x| / 2**e``, the sum of squared deviations from ``m_c`` (the mean as
#: rounded to the compute dtype) with ``m_c`` and its square, the scale exponents ``e``
#: (``s < 2**e``) and ``e1``, and the sum of ``x / 2**e1``. :func:`finish_head` reads them
#: by name.
RAW_FIELDS: tuple[str, ...] = (
    "numel",
    "nan_count",
    "inf_count",
    "zero_count",
    "min_patched",
    "max_patched",
    "min_abs",
    "s",
    "p1",
    "p2",
    "p4",
    "p8",
    "m2raw",
    "m_c",
    "m_c2",
    "e",
    "e1",
    "sum_q",
)
#: Length of the raw head of a torch-op path vector.
RAW_HEAD = len(RAW_FIELDS)


def summarize_torch(
    x: torch.Tensor,
    layout: Layout,
    extras: Mapping[str, torch.Tensor | float] | None = None,
) -> torch.Tensor:
    """The float64 summary vector of ``x`` in ``layout``, on ``x``'s device (never waits
    for the device).

    Arguments:
        x: a floating-point tensor of any shape, dtype and device (not modified).
        layout: the summary layout; ``layout.format`` decides the exponent bins and what
            counts as underflow/overflow, ``layout.extras`` the custom statistics.
        extras: the custom statistics' values for ``x``, one per ``layout.extras`` name
            (0-dim tensors or numbers), in any order.

    Returns:
        A 1-D float64 tensor of ``layout.size`` elements on ``x.device``.

    Raises:
        TypeError: if ``x`` is not a floating-point tensor.
        ValueError: if ``extras`` does not match ``layout.extras``.

    With ``layout.moments == 4`` the skewness and kurtosis sums ``m3``, ``m4`` follow: from
    the fused kernel in the same pass, on the host path from the compiled kernel's second
    pass (:func:`tandv.stats.host.host_higher_moments`), elsewhere from torch operations on
    the device (:func:`higher_moments_torch`), after the core summary of that path.
    """
    _check_tensor(x)
    names = _extra_names(layout, extras)
    spec = fused_spec(x, layout)
    if spec is not None:
        from . import _fused

        rows = torch.zeros(_fused.row_size(spec, layout), dtype=torch.float64, device=x.device)
        max_parts = fused_programs(x.device)
        if x.numel():
            scratch = torch.empty(
                max(1, _fused.scratch_rows(x.numel(), max_parts)) * _fused.PART,
                dtype=torch.float64,
                device=x.device,
            )
            with torch.cuda.device(x.device) if x.device.type == "cuda" else nullcontext():
                _fused.launch_one(x.detach(), spec, layout, rows, 0, scratch, max_parts)
        if names:
            at = _fused.block_columns_at(spec, layout)
            rows[at : at + len(names)] = extras_vector(extras or {}, names, x.device)
        return _fused.finish_rows(rows[None], spec, layout, torch)[0]
    if layout.num_higher:
        base = Layout(layout.format, layout.extras)
        host = host_vectors([x], layout, [extras or {}])[0]
        if host is not None:
            return torch.from_numpy(host)
        return torch.cat([summarize_torch(x, base, extras), higher_moments_torch(x)])
    host = host_vectors([x], layout, [extras or {}])[0]
    if host is not None:
        return torch.from_numpy(host)
    return finish_raw(raw_device(x, layout, extras), torch)


def higher_moments_torch(x: torch.Tensor) -> torch.Tensor:
    """``[m3, m4]``: the third and fourth centred sums of ``x``'s finite elements, scaled
    by their largest magnitude like ``m2`` (:data:`tandv.stats.summary.HIGHER_FIELDS`), in
    float64 on ``x``'s device, without waiting for the device (a few more passes over
    ``x``: only for ``Layout(moments=4)``). The deviations are taken from the float64 mean
    and its rounding is taken out exactly (``sum((d - e)**3) = S3 - 3 e S2 + 2 n e**3``,
    ``e`` the deviations' own mean), so the sums are about the exact mean and match any
    path's core summary (the largest magnitude is exact on every path)."""
    v = x.detach().reshape(-1).to(torch.float64)
    fin = torch.isfinite(v)
    vf = torch.where(fin, v, torch.zeros_like(v))
    n = fin.sum().to(torch.float64)
    pivot = vf.sum() / torch.clamp(n, min=1.0)
    s = vf.abs().amax() if v.numel() else torch.zeros((), dtype=torch.float64, device=v.device)
    s = torch.where(s > 0, s, torch.ones_like(s))
    d = torch.where(fin, (v - pivot) / s, torch.zeros_like(v))
    d2 = d * d
    s1, s2, s3, s4 = d.sum(), d2.sum(), (d2 * d).sum(), (d2 * d2).sum()
    e = s1 / torch.clamp(n, min=1.0)
    m3 = s3 - 3.0 * e * s2 + 2.0 * n * e**3
    m4 = s4 - 4.0 * e * s3 + 6.0 * e * e * s2 - 3.0 * n * e**4
    return torch.stack([m3, m4])


def _check_tensor(x: Any) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        what = type(x).__name__ if not isinstance(x, torch.Tensor) else f"tensor of {x.dtype}"
        raise TypeError(f"summarize_torch: expected a floating-point tensor; got {what}")


def extras_vector(
    extras: Mapping[str, Any], names: list[str], device: torch.device
) -> torch.Tensor:
    """The custom statistics as one float64 vector on ``device``, in ``names`` order."""
    return torch.stack(
        [
            extras[k].detach().to(device=device, dtype=torch.float64).reshape(())
            if isinstance(extras[k], torch.Tensor)
            else torch.full((), float(extras[k]), dtype=torch.float64, device=device)
            for k in names
        ]
    )


def _n_block_columns(layout: Layout) -> int:
    """How many of the layout's extras are block formats' columns (they lead the rest)."""
    return len(BLOCK_COLUMNS) * len(block_formats_of(layout.extras))


def custom_names(layout: Layout) -> list[str]:
    """The layout's custom statistic names that callers give (those after the block
    formats' columns, which the kernels compute)."""
    return [name for name, _ in layout.extras[_n_block_columns(layout) :]]


def _extra_names(layout: Layout, extras: Mapping[str, Any] | None) -> list[str]:
    """The layout's custom statistic names (after the block formats' columns, which the
    kernels compute), after checking that ``extras`` gives each."""
    names = custom_names(layout)
    if sorted(extras or {}) != sorted(names):
        raise ValueError(
            f"summarize_torch: extras {sorted(extras or {})} do not match the "
            f"layout's custom statistics {names}"
        )
    return names


def raw_device(
    x: torch.Tensor,
    layout: Layout,
    extras: Mapping[str, torch.Tensor | float] | None = None,
) -> torch.Tensor:
    """The torch-op path's *raw* vector of ``x``, on ``x``'s device: its first
    :data:`RAW_HEAD` entries are partial results that :func:`finish_head` turns into the
    layout's core fields (a tracker finishes a whole step's heads at once on the host);
    the exponent counts, custom statistics and (``layout.moments == 4``) ``m3``, ``m4``
    that follow are final."""
    _check_tensor(x)
    names = _extra_names(layout, extras)
    dev = x.device
    f64 = torch.float64
    if x.numel() == 0:
        head = torch.zeros(RAW_HEAD, dtype=f64, device=dev)
        counts = torch.zeros(layout.num_counts, dtype=f64, device=dev)
    else:
        head, counts = _raw_core(x.detach().reshape(-1), layout.format)
    parts = [head, counts.to(f64)]
    formats = block_formats_of(layout.extras)
    if formats:
        parts.append(block_columns(x, formats))
    if names:
        parts.append(extras_vector(extras or {}, names, dev))
    if layout.num_higher:
        parts.append(higher_moments_torch(x))
    return torch.cat(parts)


def _raw_core(x: torch.Tensor, fmt: NumberFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw head and layout counts of a non-empty 1-D floating vector.

    Elementwise passes run in float32 (float64 for float64 inputs) in reusable scratch
    buffers; sums are float32 cascade sums (relative error ~1e-7) except the plain sum
    for the mean, which accumulates in float64."""
    dev = x.device
    n = x.numel()
    f32, f64 = torch.float32, torch.float64
    native64 = x.dtype == f64
    cd = f64 if native64 else f32
    w = _scratch(n, dev, cd)
    A, B, K = w.A, w.B, w.K
    if x.dtype == cd:
        src = x
    else:
        B.copy_(x)
        src = B
    torch.abs(src, out=A)
    # Smallest finite magnitude: the int view orders non-negative floats by magnitude
    # with inf and NaN above every finite value, so amin needs no masking.
    min_abs = w.A_bits.amin().reshape(1).view(cd)
    if native64:
        bins = _exponent_counts_f64(A, fmt)
        counts = bins[: fmt.num_bins + 2]
        special = torch.stack([torch.isnan(A).sum(), torch.isinf(A).sum(), (A == 0).sum()])
        low_e = -1022
    else:
        K.copy_(A)
        keys = _key_counts(w)
        counts = torch.zeros(fmt.num_bins + 3, dtype=torch.int64, device=dev)
        counts.index_add_(0, _fold_index(fmt, dev), keys)
        counts = counts[: fmt.num_bins + 2]
        if fmt.name != dtype_name(x.dtype) and fmt.max < 2.0 ** (fmt.max_exponent + 1):
            # Simulated format whose max lies inside its top binade (float8_e4m3fn: 448 <
            # 512): values above the max were counted in the top exponent; move them.
            over = (A > fmt.max).sum()
            counts[-2] -= over - counts[-1]
            counts[-1] = over
        special = keys.index_select(0, w.special_keys)  # NaN, inf and zero counts
        low_e = -126
    torch.nan_to_num(src, 0.0, 0.0, 0.0, out=B)
    mn, mx = torch.aminmax(B)
    s = torch.maximum(-mn, mx)
    # Scale by powers of two (exact): q = x / 2**e1 with 2**-e1 finite in the compute
    # dtype, and magnitudes further to |x| / 2**e <= 1, where s < 2**e. e1 == e unless
    # every finite value is subnormal.
    e = torch.frexp(s).exponent
    e1 = e.clamp(min=low_e)
    one = w.one
    q = B.mul_(torch.ldexp(one, -e1))
    torch.abs(q, out=A).mul_(torch.ldexp(one, e1 - e))
    # float64 sum of q via the persistent float64 row K (free once the keys are counted):
    # sum(dtype=float64) would allocate a fresh float64 copy per call, whose page faults
    # cost more than the arithmetic.
    sum_q = q.sum() if native64 else K.copy_(q).sum()
    p1 = A.sum()
    p2 = A.square_().sum()
    p4 = A.square_().sum()
    p8 = A.square_().sum()
    # Centre on the mean rounded to the compute dtype (finish_head corrects for it).
    m_c = (sum_q / (n - special[:2].sum()).clamp(min=1)).to(cd)
    m2raw = q.sub_(m_c).square_().sum()
    head = torch.cat(
        [  # one promoting concatenation to float64, in RAW_FIELDS order
            w.numel,  # numel
            special,  # nan_count, inf_count, zero_count
            torch.stack([mn, mx, min_abs[0], s, p1, p2, p4, p8, m2raw, m_c, m_c * m_c]),
            torch.stack([e, e1]),
            sum_q.reshape(1),
        ]
    )
    return head, counts


#: The paths a CPU tensor may take (see :func:`cpu_path`).
CpuPath = Literal["host", "ops", "fused"]
_CPU_PATHS: tuple[CpuPath, ...] = ("host", "ops", "fused")
#: The path CPU tensors take now: only :func:`cpu_path` changes it.
_cpu_path: CpuPath = "host"


class _RestoreCpuPath:
    """What :func:`cpu_path` returns: as a context manager, it puts the path before back
    at the end of its ``with`` block."""

    def __init__(self, previous: CpuPath) -> None:
        self._previous = previous

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        global _cpu_path
        _cpu_path = self._previous


def cpu_path(path: CpuPath) -> _RestoreCpuPath:
    """Test hook: the path CPU tensors take, so that a machine without a GPU runs the
    paths of accelerator tensors on the same inputs as the host kernel (for tests and
    benchmarks; the tracker's results do not depend on it).

    ``"host"`` (the default): the host kernel, for the dtypes it reads (float64 and tensor
    subclasses take the torch-op path); ``"ops"``: the torch-op path, that of CUDA tensors
    without Triton; ``"fused"``: the fused Triton kernel of CUDA tensors, run by Triton's
    interpreter (``TRITON_INTERPRET=1`` must be set before tandv's kernels are imported).

    It takes effect at the call, for every tracker of the process; used in a ``with``
    statement, the path before comes back at the block's end::

        with summary.cpu_path("fused"):
            ...  # CPU tensors take the fused kernel here

    Raises:
        ValueError: if ``path`` is not one of ``"host"``, ``"ops"``, ``"fused"``.
    """
    global _cpu_path
    if path not in _CPU_PATHS:
        raise ValueError(f"cpu_path({path!r}): expected one of {', '.join(map(repr, _CPU_PATHS))}")
    previous, _cpu_path = _cpu_path, path
    return _RestoreCpuPath(previous)


def current_cpu_path() -> CpuPath:
    """The path CPU tensors take now (see :func:`cpu_path`)."""
    return _cpu_path


_NUMPY_DTYPES = frozenset({torch.float32, torch.float16})  # .numpy() gives these as they are
_BIT_DTYPES = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16)}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _BIT_DTYPES[getattr(torch, _name)] = (torch.uint8, getattr(ml_dtypes, _name))


def _host_array(x: torch.Tensor) -> np.ndarray | None:
    """A flat numpy array sharing the memory of CPU tensor ``x`` (a copy only when ``x`` is
    not contiguous), in an ml_dtypes type for bfloat16 and float8; ``None`` for a dtype the
    host kernel does not read (float64), a tensor not on the CPU, or a tensor subclass
    (``DTensor`` and the like hold only a shard: their own operations give the global
    statistics)."""
    if (
        _cpu_path != "host"
        or x.device.type != "cpu"
        or type(x) not in (torch.Tensor, torch.nn.Parameter)
    ):
        return None
    flat = x.detach().reshape(-1).resolve_neg()
    if x.dtype in _NUMPY_DTYPES:
        return flat.numpy()
    bits = _BIT_DTYPES.get(x.dtype)
    return None if bits is None else flat.view(bits[0]).numpy().view(bits[1])


def host_vectors(
    tensors: list[torch.Tensor],
    layout: Layout,
    extras: list[Mapping[str, torch.Tensor | float]],
) -> list[np.ndarray | None]:
    """Finished summary vectors of the tensors the host path takes (``None`` for the
    others): all in one call of :func:`tandv.stats.host.host_summaries`, which summarizes
    the small ones (biases, norm scales and their gradients and state) together."""
    out: list[np.ndarray | None] = [None] * len(tensors)
    host = []
    for i, t in enumerate(tensors):
        arr = _host_array(t)
        if arr is not None:
            host.append((i, arr.reshape(t.shape)))  # blocks run along the last dimension
    if host:
        names = _extra_names(layout, extras[host[0][0]])
        threads = torch.get_num_threads()
        vectors = host_summaries([a for _, a in host], layout, threads)
        higher = host_higher_moments([a for _, a in host], vectors) if layout.num_higher else None
        if torch.get_num_threads() != threads:  # numba's OpenMP layer, starting, resets it
            torch.set_num_threads(threads)
        for j, ((i, _), v) in enumerate(zip(host, vectors)):
            out[i] = append_extras(v, [float(extras[i][k]) for k in names], np) if names else v
            if higher is not None:
                out[i] = append_extras(out[i], higher[j], np)
    return out


_fused_state: dict[str, Any] = {}


def fused_programs(device: torch.device) -> int:
    """The most programs the fused kernel splits one tensor among on ``device``: two per SM
    on a GPU. (On an H200 with Triton 3.6, four per SM split a 1M-4M element float32 tensor
    into programs of one tile, more than one wave, and read it 1.2-1.5x slower: 22.1 vs
    15.0 us at 1M; at 268M elements four per SM read 1.023 TB/s against 0.947, see
    docs/cost-torch.md.) 16 on the CPU, where Triton's interpreter runs one program at a
    time."""
    if device.type != "cuda":
        return 16
    return min(2 * torch.cuda.get_device_properties(device).multi_processor_count, 1024)


def fused_spec(x: torch.Tensor, layout: Layout | None = None) -> Any:
    """The fused kernel's :class:`~._fused.Spec` for ``x`` if ``x`` takes the fused path,
    else ``None``. Without Triton, CUDA tensors take the torch-op path, with one warning.
    So do float64 tensors whose ``layout`` asks for block formats: the block kernel
    (:func:`._fused.launch_blocks`) computes in float32, exact for the values of narrower
    dtypes only (:mod:`._blocks` serves them). (The fused kernel computes ``m3``, ``m4``
    for ``moments=4`` in its pass.)"""
    if x.dtype == torch.float64 and layout is not None and _n_block_columns(layout):
        return None
    if type(x) not in (torch.Tensor, torch.nn.Parameter):
        return None  # tensor subclasses: DTensor and the like hold a shard
    kind = x.device.type
    if kind != "cuda" and not (kind == "cpu" and _cpu_path == "fused"):
        return None
    fused: Any = _fused_state.get("module")
    if fused is None:
        if "module" in _fused_state:  # Triton failed to import: warned already
            return None
        try:
            from . import _fused
        except ImportError as e:
            _fused_state["module"] = None
            warnings.warn(
                f"tandv: Triton could not be imported ({e}); CUDA tensors are summarized "
                f"by the slower torch-op path. `pip install triton` to get the fused "
                f"kernel.",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        fused = _fused
        if kind == "cpu" and not fused.INTERPRETED:
            raise RuntimeError(
                "cpu_path('fused') needs Triton's interpreter: set TRITON_INTERPRET=1 "
                "before tandv's fused kernels are imported"
            )
        _fused_state["module"] = fused
    return fused.spec_for(x.dtype)


def finish_head(raw: Any, xp: Any = np) -> Any:
    """The layout's core fields (``CORE_FIELDS``) from raw heads.

    Arguments:
        raw: one raw head (:data:`RAW_FIELDS`) or a 2-D array of them, one per row.
        xp: the array module, ``numpy`` (host) or ``torch`` (device, no sync).
    """
    r = unpack_fields(raw, RAW_FIELDS)
    n, nan_c, inf_c, zero_c = r["numel"], r["nan_count"], r["inf_count"], r["zero_count"]
    min_abs, s, m_c = r["min_abs"], r["s"], r["m_c"]
    nonfin = nan_c + inf_c
    nfin = n - nonfin
    has_fin = nfin > 0
    mean_q = r["sum_q"] / xp.where(has_fin, nfin, 1.0)
    # sum over finite of (q - mean)^2 = sum over all slots of (q - m_c)^2, less the
    # non-finite slots (which held 0 and added m_c**2 as rounded on the device, m_c2),
    # less the offset of m_c from the mean. With non-finite values present the result
    # carries the rounding of that larger sum: relative error ~1e-7 * nonfin * m_c**2 / m2.
    m2raw = r["m2raw"]
    m2 = xp.maximum(m2raw - nonfin * r["m_c2"] - nfin * (mean_q - m_c) ** 2, 0.0 * m2raw)
    # powers of two taken in halves: 2**e reaches 2**1024 for float64 inputs near their max
    h1, h = 2.0 ** (r["e1"] - 1), 2.0 ** (r["e"] - 1)
    scale = xp.where(s > 0, s, 1.0)
    r1, q = h1 / scale * 2.0, h / scale * 2.0
    inf = float("inf")
    # min/max were taken with non-finite values replaced by 0: exact unless non-finite
    # values exist and the finite ones are all > 0 (the min is then min_abs) or all < 0
    # (the max is then -min_abs), or none is finite.
    mn, mx = r["min_patched"], r["max_patched"]
    patched = (nonfin > 0) & (zero_c == 0)
    core = {
        "numel": n,
        "nan_count": nan_c,
        "inf_count": inf_c,
        "zero_count": zero_c,
        "min": xp.where(has_fin, xp.where(patched & (mn >= 0), min_abs, mn), inf),
        "max": xp.where(has_fin, xp.where(patched & (mx <= 0), -min_abs, mx), -inf),
        "min_abs": xp.where(has_fin, min_abs, inf),
        "max_abs": s,
        "mean": xp.where(has_fin, mean_q * h1 * 2.0, 0.0),
        "m2": m2 * r1 * r1,
        "p1": r["p1"] * q,
        "p2": r["p2"] * q**2,
        "p4": r["p4"] * q**4,
        "p8": r["p8"] * q**8,
    }
    return pack_fields(core, xp=xp)


def finish_raw(raw: Any, xp: Any = np) -> Any:
    """Finished summary vectors from raw vectors of :func:`raw_device` (one, or a 2-D array
    of them, one per row): the raw head finished by :func:`finish_head`, the exponent
    counts and custom statistics after it as they are."""
    head, tail = finish_head(raw[..., :RAW_HEAD], xp), raw[..., RAW_HEAD:]
    return np.concatenate([head, tail], -1) if xp is np else torch.cat([head, tail], -1)
