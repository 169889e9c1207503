"""The JAX tracker's summary path: the test hook ``_kernels.summary_path`` and the user
setting ``TANDV_JAX_SUMMARY`` pick the kernel of the trackers made under them, and every path
gives the rows of the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from test_jax_tracker import assert_row_matches  # noqa: E402

from tandv.schema import read_log  # noqa: E402
from tandv.track.jax import _ffi, track  # noqa: E402
from tandv.track.jax._kernels import current_summary_path, summary_path  # noqa: E402


def _step_run(out) -> dict[str, np.ndarray]:
    """One step of two weights given to ``step()`` alone; returns the weights."""
    rng = np.random.default_rng(5)
    arrays = {"w": rng.normal(size=(6, 7)).astype(np.float32), "b": np.float32([0, -2.5, 1e-40])}
    params = {k: jnp.asarray(v) for k, v in arrays.items()}
    with track(params, out=out, track_gradients=False, verbose=False) as tracker:
        tracker.step(params)
    return arrays


@pytest.mark.parametrize("path", ["auto", "xla"])
def test_the_hook_picks_the_kernel_of_trackers_made_in_its_block(tmp_path, monkeypatch, path):
    """Under ``summary_path("xla")`` no host kernel runs, on the default path on the CPU it
    does (where it can be built); the rows equal the numpy reference either way."""
    if path == "auto" and not _ffi.available():
        pytest.skip("no in-program host kernel on this machine")
    calls: list = []
    real = _ffi._call
    monkeypatch.setattr(_ffi, "_call", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    monkeypatch.delenv("TANDV_JAX_SUMMARY", raising=False)
    with summary_path(path):
        arrays = _step_run(tmp_path / "log")
    assert (len(calls) > 0) == (path == "auto"), calls
    df = read_log(tmp_path / "log")
    for name, x in arrays.items():
        assert_row_matches(df, name, "Weight", 0, x)


def test_the_hook_nests_and_restores(monkeypatch):
    monkeypatch.setenv("TANDV_JAX_SUMMARY", "xla")
    assert current_summary_path() == "xla"
    with summary_path("pallas"):
        assert current_summary_path() == "pallas"
        with pytest.raises(RuntimeError), summary_path("auto"):
            assert current_summary_path() == "auto"
            raise RuntimeError("a failing block restores the path")
        assert current_summary_path() == "pallas"
    assert current_summary_path() == "xla"
    monkeypatch.delenv("TANDV_JAX_SUMMARY")
    assert current_summary_path() == "auto"


def test_unknown_paths_are_refused_naming_the_choices(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"summary_path\('gpu'\): expected one of 'auto'"):
        with summary_path("gpu"):  # type: ignore[arg-type]
            pass
    monkeypatch.setenv("TANDV_JAX_SUMMARY", "fast")
    with pytest.raises(ValueError, match="TANDV_JAX_SUMMARY='fast': expected one of"):
        track(out=tmp_path / "a", verbose=False)
    with summary_path("xla"):  # the hook wins over the environment
        track(out=tmp_path / "b", verbose=False).close()


@pytest.mark.parametrize("path", ["auto", "xla"])
def test_a_gpu_summarizes_small_arrays_with_the_kernels_of_one(path):
    """Lowered for CUDA (where each reduction, scatter and matrix product is a kernel the
    host launches at every call), the summaries of 12 small arrays hold as many of those
    operations as the summaries of 2: they share one block and one batched exponent
    count, on the default path too, where the CPU's host kernel is built but does not
    serve a GPU's arrays (it summarized each array apart: about 18 kernels per array)."""
    import re

    from tandv.stats.summary import Layout
    from tandv.track.jax._kernels import SummaryKernels

    with summary_path(path):
        kernels = SummaryKernels(lambda dtype: Layout(str(jnp.dtype(dtype))), {}, 2, False)
    assert kernels.host_kernel == (path == "auto" and _ffi.available())

    def launched(n: int) -> dict[str, int]:
        arrays = [jax.ShapeDtypeStruct((3 + i, 5), jnp.float32) for i in range(n)]
        text = (
            jax.jit(kernels.summaries, static_argnums=(1, 2))
            .trace(arrays, True, (None,) * n)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        ops = re.findall(r"stablehlo\.(reduce|scatter|dot_general|custom_call)\b", text)
        return {op: ops.count(op) for op in set(ops)}

    two, twelve = launched(2), launched(12)
    assert two == twelve, (two, twelve)
    assert two.get("dot_general", 0) == 1  # the exponent counts of all arrays
