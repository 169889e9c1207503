"""Summaries on XLA:CPU by the compiled host kernel, called from inside the XLA program.

On the CPU, XLA's own summary program (:func:`._summary.summarize_jax`: a dozen fused
passes, a scatter for the exponent counts) costs more than twice what the numba kernel of
:mod:`tandv.stats.host` costs, which reads each value once (figures in
``track/jax/DESIGN.md``). This module makes that
kernel an XLA custom call, so a tap summarizes a module output where it is computed, inside
the jitted update, with no host callback, no Python and no copy.

The custom call uses XLA's typed FFI (``jax.ffi.ffi_call``). Its handler is a C function
compiled by numba (``numba.cfunc``) that reads XLA's call frame, a C struct of the FFI's
stable ABI (``xla/ffi/api/c_api.h``), through raw pointers:

- ``XLA_FFI_CallFrame`` (8-byte words): 1 ``extension_start``, 2 ``api``, 4 ``stage``
  (int32), 9 the argument pointers, 14 the result pointers;
- ``XLA_FFI_Buffer`` (words): 3 ``data``, 4 ``rank``, 5 ``dims``;
- when XLA registers the handler it calls it once with a metadata extension
  (``extension_start`` of type 1), whose ``XLA_FFI_Metadata`` receives the API version the
  handler was built for: we answer with the version of the ``XLA_FFI_Api`` that calls us.

Arguments: the array as float32 (narrower floats are widened first, exactly), the layout's
two bin tables (int32) and ``(num_bins, over_at)`` as float32. Results: the summary as
:class:`._summary.DeviceSummary` parts, int32 counts and float32 values, the types of the
XLA path, so either path can serve any tap; optionally a third, the kernel's float64 core
values as uint32 words (their bits), so that step-time rows keep float64 moments
(:func:`ffi_summary_exact`). With block formats, a fifth argument and two more results,
served by a second handler (:data:`BLOCKS_TARGET`) built only for runs that ask for them.
"""

from __future__ import annotations

import ctypes
import math
import platform
import threading
import warnings
from collections.abc import Callable
from functools import cache
from typing import Any, cast

import jax
import jax.numpy as jnp
import numba
import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic

from ...stats.blocks import BlockFormat
from ...stats.formats import NumberFormat
from ...stats.host import (
    blocks_serial,
    frozen,
    higher_serial,
    serial_block_table,
    serial_tables,
    split_serial,
    summary_serial,
)
from ...stats.summary import FIELD_INDEX, N_CORE_VALUES, N_LEADING_COUNTS
from ._blocks import INT_WORDS, check_blockable
from ._summary import DeviceSummary, check_countable

__all__ = [
    "available",
    "ffi_summary",
    "ffi_summary_exact",
    "ffi_summary_blocks",
    "exact_values",
    "TARGET",
    "BLOCKS_TARGET",
    "SUPPORTED",
]

#: The custom-call target's name.
TARGET = "tandv_summary_f32"
#: The target of the summary with the block formats' words (a handler of its own: its
#: compile, and its self-test's reference, take about two thirds of a cold build, which a
#: run without block formats never pays).
BLOCKS_TARGET = "tandv_summary_f32_blocks"
_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
_METADATA = 1  # XLA_FFI_Extension_Metadata
# Bytes of the structs as this module reads them: XLA_FFI_CallFrame through its results
# list (jaxlib 0.10 reports 168: its attributes follow), XLA_FFI_Args / XLA_FFI_Rets,
# XLA_FFI_Buffer.
_FRAME_SIZE = 120
_LIST_SIZE = 40
_BUFFER_SIZE = 48
_NLEAD = N_LEADING_COUNTS
_NVALUES = N_CORE_VALUES
_MAXABS = FIELD_INDEX["max_abs"]  # in the host kernel's summary vector
_INT_WORDS = INT_WORDS
_TABLE_WIDTH = 8  # columns of serial_block_table's rows


#: A raw C pointer as compiled code holds it (numba's ``voidptr``): the handler's argument
#: and result, and what :func:`_pointer` makes of an int64 address. Python never holds one.
_VoidPointer = Any


def _pointer_typing(typingctx: Any, address: Any) -> Any:  # pragma: no cover - compiled
    """An int64 address as a pointer (what ``carray`` reads from): :func:`_pointer`."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return types.voidptr(types.int64), codegen


# numba's stubs type a call of an intrinsic with its typing function's parameters
# (``typingctx`` included) and as returning Never; compiled code calls it without the
# context, so each (this one and the two below) is declared as that code sees it.
_pointer = cast("Callable[[int], _VoidPointer]", intrinsic(_pointer_typing))


# XLA:CPU runs its threads with subnormals read and written as zero (x86: the MXCSR's DAZ
# and FTZ bits; ARM: the FPCR's FZ bits). The kernel's float arithmetic must see them: the
# handler clears those bits while it runs and restores them after.
_MACHINE = platform.machine().lower()
_X86 = _MACHINE in ("x86_64", "amd64")
_ARM = _MACHINE in ("aarch64", "arm64")
#: Whether this machine's floating-point control register is known here (else no FFI path).
SUPPORTED = _X86 or _ARM
_FLUSH_BITS = (1 << 6) | (1 << 15) if _X86 else (1 << 24) | (1 << 19)  # DAZ|FTZ ; FZ|FZ16
_I64 = ir.IntType(64)


def _fp_control_typing(typingctx: Any) -> Any:  # pragma: no cover - compiled
    """The floating-point control register (x86 MXCSR, ARM FPCR) as an int64:
    :func:`_fp_control`."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        if _X86:
            slot = cgutils.alloca_once(builder, ir.IntType(32))
            fn = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()]),
                "llvm.x86.sse.stmxcsr",
            )
            builder.call(fn, [builder.bitcast(slot, ir.IntType(8).as_pointer())])
            return builder.zext(builder.load(slot), _I64)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_I64, []), "llvm.aarch64.get.fpcr"
        )
        return builder.call(fn, [])

    return types.int64(), codegen


def _set_fp_control_typing(typingctx: Any, value: Any) -> Any:  # pragma: no cover - compiled
    """Sets the floating-point control register to ``value`` (from :func:`_fp_control`):
    :func:`_set_fp_control`."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        if _X86:
            slot = cgutils.alloca_once(builder, ir.IntType(32))
            builder.store(builder.trunc(args[0], ir.IntType(32)), slot)
            fn = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()]),
                "llvm.x86.sse.ldmxcsr",
            )
            builder.call(fn, [builder.bitcast(slot, ir.IntType(8).as_pointer())])
        else:
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [_I64]), "llvm.aarch64.set.fpcr"
            )
            builder.call(fn, [args[0]])
        return context.get_dummy_value()

    return types.none(types.int64), codegen


_fp_control = cast("Callable[[], int]", intrinsic(_fp_control_typing))
_set_fp_control = cast("Callable[[int], None]", intrinsic(_set_fp_control_typing))


@numba.njit(cache=True, nogil=True)
def _buffer(address: int) -> tuple[int, int]:  # pragma: no cover - compiled
    """``(data, element count)`` of the ``XLA_FFI_Buffer`` at ``address``."""
    b = carray(_pointer(address), (6,), np.int64)
    dims = carray(_pointer(b[5]), (max(b[4], 1),), np.int64)
    n = 1
    for d in range(b[4]):
        n *= dims[d]
    return b[3], n


@numba.njit(cache=True, nogil=True)
def _write_blocks(  # pragma: no cover - compiled
    x: np.ndarray, spec: np.ndarray, nf: int, amax: float, ints_at: int, floats_at: int
) -> None:
    """The block formats' words of ``x`` (``spec``: the row length, then the formats'
    table; ``amax``: its largest finite magnitude) into the result buffers at ``ints_at``
    (int32: the three counts, the largest block ratio's float64 as two words, the squared
    error's exponent) and ``floats_at`` (float32: the squared error's significand)."""
    acc = np.zeros((nf, 5))
    blocks_serial(x, np.int64(spec[0]), spec[1:].reshape(nf, _TABLE_WIDTH), amax, acc)
    data, _ = _buffer(ints_at)
    ints = carray(_pointer(data), (nf, _INT_WORDS), np.int32)
    data, _ = _buffer(floats_at)
    floats = carray(_pointer(data), (nf,), np.float32)
    ratio = np.empty(1)
    pair = ratio.view(np.int32)
    for f in range(nf):
        for c in range(3):  # underflow, subnormal, saturated
            ints[f, c] = np.int32(acc[f, c])
        ratio[0] = acc[f, 4]
        ints[f, 3] = pair[0]
        ints[f, 4] = pair[1]
        mant, exp = math.frexp(acc[f, 3])
        ints[f, 5] = exp
        floats[f] = np.float32(mant)


@numba.njit(cache=True, nogil=True, inline="always")
def _serve(frame: _VoidPointer, blocks: int | None) -> None:  # pragma: no cover - compiled
    """What both FFI handlers do with XLA's call frame ``frame``: answer the version query,
    or read the arguments and write the results. ``blocks``: ``None`` in the plain handler
    (4 arguments; numba prunes every ``blocks is not None`` branch where the argument's
    type is None, so its compile has none of the block formats' code), an int in the
    full handler (4 arguments, or with block formats 5 arguments and 2 more results)."""
    words = carray(frame, (15,), np.int64)
    if words[1] != 0:  # an extension: XLA asks which FFI version we speak
        if carray(_pointer(words[1]), (4,), np.int32)[2] == _METADATA:
            metadata = carray(
                _pointer(carray(_pointer(words[1]), (4,), np.int64)[3]), (9,), np.int32
            )
            api = carray(_pointer(words[2]), (10,), np.int32)
            metadata[6] = api[8]  # major version
            metadata[7] = api[9]  # minor version
            metadata[8] = 0  # traits
        return
    if carray(frame, (10,), np.int32)[8] != _EXECUTE:
        return
    # The layout read here, checked where the frame says it: struct sizes (a later API may
    # append fields, never move them), 4 arguments and 2 or 3 results, or in the block
    # formats' handler 5 arguments and 2 more results. Otherwise nothing is written, and
    # available()'s self-test turns the kernel off.
    nargs = words[7]
    nrets = words[12]
    nblk = 2 if blocks is not None and nargs == 5 else 0
    if (
        words[0] < _FRAME_SIZE
        or words[5] < _LIST_SIZE
        or words[10] < _LIST_SIZE
        or nargs != 4 + nblk // 2
        or (nrets - nblk != 2 and nrets - nblk != 3)
    ):
        return
    args = carray(_pointer(words[9]), (nargs,), np.int64)
    rets = carray(_pointer(words[14]), (nrets,), np.int64)
    for i in range(nargs):
        if carray(_pointer(args[i]), (1,), np.int64)[0] < _BUFFER_SIZE:
            return
    for i in range(nrets):
        if carray(_pointer(rets[i]), (1,), np.int64)[0] < _BUFFER_SIZE:
            return
    if blocks is not None and nblk:  # (rowlen, table): float64 words; int32, float32 words
        data, m = _buffer(args[4])
        spec = carray(_pointer(data), (m // 2,), np.float64)
        nf = (m // 2 - 1) // _TABLE_WIDTH
        _, m_ints = _buffer(rets[nrets - 2])
        _, m_floats = _buffer(rets[nrets - 1])
        if m != 2 * (1 + nf * _TABLE_WIDTH) or m_ints != nf * _INT_WORDS or m_floats != nf:
            return
    data, n = _buffer(args[0])
    x = frozen(carray(_pointer(data), (n,), np.float32))  # (the host path's type: one compile)
    data, m = _buffer(args[1])
    field_bin = carray(_pointer(data), (m,), np.int32)
    data, m = _buffer(args[2])
    sub_bin = carray(_pointer(data), (m,), np.int32)
    data, m = _buffer(args[3])
    params = carray(_pointer(data), (2,), np.float32)
    data, m = _buffer(rets[0])
    counts = carray(_pointer(data), (m,), np.int32)
    data, k = _buffer(rets[1])
    values = carray(_pointer(data), (k,), np.float32)
    out = np.empty(m + _NVALUES)
    control = _fp_control()
    _set_fp_control(control & ~_FLUSH_BITS)
    summary_serial(x, field_bin, sub_bin, np.int64(params[0]), np.float64(params[1]), out)
    split_serial(out, counts, values)
    if k == _NVALUES + 2:  # moments=4: m3, m4 after the core values (one more pass)
        higher = np.empty(2)
        higher_serial(x, out, higher)
        values[_NVALUES] = higher[0]
        values[_NVALUES + 1] = higher[1]
    if nrets - nblk == 3:  # the core values' float64 bits, two uint32 words each
        data, w = _buffer(rets[2])
        exact = carray(_pointer(data), (w // 2,), np.float64)
        for i in range(min(w // 2, _NVALUES)):
            exact[i] = out[_NLEAD + i]
    if blocks is not None and nblk:
        _write_blocks(x, spec, nf, out[_MAXABS], rets[nrets - 2], rets[nrets - 1])
    _set_fp_control(control)


def _handle(frame: _VoidPointer) -> _VoidPointer:  # pragma: no cover - compiled by available()
    """The FFI handler of :data:`TARGET`: XLA calls it with a pointer to its call frame;
    it returns a null ``XLA_FFI_Error*`` (success). Compiled by ``numba.cfunc`` with the C
    signature ``void *(void *)``; never called from Python."""
    _serve(frame, None)
    return _pointer(0)


def _handle_blocks(frame: _VoidPointer) -> _VoidPointer:  # pragma: no cover - compiled
    """The FFI handler of :data:`BLOCKS_TARGET` (see :func:`_handle`), which serves
    :data:`TARGET`'s calls too: compiled only when a run asks for block formats
    (``available(blocks=True)``), and then, where the plain handler was not built before,
    registered as both targets (one build, not two)."""
    _serve(frame, 0)
    return _pointer(0)


_lock = threading.Lock()
#: whether each handler's target is registered (by ``blocks``), once tried
_built: dict[bool, bool] = {}


def available(blocks: bool = False) -> bool:
    """Whether the in-program kernel can serve on this machine (with ``blocks``, also for
    block formats): its handler compiles and XLA accepts it as a custom-call target. Each
    handler is tried once per process, when first asked for; a failure is reported in a
    warning, and JAX's taps on the CPU then use XLA's summary operations (the same results,
    about twice as slow). numba caches the compiled handlers: on a cold cache (a 2-core
    machine) the plain one takes about 11 s to build and the block formats' one about 31 s
    (21 s more after the plain one); then half a second."""
    with _lock:
        if blocks and not _built:  # the block formats' handler serves both targets
            _built[False] = _built[True] = _build(True, plain_too=True)
        if False not in _built:
            _built[False] = _build(False)
        if blocks and True not in _built:
            _built[True] = _built[False] and _build(True)
        return _built[False] and (not blocks or _built[True])


def _build(blocks: bool, plain_too: bool = False) -> bool:
    """Compile a handler (``blocks``: the block formats' one; ``plain_too``: registered as
    :data:`TARGET` too), register it with XLA and test it; False, with a warning, where any
    of that fails."""
    if not SUPPORTED:
        warnings.warn(
            f"tandv: no in-program summary kernel for {platform.machine()!r} processors; "
            f"JAX taps on the CPU use XLA's summary operations (same results, slower)",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    try:
        compile_handler = numba.cfunc(types.voidptr(types.voidptr), cache=True, nogil=True)
        handler = compile_handler(_handle_blocks if blocks else _handle)
        new_capsule = ctypes.pythonapi.PyCapsule_New
        new_capsule.restype = ctypes.py_object
        new_capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
        targets = [BLOCKS_TARGET] if blocks else []
        targets += [TARGET] if plain_too or not blocks else []
        for target in targets:
            jax.ffi.register_ffi_target(
                target, new_capsule(handler.address, None, None), platform="cpu"
            )
        _keep.append(handler)  # the compiled code must outlive every program that calls it
        _built[blocks] = True  # (registered: the self-tests call it)
        if TARGET in targets:
            _self_test()
        if blocks:
            _self_test_blocks()
    except Exception as e:  # noqa: BLE001 - numba and XLA raise many kinds; all mean "cannot"
        warnings.warn(
            f"tandv: the in-program summary kernel could not be built ({type(e).__name__}: {e}); "
            f"JAX taps on the CPU use XLA's summary operations (same results, slower)",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


def _self_test() -> None:
    """Run the custom call once on a CPU device against the host kernel run directly: a
    jaxlib whose call frame this handler misreads is caught here, not in a user's log."""
    from ...stats.formats import number_format
    from ...stats.host import host_summaries
    from ...stats.summary import Layout
    from ._summary import to_vector

    x = np.array([-3.5, 0.0, 1e-45, np.inf, np.nan, 7.25, -0.125, 2.0**60], np.float32)
    layout = Layout(number_format("float32"))
    on_cpu = jax.device_put(x, jax.devices("cpu")[0])
    got = to_vector(
        jax.device_get(jax.jit(lambda a: ffi_summary(a, layout.format, layout.num_counts))(on_cpu))
    )
    want = host_summaries([x], layout)[0]
    _, words = jax.device_get(
        jax.jit(lambda a: ffi_summary_exact(a, layout.format, layout.num_counts))(on_cpu)
    )
    core = slice(N_LEADING_COUNTS, N_LEADING_COUNTS + N_CORE_VALUES)
    if not np.allclose(got, want, rtol=1e-6, atol=0, equal_nan=True) or not np.allclose(
        exact_values(words), want[core], rtol=1e-12, atol=0, equal_nan=True
    ):
        raise RuntimeError(
            "its results on a test array differ from the host kernel's (an XLA FFI "
            "call frame this version of tandv does not know?)"
        )


def _self_test_blocks() -> None:
    """:func:`_self_test` of the block formats' handler: their words (five arguments, four
    results), rows of 4."""
    from ...stats.blocks import BLOCK_FORMATS, block_extras
    from ...stats.formats import number_format
    from ...stats.host import host_summaries
    from ...stats.summary import Layout
    from ._blocks import with_words
    from ._summary import to_vector

    x = np.array([-3.5, 0.0, 1e-45, np.inf, np.nan, 7.25, -0.125, 2.0**60], np.float32)
    on_cpu = jax.device_put(x, jax.devices("cpu")[0])

    names = ("mxfp8_e4m3", "nvfp4")
    blayout = Layout(number_format("float32"), block_extras(names))
    formats = tuple(BLOCK_FORMATS[n] for n in names)

    def blocks(a: Any) -> DeviceSummary:
        core, _, (ints, floats) = ffi_summary_blocks(
            a, blayout.format, blayout.num_counts, 2, formats
        )
        return DeviceSummary(
            *with_words(core.counts, core.values, ints, floats, N_CORE_VALUES, True)
        )

    rows = on_cpu.reshape(2, 4)
    got = to_vector(jax.device_get(jax.jit(blocks)(rows)))
    want = host_summaries([x.reshape(2, 4)], blayout)[0]
    if not np.allclose(got, want, rtol=1e-6, atol=0, equal_nan=True):
        raise RuntimeError(
            "its block formats' columns on a test array differ from the host kernel's"
        )


_keep: list[Any] = []


@cache
def _tables(fmt: NumberFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    field_bin, sub_bin, nb, over_at = serial_tables(fmt)
    return field_bin, sub_bin, np.array([nb, over_at], np.float32)


@cache
def _block_spec(formats: tuple[BlockFormat, ...], rowlen: int) -> np.ndarray:
    """The handler's fifth argument: the row length and the formats' parameter table
    (:func:`tandv.stats.host.serial_block_table`), float64 as uint32 words (a program
    without x64 has no float64 arrays)."""
    spec = np.concatenate([[float(rowlen)], serial_block_table(formats).reshape(-1)])
    return spec.astype(np.float64).view(np.uint32)


def _call(
    x: Any,
    fmt: NumberFormat,
    num_counts: int,
    exact: bool,
    moments: int = 2,
    formats: tuple[BlockFormat, ...] = (),
) -> tuple[Any, ...]:
    """The custom call on ``x``: counts, values (with ``moments=4``, ``m3`` and ``m4`` after
    the core values: the handler then makes the second pass), where ``exact`` the exact
    words and, with block ``formats``, their int32 and float32 words (:mod:`._blocks`, the
    host kernel's variant)."""
    check_countable(x)
    field_bin, sub_bin, params = _tables(fmt)
    results = [
        jax.ShapeDtypeStruct((N_LEADING_COUNTS + num_counts,), jnp.int32),
        jax.ShapeDtypeStruct((N_CORE_VALUES + (2 if moments == 4 else 0),), jnp.float32),
    ]
    if exact:
        results.append(jax.ShapeDtypeStruct((2 * N_CORE_VALUES,), jnp.uint32))
    args = [
        jnp.ravel(x).astype(jnp.float32),
        jnp.asarray(field_bin),
        jnp.asarray(sub_bin),
        jnp.asarray(params),
    ]
    if formats:
        check_blockable(x)
        results.append(jax.ShapeDtypeStruct((len(formats) * INT_WORDS,), jnp.int32))
        results.append(jax.ShapeDtypeStruct((len(formats),), jnp.float32))
        args.append(jnp.asarray(_block_spec(tuple(formats), x.shape[-1] if x.ndim else 1)))
    # the block formats' handler, built here at the first such trace where no one asked
    # for it before (available(blocks=True), as the trackers do when they choose the path)
    if formats and not _built.get(True) and not available(blocks=True):
        raise RuntimeError(
            "tandv: the in-program kernel's block formats handler could not be built (see "
            "the warning): check available(blocks=True) before choosing this path"
        )
    target = BLOCKS_TARGET if formats else TARGET
    call = jax.ffi.ffi_call(target, tuple(results), vmap_method="sequential")
    return tuple(call(*args))


def ffi_summary(x: Any, fmt: NumberFormat, num_counts: int, moments: int = 2) -> DeviceSummary:
    """The core summary of ``x`` (any float dtype but float64) for format ``fmt``, computed
    by the host kernel inside the XLA:CPU program (traceable; CPU only). Its ``values`` hold
    the core fields, then with ``moments=4`` ``m3``, ``m4`` (float64 sums about the exact
    mean, rounded to float32; :func:`._summary.with_custom` puts custom statistics before
    them). Call only where :func:`available` said True."""
    counts, values = _call(x, fmt, num_counts, exact=False, moments=moments)
    return DeviceSummary(counts, values)


def ffi_summary_exact(
    x: Any, fmt: NumberFormat, num_counts: int, moments: int = 2
) -> tuple[DeviceSummary, Any]:
    """:func:`ffi_summary` and the kernel's float64 core values, exact, as ``2 *
    N_CORE_VALUES`` uint32 words (each value's bit pattern; :func:`exact_values` reads
    them on the host). A program's float outputs are float32 unless JAX runs with x64; the
    words carry the float64 sums through it without turning x64 on."""
    counts, values, words = _call(x, fmt, num_counts, exact=True, moments=moments)
    return DeviceSummary(counts, values), words


def ffi_summary_blocks(
    x: Any,
    fmt: NumberFormat,
    num_counts: int,
    moments: int,
    formats: tuple[BlockFormat, ...],
    exact: bool = False,
) -> tuple[DeviceSummary, Any, tuple[Any, Any]]:
    """:func:`ffi_summary` (``exact``: and the words of :func:`ffi_summary_exact`, else
    None) and the block ``formats``' words (int32, float32) by the host kernel in the same
    call (:func:`tandv.stats.host.blocks_serial`, after the core summary): for
    :func:`._blocks.with_words` with ``host=True``. Float64 arrays are refused."""
    got = _call(x, fmt, num_counts, exact=exact, moments=moments, formats=formats)
    words = got[2] if exact else None
    return DeviceSummary(got[0], got[1]), words, (got[-2], got[-1])


def exact_values(words: np.ndarray) -> np.ndarray:
    """The float64 core values (shape ``(..., N_CORE_VALUES)``) of words from
    :func:`ffi_summary_exact` fetched to the host (shape ``(..., 2 * N_CORE_VALUES)``)."""
    return np.ascontiguousarray(words, dtype=np.uint32).view(np.float64)
