"""The fused Pallas kernel as CUDA GPUs would compile it, checked on a machine without a GPU.

JAX lowers the kernel for CUDA without a device (Pallas's Triton lowering, sm_90 by default);
the Triton module it produces is compiled here by the pip ``triton`` for sm_90 and
``cuobjdump -res-usage`` reads the cubin's registers and spills. The pip triton is close to,
not the same as, XLA's bundled Triton: its figures are a proxy for what a GPU would run.

The lowering hook read here is JAX-internal (``lower_jaxpr_to_triton_module``); when JAX
moves it, :func:`compile_for_sm90` is the one function to update.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from tandv.stats.formats import number_format  # noqa: E402

TRITON_CALL = "__gpu$xla.gpu.triton"


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What one lowering of the kernel for CUDA came to."""

    custom_calls: tuple[str, ...]  # the lowered program's custom-call targets, in order
    num_warps: int
    registers: int  # per thread
    stack: int  # bytes of stack per thread (spills)
    local: int  # bytes of local memory per thread (spills)
    partial_bytes: int  # bytes the kernel writes (its rows of partials)
    input_bytes: int


def _cuobjdump() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else shutil.which("cuobjdump")


def compile_for_sm90(
    dtype: Any,
    n: int,
    fmt: str,
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    moments: int = 2,
) -> Compiled:
    """Lower :func:`pallas_summary` (with ``moments``) of an ``(n,)`` array of ``dtype`` for
    CUDA, compile its Triton module for sm_90 with the pip triton, and read the cubin's
    resource usage.

    Reads JAX internals: the Triton module is captured by wrapping
    ``jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module`` (through
    ``monkeypatch``), and the kernel's outputs from the grid mapping passed to it."""
    import triton
    from jax._src.pallas.triton import lowering as triton_lowering
    from triton.backends.compiler import GPUTarget

    from tandv.track.jax._pallas import pallas_summary

    captured: list[tuple[str, int]] = []
    lower = triton_lowering.lower_jaxpr_to_triton_module

    def spy(jaxpr: Any, grid_mapping: Any, *args: Any, **kwargs: Any) -> Any:
        result = lower(jaxpr, grid_mapping, *args, **kwargs)
        outputs = sum(
            int(np.prod(bm.array_aval.shape)) * np.dtype(bm.array_aval.dtype).itemsize
            for bm in grid_mapping.block_mappings_output
        )
        captured.append((result.module.operation.get_asm(enable_debug_info=False), outputs))
        return result

    number = number_format(fmt)
    with monkeypatch.context() as patch:
        patch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", spy)
        patch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # triton's default, without its warning
        jax.clear_caches()  # a cached lowering would not reach the spy
        fn = jax.jit(
            lambda a: pallas_summary(a, number, number.num_bins, interpret=False, moments=moments)
        )
        text = (
            fn.trace(jax.ShapeDtypeStruct((n,), dtype))
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        [(module, partial_bytes)] = captured
        num_warps = int(re.search(r"num_warps = (\d+)", text).group(1))
        num_stages = int(re.search(r"num_stages = (\d+)", text).group(1))
        source = workdir / f"{jnp.dtype(dtype).name}-{n}-{fmt}-m{moments}.ttir"
        source.write_text(module)
        kernel = triton.compile(
            str(source),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": num_warps, "num_stages": num_stages},
        )
    cubin = source.with_suffix(".cubin")
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run(
        [_cuobjdump(), "-res-usage", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    found = {key: int(v) for key, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}
    return Compiled(
        custom_calls=tuple(re.findall(r"stablehlo\.custom_call @([\w$.\-]+)", text)),
        num_warps=num_warps,
        registers=found["REG"],
        stack=found["STACK"],
        local=found["LOCAL"],
        partial_bytes=partial_bytes,
        input_bytes=n * jnp.dtype(dtype).itemsize,
    )


DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "float8_e4m3fn": jnp.float8_e4m3fn,  # read as bytes, decoded in the kernel
    "float8_e5m2": jnp.float8_e5m2,
}
# (dtype, elements, format): a size no block divides, 1M (where the rows must be small
# beside the input) and 50M (programs at their largest chunks); the array's own format, and
# once each an array smaller than one chunk (one program) and the float64 format's 2098
# bins (a histogram of 16 x 256 counts); and two 8-bit float formats, read as bytes
CASES = [
    (dtype, n, dtype) for dtype in list(DTYPES)[:3] for n in (100_003, 1_000_000, 50_000_000)
] + [
    ("float32", 1_000, "float32"),
    ("float32", 1_000_000, "float64"),
    ("float8_e4m3fn", 1_000_000, "float8_e4m3fn"),
    ("float8_e5m2", 100_003, "float8_e5m2"),
]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Each case compiled once for the module's tests (a cache by case)."""
    if _cuobjdump() is None:
        pytest.skip("no triton with the NVIDIA backend, or no cuobjdump, on this machine")
    workdir = tmp_path_factory.mktemp("sm90")
    cache: dict[tuple[str, int, str], Compiled] = {}

    def get(case: tuple[str, int, str]) -> Compiled:
        if case not in cache:
            with pytest.MonkeyPatch.context() as monkeypatch:
                dtype, n, fmt = case
                cache[case] = compile_for_sm90(DTYPES[dtype], n, fmt, workdir, monkeypatch)
        return cache[case]

    return get


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-as-{c[2]}")
def test_kernel_lowers_to_one_triton_call(compiled, case):
    """On CUDA the summary is one Triton kernel and an XLA epilogue: no host callback."""
    calls = compiled(case).custom_calls
    assert calls.count(TRITON_CALL) == 1, calls
    assert not [c for c in calls if "callback" in c], calls


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-as-{c[2]}")
def test_kernel_compiles_for_sm90_without_spills(compiled, case):
    """Every thread's state fits in registers: no stack, no local memory (spills to memory
    would cost a kernel meant to be bound by one read of its input)."""
    got = compiled(case)
    assert got.registers <= 255
    assert (got.stack, got.local) == (0, 0), got


@pytest.mark.parametrize(
    "case", [c for c in CASES if c[1] >= 1_000_000], ids=lambda c: f"{c[0]}-{c[1]}-as-{c[2]}"
)
def test_partial_rows_are_small_beside_the_input(compiled, case):
    """Tracking should cost about one read of the array: the rows of partials the kernel
    writes (and the epilogue reads back) are at most 2% of the input's bytes."""
    got = compiled(case)
    assert got.partial_bytes <= 0.02 * got.input_bytes, got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moments4_kernel_compiles_for_sm90_without_spills(dtype, tmp_path, monkeypatch):
    """With ``moments=4`` each lane also carries the sums of cubes and fourth powers: still
    one Triton call, no stack or local memory, and partial rows (16 values a program) at
    most 2% of a 1M-element input."""
    if _cuobjdump() is None:
        pytest.skip("no triton with the NVIDIA backend, or no cuobjdump, on this machine")
    got = compile_for_sm90(DTYPES[dtype], 1_000_000, dtype, tmp_path, monkeypatch, moments=4)
    assert got.custom_calls.count(TRITON_CALL) == 1, got
    assert got.registers <= 255 and (got.stack, got.local) == (0, 0), got
    assert got.partial_bytes <= 0.02 * got.input_bytes, got
