"""Block-scaled formats on the JAX device paths (XLA operations, the Pallas kernel in
interpret mode, the host kernel in the program with XLA's block words) against the numpy
reference: counts and block ranges exactly, sq_err to 1e-6 relative, on crafted tensors
(all-zero blocks, one huge value, subnormal inputs, rounding midpoints, NaN/inf inside a
block, partial last blocks, rows of 1, 31, 32, 33, float32 and bfloat16) and random ones,
by the summary functions and through the tracker's log."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pandas as pd
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from test_blocks import COLS, NAMES, _random_arrays  # noqa: E402

import tandv  # noqa: E402
from tandv.stats.blocks import BLOCK_FORMATS, block_extras, block_stats  # noqa: E402
from tandv.stats.formats import number_format  # noqa: E402
from tandv.stats.summary import Layout, summarize  # noqa: E402
from tandv.track.jax import track  # noqa: E402
from tandv.track.jax._blocks import block_words, tensor_scale  # noqa: E402
from tandv.track.jax._kernels import summary_path  # noqa: E402
from tandv.track.jax._pallas import _format_words, pallas_blocks, pallas_summary  # noqa: E402
from tandv.track.jax._summary import summarize_jax, to_vector  # noqa: E402

FORMATS = [BLOCK_FORMATS[n] for n in NAMES]
_words = jax.jit(lambda x: block_words(x, FORMATS))  # (compiled once per shape and dtype)


def _crafted() -> dict[str, np.ndarray]:
    """The crafted tensors (float32; each is also tested as bfloat16)."""
    f = np.float32
    huge = np.ones((2, 32), f)
    huge[0, 5] = 1024.0
    huge[1, 7] = 3e38  # its error's square is no float32
    zeros = np.zeros((3, 40), f)
    zeros[1, 33:] = [1.5, -2.0, 0.0, 7.0, 1e-3, 0.0, 5.0]  # a row's last block only
    sub = np.full((2, 32), 2.0**-140, f)
    sub[0, 9] = 2.0**-149
    sub[1, :3] = [2.0**-126, 2.0**-133, 3 * 2.0**-149]
    # E4M3 mantissa and subnormal midpoints (amax 256, scale 1), E2M1's (amax 4 and 6),
    # NVFP4's (the tensor's 2688 makes s_t 1, the second row's 6 makes s_b 1)
    mid = np.zeros((3, 16), f)
    # (E5M2's scale is 2**-7 there: 2**-22 is a subnormal element, 3 * 2**-24 a midpoint)
    mid[0, :8] = [
        256.0,
        2.0**-7,
        2.0**-10,
        3 * 2.0**-10,
        1 + 1 / 16,
        1 + 3 / 16,
        2.0**-22,
        3 * 2.0**-24,
    ]
    mid[1, :9] = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25]
    mid[2, :2] = [2688.0, 1.0]
    nonfinite = np.array([[np.nan, np.inf, -np.inf, 256.0, 2.0**-10, -1.0], [np.nan] * 6], f)
    tiny_tensor = np.zeros((2, 32), f)  # NVFP4: s_t is 0 in float32
    tiny_tensor[0, :5] = f(2.0**-149) * np.arange(1, 6)
    tiny_tensor[1, 3] = 2.0**-148
    sat = np.array([[464.0, 1.0, 7.0, 60000.0, 70000.0]], f)
    r = np.random.default_rng(5)
    rows = {
        f"rows_of_{n}": (r.standard_normal((3, n)) * np.exp(r.uniform(-9, 9, (3, 1)))).astype(f)
        for n in (1, 31, 32, 33)
    }
    return {
        "all_zero_blocks": zeros,
        "one_huge_value": huge,
        "subnormal_inputs": sub,
        "midpoints": mid,
        "nan_inf_in_block": nonfinite,
        "nvfp4_tensor_scale_zero": tiny_tensor,
        "saturation": sat,
        "partial_last_block": np.full((2, 45), 3.0, f) * np.arange(45, dtype=f),
        "scalar": np.array(3.7, f),
        **rows,
    }


CRAFTED = _crafted()


def _decoded(ints: object, floats: object, k: int) -> np.ndarray:
    """The columns ``(k formats, 5)`` from block words, by the decoding ``to_vector`` uses."""
    from tandv.track.jax._blocks import decode

    counts = np.concatenate([np.zeros(1, np.int32), np.asarray(ints), [-1 - k]])
    values = np.concatenate([np.zeros(1, np.float32), np.asarray(floats)])
    return decode(counts, values, 1)[1][1:].reshape(k, len(COLS))


def _assert_columns(got: np.ndarray, a: np.ndarray, names: tuple[str, ...], what: object) -> None:
    for name, g in zip(names, got):
        ref = block_stats(a, name)
        for col, value in zip(COLS, g):
            tol = 1e-6 if col == "sq_err" else 0.0
            assert value == pytest.approx(ref[col], rel=tol, abs=0), (what, name, col)


def _as(a: np.ndarray, dtype: str) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else a


def _embedded(a: np.ndarray, shape: tuple[int, int] = (4, 64)) -> np.ndarray:
    """``a`` as rows of ``shape``: each row NaN-padded at its end, NaN rows below. NaN is
    left out of every column and the blocks of a row keep their values (64 is a multiple
    of both block sizes), so the columns are ``a``'s; one shape compiles the interpreted
    kernel once for every case."""
    rows = a.reshape(-1, a.shape[-1] if a.ndim else 1)
    out = np.full(shape, np.nan, a.dtype)
    out[: rows.shape[0], : rows.shape[1]] = rows
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CRAFTED))
def test_xla_crafted(case: str, dtype: str) -> None:
    """Each crafted case embedded in one shape (see :func:`_embedded`): one XLA program per
    dtype, not one per case (~1.8 s each). XLA's own partial blocks and odd shapes (rows of
    1, 31, 33, 100, a scalar, an empty array) are those of ``test_xla_random``."""
    a = _as(CRAFTED[case], dtype)
    e = _embedded(a)
    for name in NAMES:  # the embedding changes nothing (by the reference)
        assert block_stats(e, name) == pytest.approx(block_stats(a, name), rel=1e-12, abs=0)
    ints, floats = _words(jnp.asarray(e))
    _assert_columns(_decoded(ints, floats, len(NAMES)), a, NAMES, (case, dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CRAFTED))
def test_pallas_crafted(case: str, dtype: str) -> None:
    a = _as(CRAFTED[case], dtype)
    e = _embedded(a)
    for name in NAMES:  # the embedding changes nothing (by the reference)
        assert block_stats(e, name) == pytest.approx(block_stats(a, name), rel=1e-12, abs=0)
    mag = np.abs(np.asarray(a, np.float32))
    amax = np.max(np.where(np.isfinite(mag), mag, 0), initial=0)
    st = tensor_scale(jnp.asarray(np.float32(amax).view(np.int32)))
    words = [_format_words(jnp.asarray(e), st, f, True) for f in FORMATS]
    ints = jnp.concatenate([w[0] for w in words])
    floats = jnp.stack([w[1] for w in words])
    _assert_columns(_decoded(ints, floats, len(NAMES)), a, NAMES, (case, dtype))


def test_crafted_cases_reach_every_column() -> None:
    # the crafted tensors exercise every column of every format somewhere (else a
    # column wrongly 0 everywhere would pass)
    total = np.zeros((len(NAMES), len(COLS)))
    for a in CRAFTED.values():
        total += np.array([[block_stats(a, n)[c] for c in COLS] for n in NAMES])
    assert (total > 0).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_xla_random(seed: int) -> None:
    for a in _random_arrays(seed):
        ints, floats = _words(jnp.asarray(a))
        _assert_columns(_decoded(ints, floats, len(NAMES)), a, NAMES, a.shape)


def test_many_arrays_words_equal_the_reference_and_the_program_stays_one_size() -> None:
    # block_words_many: the random arrays' words (float32 and bfloat16, partial blocks,
    # 0-d, empty) equal the numpy reference, computed together; and the program of 12
    # arrays is not 12 programs' size (one per array made it grow with the arrays)
    from tandv.track.jax._blocks import block_words_many

    arrays = _random_arrays(0)
    ints, floats = jax.jit(lambda xs: block_words_many(xs, FORMATS))(
        [jnp.asarray(a) for a in arrays]
    )
    for a, i, f in zip(arrays, np.asarray(ints), np.asarray(floats)):
        _assert_columns(_decoded(i, f, len(NAMES)), a, NAMES, ("many", a.shape))

    def size(k: int) -> int:
        xs = [jnp.zeros((8, 33 + j), jnp.float32) for j in range(k)]  # 24 blocks each
        text = jax.jit(lambda v: block_words_many(v, FORMATS[-1:])).lower(xs).as_text()
        return text.count(" = ")

    one, twelve = size(1), size(12)
    assert twelve < 2 * one, (one, twelve)


def test_summaries_carry_the_columns() -> None:
    # whole summaries (XLA; Pallas in interpret mode): the core fields as without block
    # formats, the columns in the layout's place, moments=4's m3, m4 after them
    a = _random_arrays(2)[10]  # (700, 97) with zeros, NaN, -inf, a wide range per row
    names = ("mxfp4_e2m1", "nvfp4")
    lay = Layout(number_format("float32"), block_extras(names), moments=4)
    want = summarize(a, lay.format, moments=4)[0]
    x = jnp.asarray(a)
    xla = to_vector(jax.device_get(jax.jit(lambda v: summarize_jax(v, lay))(x)))

    def fused(v: jax.Array) -> object:
        core = pallas_summary(v, lay.format, lay.num_counts, interpret=True, moments=4)
        return pallas_blocks(core, v, lay, True)

    pallas = to_vector(jax.device_get(jax.jit(fused)(x)))
    end = lay.extras_start
    for got in (xla, pallas):
        assert got.shape == (lay.size,)
        np.testing.assert_allclose(got[:end], want[:end], rtol=2e-4)
        np.testing.assert_allclose(got[-2:], want[-2:], rtol=2e-3)
        cols = got[end : end + len(names) * len(COLS)].reshape(len(names), len(COLS))
        _assert_columns(cols, a, names, "summary")


def test_float64_refused() -> None:
    lay = Layout(number_format("float32"), block_extras(("nvfp4",)))
    with jax.enable_x64(True):
        x = jnp.ones((4, 32), jnp.float64)
        with pytest.raises(
            NotImplementedError, match="float64.*block_formats|block_formats.*float64"
        ):  # (refused while traced, as in a tracked program: nothing compiled op by op)
            jax.jit(lambda v: summarize_jax(v, lay))(x)


# ------------------------------------------------------------------ through the tracker


def _model_run(tmp_path, formats: tuple[str, ...]) -> tuple[object, dict[str, np.ndarray]]:
    """A two-layer Dense model's tracked step (taps and step() arrays); returns the log and
    the reference arrays by (tensor_type, name)."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            h = nn.Dense(33, name="a")(x)
            return nn.Dense(31, dtype=jnp.bfloat16, name="b")(h)

    model = Net()
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((5, 40)) * 3, jnp.float32)
    params = model.init(jax.random.PRNGKey(0), x)

    def loss(p: object, v: jax.Array) -> jax.Array:
        return jnp.sum(jnp.square(model.apply(p, v).astype(jnp.float32))) / 2

    step = jax.jit(jax.grad(loss))
    with track(
        model_state=params, block_formats=formats, out=tmp_path / "log", verbose=False
    ) as tr:
        grads = tr.intercept(step, params, x)
        tr.step(params, None, grads)
    df = tandv.read_parquet(tmp_path / "log")
    p = params["params"]
    h = nn.Dense(33).apply({"params": p["a"]}, x)
    out = nn.Dense(31, dtype=jnp.bfloat16).apply({"params": p["b"]}, h)
    ref = {
        ("Activation", "a"): np.asarray(h),
        ("Activation", "b"): np.asarray(out),
        ("Gradient", "b"): np.asarray(out),  # d loss / d out = out (bfloat16)
    }
    for path, leaf in jax.tree_util.tree_leaves_with_path(params["params"]):
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        ref[("Weight", name)] = np.asarray(leaf)
    return df, ref


@pytest.mark.parametrize("path", ["auto", "xla", "pallas"])
def test_tracker_rows_equal_reference(path: str, tmp_path) -> None:
    formats = ("mxfp8_e4m3", "nvfp4")
    with summary_path(path):
        df, ref = _model_run(tmp_path, formats)
    assert_rows_equal_reference(df, ref, formats, path)


def assert_rows_equal_reference(
    df: pd.DataFrame, ref: dict[tuple[str, str], np.ndarray], formats: tuple[str, ...], what: object
) -> None:
    """Each row of the log ``df`` named in ``ref`` (by (tensor type, name): the array the
    row summarizes) carries the block formats' columns of the numpy reference, and every
    array of ``ref`` has a row."""
    seen = set()
    for _, row in df.iterrows():
        key = (row.metadata["tensor_type"], row.metadata["name"])
        if key not in ref:
            continue
        got = np.array([[row.scalar_stats[f"{f}.{c}"] for c in COLS] for f in formats])
        _assert_columns(got, ref[key], formats, (what, key))
        seen.add(key)
    assert set(ref) <= seen, set(ref) - seen


def test_many_arrays_without_formats_refused() -> None:
    from tandv.track.jax._blocks import block_words_many

    with pytest.raises(ValueError, match="formats is empty"):
        block_words_many([jnp.ones((2, 32), jnp.float32)], [])
