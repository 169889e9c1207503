"""Block-scaled formats in JAX taps on the CPU: the host kernel's custom call computes their
columns (no XLA block words in the program), and the tracker's rows equal the numpy
reference on the crafted tensors (float32 and bfloat16), counts and block ranges exactly,
sq_err to 1e-6 relative."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from test_blocks_jax_paths import CRAFTED, _as, assert_rows_equal_reference  # noqa: E402

import tandv  # noqa: E402
from tandv.track.jax import _ffi, track  # noqa: E402
from tandv.track.jax._kernels import summary_path  # noqa: E402

pytestmark = pytest.mark.in_program_kernel
FORMATS = ("mxfp8_e4m3", "nvfp4")


def test_cpu_taps_take_the_custom_call(tmp_path, monkeypatch) -> None:
    # the summary a tap takes on the CPU, lowered: one custom call with the block
    # formats' argument, none of the bit operations of the XLA block words
    calls = []
    real = _ffi.ffi_summary_blocks
    assert _ffi.available(blocks=True)  # (built before counting: its self-test calls it)

    def counted(*args, **kwargs):
        calls.append(args[4])
        return real(*args, **kwargs)

    monkeypatch.setattr(_ffi, "ffi_summary_blocks", counted)
    x = jnp.ones((4, 33), jnp.bfloat16)
    params = {"w": jnp.ones((2, 2))}
    with track(
        model_state=params, block_formats=FORMATS, out=tmp_path / "log", verbose=False
    ) as tr:
        text = jax.jit(lambda a: tr._kernels._summarize_anywhere(a, True)).lower(x).as_text()
        plain = jax.jit(lambda a: tr._kernels.summarize(a)).lower(x).as_text()
    assert text.count("tandv_summary_f32") == 1
    assert _ffi.BLOCKS_TARGET in text  # (the block formats' handler: TARGET + "_blocks")
    assert "bitcast_convert" not in text
    assert "bitcast_convert" in plain  # (the XLA path's words: what the check looks for)
    assert [tuple(f.name for f in c) for c in calls] == [FORMATS]


def _crafted_run(tmp_path, dtype: str) -> tuple[object, dict[tuple[str, str], np.ndarray]]:
    """A tracked step of a model whose modules output the crafted tensors (as ``dtype``),
    their cotangents the same tensors; returns the log and the references."""
    import flax.linen as nn

    class Pass(nn.Module):
        @nn.compact
        def __call__(self, v: jax.Array) -> jax.Array:
            return v

    class Net(nn.Module):
        @nn.compact
        def __call__(self, xs: dict[str, jax.Array]) -> jax.Array:
            total = jnp.sum(nn.Dense(1, name="d")(jnp.ones((1, 2))))
            for name, v in xs.items():
                out = Pass(name=name)(v)
                total = total + jnp.sum(out.astype(jnp.float32) * xs[name].astype(jnp.float32))
            return total

    arrays = {k: _as(a, dtype) for k, a in CRAFTED.items()}
    xs = {k: jnp.asarray(a) for k, a in arrays.items()}
    model = Net()
    params = model.init(jax.random.PRNGKey(0), xs)
    step = jax.jit(jax.grad(lambda p, v: model.apply(p, v), argnums=(0, 1)))
    with track(
        model_state=params,
        block_formats=FORMATS,
        out=tmp_path / "log",
        verbose=False,
    ) as tr:
        grads, _ = tr.intercept(step, params, xs)
        tr.step(params, None, grads)
    ref = {}
    for k, a in arrays.items():
        ref[("Activation", k)] = a
        ref[("Gradient", k)] = a  # d total / d out: the same tensor (exact in dtype)
    return tandv.read_parquet(tmp_path / "log"), ref


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tap_rows_equal_reference(dtype: str, tmp_path, monkeypatch) -> None:
    calls = []
    real = _ffi.ffi_summary_blocks
    assert _ffi.available(blocks=True)  # (built before counting: its self-test calls it)

    def counted(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(_ffi, "ffi_summary_blocks", counted)
    with summary_path("auto"):
        df, ref = _crafted_run(tmp_path, dtype)
    # every tap's summary by the custom call (traced once per shape: taps share the trace)
    assert {a.shape for a in ref.values()} <= set(calls)
    assert_rows_equal_reference(df, ref, FORMATS, dtype)


def test_only_runs_with_block_formats_build_their_handler(monkeypatch) -> None:
    """The block formats' handler is built (compiled, registered, self-tested: on a cold
    numba cache about two thirds of the in-program kernel's build) only where block formats
    are asked for: by a tracker whose layouts carry them (the first build of a process
    then serves the plain target too: one build, not two), or at the first trace of
    ``ffi_summary_blocks`` where none asked before; a handler that cannot be built is
    refused there with an error, not called."""
    from tandv.stats.blocks import BLOCK_FORMATS, block_extras
    from tandv.stats.summary import Layout
    from tandv.track.jax._kernels import SummaryKernels

    built: list[tuple[bool, bool]] = []  # (blocks, plain_too) of each build
    works = {False: True, True: True}

    def build(blocks: bool, plain_too: bool = False) -> bool:
        built.append((blocks, plain_too))
        return works[blocks]

    def kernels(*extras: tuple[str, str]) -> SummaryKernels:
        return SummaryKernels(lambda d: Layout(str(jnp.dtype(d)), extras), {}, 2, False)

    monkeypatch.setattr(_ffi, "_build", build)
    with summary_path("auto"):
        monkeypatch.setattr(_ffi, "_built", {})  # a process that has built neither handler
        assert kernels().host_kernel and built == [(False, False)]
        assert kernels(*block_extras(FORMATS)).host_kernel
        assert built == [(False, False), (True, False)]
        built.clear()
        monkeypatch.setattr(_ffi, "_built", {})  # block formats first: one build serves both
        assert kernels(*block_extras(FORMATS)).host_kernel and kernels().host_kernel
        assert built == [(True, True)]

    layout = Layout("float32", block_extras(FORMATS))
    formats = tuple(BLOCK_FORMATS[n] for n in FORMATS)

    def blocks(a):
        return _ffi.ffi_summary_blocks(a, layout.format, layout.num_counts, 2, formats)

    x = jnp.ones((2, 32), jnp.float32)
    built.clear()
    monkeypatch.setattr(_ffi, "_built", {False: True})  # the plain handler only, so far
    assert _ffi.BLOCKS_TARGET in jax.jit(blocks).lower(x).as_text()
    assert built == [(True, False)]
    works[True] = False
    monkeypatch.setattr(_ffi, "_built", {False: True})
    with pytest.raises(RuntimeError, match="block formats handler could not be built"):
        jax.jit(lambda a: blocks(a)).lower(x)  # (a new function: traced again)
    assert built == [(True, False), (True, False)]
