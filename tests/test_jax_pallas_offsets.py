"""The fused Pallas kernel (tandv/track/jax/_pallas.py) on 8-bit floats, read as their raw
codes, and the arithmetic that places each program's reads (issue 28). The kernel runs in
Pallas's interpreter here, against the numpy reference tandv.stats.summarize."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from test_jax_summary import assert_matches  # noqa: E402

from tandv.stats.formats import KNOWN_FORMATS, number_format  # noqa: E402
from tandv.track.jax._pallas import (  # noqa: E402
    BLOCK,
    chunk_size,
    fp8_code,
    pallas_summary,
    program_extent,
)

# the 8-bit float formats with a sign bit (read as their codes; e8m0 is widened)
FP8 = [n for n in KNOWN_FORMATS if n.startswith("float8") and n != "float8_e8m0fnu"]
rng = np.random.default_rng(28)


def every_code(name: str, repeat: int = 3) -> np.ndarray:
    """All 256 codes of an 8-bit float format (NaNs, infinities, both zeros, every
    subnormal), shuffled, ``repeat`` times over, plus a ragged end no block divides."""
    codes = np.concatenate(
        [np.arange(256, dtype=np.uint8)] * repeat + [rng.integers(0, 256, 37, dtype=np.uint8)]
    )
    return rng.permutation(codes).view(getattr(ml_dtypes, name))


@pytest.mark.parametrize("name", FP8)
def test_fp8_codes_are_decoded_in_the_kernel_exactly(name):
    """Every code of each signed 8-bit float format, read as a byte and decoded in the
    kernel: counts, extrema and exponent counts equal numpy's summary of the array (which
    ml_dtypes converts), moments to float32 rounding; in the format's own layout and in
    another's (float16's thresholds)."""
    assert fp8_code(getattr(ml_dtypes, name)) is not None
    x = every_code(name)
    assert_matches(x, None, "pallas")
    assert_matches(x, "float16", "pallas")


def test_fp8_over_several_programs():
    """Several programs (chunks sized for 1-byte elements) and a ragged last one."""
    high = 32
    n = 2 * chunk_size(10**6, 1, high) + 12_345
    assert program_extent(n, chunk_size(n, 1, high))[0] > 1
    x = (rng.normal(size=n) * np.exp(rng.normal(size=n) * 3)).astype(ml_dtypes.float8_e4m3fn)
    x[rng.integers(0, n, 200)] = np.nan
    assert_matches(x, None, "pallas")


def kernel_operands(x: jax.Array) -> list[tuple[str, Any]]:
    """The avals of what the kernel reads, and every float32 array the program makes as
    large as ``x`` (a widened copy would be one)."""
    fmt = number_format(str(x.dtype))
    jaxpr = jax.make_jaxpr(lambda a: pallas_summary(a, fmt, fmt.num_bins, interpret=True))(x)
    found: list[tuple[str, Any]] = []

    def walk(jx: Any) -> None:
        for eqn in jx.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(("kernel", eqn.invars[0].aval))
                continue  # the kernel's own body reads blocks
            for out in eqn.outvars:
                if out.aval.dtype == jnp.float32 and out.aval.size >= x.size:
                    found.append(("float32", out.aval))
            for p in eqn.params.values():  # nested programs (jit) and their closed jaxprs
                inner = getattr(p, "jaxpr", p)
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(jaxpr.jaxpr)
    return found


def test_fp8_is_read_without_a_float32_copy():
    """The kernel reads the array's own bytes (a bitcast to uint8, which XLA does not
    copy); before, an 8-bit array was widened to a float32 copy four times its size.
    float8_e8m0fnu (no sign bit: not decoded by the kernel's arithmetic) still is."""
    x = jnp.asarray(every_code("float8_e5m2"))
    assert kernel_operands(x) == [("kernel", jax.core.ShapedArray((x.size,), jnp.uint8))]
    e8m0 = jnp.asarray(np.exp2(rng.integers(-20, 20, 300)).astype(ml_dtypes.float8_e8m0fnu))
    assert fp8_code(e8m0.dtype) is None
    assert [k for k, _ in kernel_operands(e8m0)] == ["float32", "kernel"]
    assert_matches(np.asarray(e8m0), None, "pallas")


@pytest.mark.parametrize("n", [0, 1, BLOCK - 1, 65_536, 2**31 - 1, 2**31 + 5, 2**40 + 3])
@pytest.mark.parametrize("itemsize", [1, 2, 4])
def test_program_extent_covers_any_length_with_offsets_inside_a_chunk(n, itemsize):
    """The kernel's reads are placed from Python integers (exact at any size) and masked by
    offsets into a chunk: every value the kernel computes is at most ``chunk``, and the
    grid's program ids stay small. What this shows: the placement arithmetic is right past
    2**31 elements (to 2**40 here, with the chunks chunk_size picks). What it does not:
    arrays past 2**31 - 1 elements are still refused before the kernel (the summary's
    counts are int32, JAX having no 64-bit integers by default), and Pallas itself scales a
    block index by the block size in int32 in its Triton lowering, so that limit stays."""
    chunk = chunk_size(n, itemsize, 32)
    programs, tail = program_extent(n, chunk)
    assert (programs - 1) * chunk + tail == n
    assert 0 < tail <= chunk or n == 0 and (programs, tail) == (1, 0)
    assert chunk < 2**31 and programs < 2**31
