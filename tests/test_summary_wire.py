"""The summary's wire format (split/join into integer counts and float values, fields by
name) against hand-built vectors, and the inverse of finalize and the grouped merge that
:func:`tandv.analysis.aggregate` is built from, against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
from viz_logs import log_from_arrays

from tandv.stats.formats import number_format
from tandv.stats.summary import (
    CORE_FIELDS,
    VALUE_FIELDS,
    Layout,
    exponent_bins,
    finalize,
    finalize_many,
    join_summary,
    merge_all,
    merge_groups,
    pack_fields,
    pack_parts,
    pack_summary,
    split_summary,
    summarize,
    unfinalize_many,
    unpack_fields,
)

# One summary written out by hand, field by field, in the documented order.
HAND_CORE = {
    "numel": 12.0,
    "nan_count": 1.0,
    "inf_count": 2.0,
    "zero_count": 3.0,
    "min": -4.5,
    "max": 6.25,
    "min_abs": 0.125,
    "max_abs": 6.25,
    "mean": 0.75,
    "m2": 1.5,
    "p1": 2.5,
    "p2": 1.25,
    "p4": 0.5,
    "p8": 0.0625,
}
HAND_COUNTS = [12.0, 1.0, 2.0, 3.0]  # numel, nan_count, inf_count, zero_count
HAND_VALUES = [-4.5, 6.25, 0.125, 6.25, 0.75, 1.5, 2.5, 1.25, 0.5, 0.0625]


def _hand_vector(layout: Layout, seed: float = 0.0) -> tuple[np.ndarray, list, list]:
    """(vector, counts part, values part) of a summary of ``layout`` built by hand: the core
    of HAND_CORE (shifted by ``seed``), exponent counts 100, 101, ..., extras 0.5, 1.5, ..."""
    exp = [100.0 + seed + i for i in range(layout.num_counts)]
    extras = [0.5 + seed + i for i in range(len(layout.extras))]
    counts = [c + seed for c in HAND_COUNTS] + exp
    values = [v + seed for v in HAND_VALUES] + extras
    vector = [c + seed for c in HAND_COUNTS] + [v + seed for v in HAND_VALUES] + exp + extras
    return np.array(vector), counts, values


LAYOUTS = [
    Layout(number_format("float8_e4m3fn")),
    Layout(number_format("float8_e4m3fn"), (("a", "sum"), ("b", "max"))),
    Layout(number_format("bfloat16"), (("c", "mean"),)),
    Layout(number_format("float32")),
    Layout(number_format("float64"), (("d", "min"),)),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda la: f"{la.format.name}+{len(la.extras)}")
def test_split_and_join_a_hand_built_summary(layout):
    v, counts, values = _hand_vector(layout)
    assert v.size == layout.size
    got_counts, got_values = split_summary(v, layout)
    assert got_counts.tolist() == counts
    assert got_values.tolist() == values
    assert np.array_equal(join_summary(np.array(counts), np.array(values)), v)
    assert unpack_fields(v) == HAND_CORE
    assert np.array_equal(
        pack_summary(
            HAND_CORE,
            v[14 : 14 + layout.num_counts],
            v[-len(layout.extras) :] if layout.extras else None,
        ),
        v,
    )
    c, w = pack_parts(
        HAND_CORE, np.array(counts[4:]), np.array(values[10:]) if layout.extras else None
    )
    assert c.tolist() == counts and w.tolist() == values


def test_split_and_join_stacks_of_summaries():
    layout = LAYOUTS[1]
    rows = [_hand_vector(layout, seed) for seed in range(6)]
    stack = np.stack([r[0] for r in rows]).reshape(2, 3, layout.size)
    counts, values = split_summary(stack, layout)
    assert counts.shape == (2, 3, 4 + layout.num_counts)
    assert values.shape == (2, 3, 10 + 2)
    assert counts.reshape(6, -1).tolist() == [r[1] for r in rows]
    assert values.reshape(6, -1).tolist() == [r[2] for r in rows]
    assert np.array_equal(join_summary(counts, values), stack)
    # integer counts and float32 values (the JAX parts) join into the same float64 vectors
    joined = join_summary(counts.astype(np.int32).astype(np.float64), values.astype(np.float32))
    assert joined.dtype == np.float64 and np.array_equal(joined, stack)
    fields = unpack_fields(stack)
    assert fields["p8"].shape == (2, 3)
    assert np.array_equal(pack_fields(fields), stack[..., :14])
    assert np.array_equal(
        pack_fields(unpack_fields(values, VALUE_FIELDS), VALUE_FIELDS), values[..., :10]
    )


def test_layout_free_summaries_take_every_column_after_the_core_as_counts():
    v = np.r_[HAND_COUNTS, HAND_VALUES, [7.0, 8.0, 9.0]]
    counts, values = split_summary(v)
    assert counts.tolist() == [*HAND_COUNTS, 7.0, 8.0, 9.0]
    assert values.tolist() == HAND_VALUES
    assert np.array_equal(join_summary(counts, values), v)


def test_split_rejects_vectors_that_do_not_fit():
    layout = LAYOUTS[1]
    v, _, _ = _hand_vector(layout)
    with pytest.raises(ValueError, match=f"expected {layout.size} values"):
        split_summary(v[:-1], layout)
    with pytest.raises(ValueError, match="at least 14"):
        split_summary(v[:13])
    with pytest.raises(ValueError, match="at least 4 and 10"):
        join_summary(np.zeros(3), np.zeros(10))
    with pytest.raises(ValueError, match=r"missing fields \['p8'\], unknown fields \['p9'\]"):
        pack_fields({**{k: 1.0 for k in CORE_FIELDS if k != "p8"}, "p9": 1.0})


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "float16", "float8_e5m2", "float64"])
def test_split_of_reference_summaries_in_each_format(fmt):
    rng = np.random.default_rng(3)
    x = np.r_[rng.standard_normal(200) * 100, 0.0, np.nan, np.inf, 1e-30].astype(
        np.float64 if fmt == "float64" else np.float32
    )
    v, layout = summarize(x, fmt, extras={"e": (2.5, "sum")})
    counts, values = split_summary(v, layout)
    assert counts[:4].tolist() == [x.size, 1, 1, int(np.sum(x == 0))]
    assert np.array_equal(counts[4:], exponent_bins(x, fmt))
    finite = x[np.isfinite(x)].astype(np.float64)
    assert values[:4].tolist() == [
        finite.min(),
        finite.max(),
        np.abs(finite).min(),
        np.abs(finite).max(),
    ]
    assert values[-1] == 2.5 and values.size == 11


def test_split_and_join_on_torch_and_jax_arrays_match_numpy():
    layout = LAYOUTS[2]
    stack = np.stack([_hand_vector(layout, s)[0] for s in range(3)])
    want_c, want_v = split_summary(stack, layout)
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(stack)
    tc, tv = split_summary(t, layout)
    assert isinstance(tc, torch.Tensor)
    assert np.array_equal(tc.numpy(), want_c) and np.array_equal(tv.numpy(), want_v)
    assert torch.equal(join_summary(tc, tv), t)
    assert torch.equal(pack_fields(unpack_fields(t)), t[:, :14])
    jnp = pytest.importorskip("jax.numpy")
    jax = pytest.importorskip("jax")
    j = jnp.asarray(stack.astype(np.float32))
    jc, jv = jax.jit(lambda a: split_summary(a, layout))(j)
    assert np.array_equal(np.asarray(jc), want_c.astype(np.float32))
    assert np.array_equal(np.asarray(jv), want_v.astype(np.float32))
    assert np.array_equal(np.asarray(jax.jit(join_summary)(jc, jv)), stack.astype(np.float32))


def test_the_compiled_split_matches_split_summary():
    from tandv.stats.host import split_serial

    layout = Layout(number_format("float16"))
    v, counts, values = _hand_vector(layout)
    c = np.zeros(len(counts), np.int32)
    w = np.zeros(len(values), np.float32)
    split_serial(v, c, w)
    want_c, want_v = split_summary(v, layout)
    assert np.array_equal(c, want_c.astype(np.int32)) and np.array_equal(
        w, want_v.astype(np.float32)
    )


# ----------------------------------------------------- inverse of finalize, grouped merge


def _random_arrays(seed: int) -> list[np.ndarray]:
    """Arrays of many kinds: scales from 1e-30 to 1e30, means far from zero, zeros, NaN
    and inf, all non-finite, a single value, empty, all zero, subnormal float32 values."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(12):
        n = int(rng.integers(1, 300))
        x = rng.standard_normal(n) * 10.0 ** float(rng.integers(-30, 30))
        x += float(rng.choice([0.0, 0.0, 1e3])) * np.abs(x).max()
        x[rng.random(n) < 0.1] = 0.0
        if rng.random() < 0.3:
            x[rng.integers(0, n)] = rng.choice([np.nan, np.inf, -np.inf])
        out.append(x.astype(np.float32))
    out += [
        np.array([np.nan, np.inf, -np.inf], np.float32),
        np.array([2.5], np.float32),
        np.zeros(0, np.float32),
        np.zeros(7, np.float32),
        np.array([1e-45, -3e-44, 2e-40], np.float32),
    ]
    return out


def _stack(arrays, extras_of=None):
    vs, layout = [], None
    for i, x in enumerate(arrays):
        v, layout = summarize(x, "float32", extras_of(i, x) if extras_of else None)
        vs.append(v)
    return np.stack(vs), layout


RULES = {"s": "sum", "lo": "min", "hi": "max", "avg": "mean"}


def _extras(i: int, x: np.ndarray) -> dict:
    return {k: (float(i) * 1.5 - 4.0 + j, rule) for j, (k, rule) in enumerate(RULES.items())}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unfinalize_inverts_finalize(seed):
    v, layout = _stack(_random_arrays(seed), _extras)
    stats, counts = finalize_many(v, layout)
    back = unfinalize_many(stats, counts, layout)
    assert back.shape == v.shape
    exact = [*range(8), *range(layout.counts_start, layout.size)]  # counts, extrema, extras
    assert np.array_equal(back[:, exact], v[:, exact])
    np.testing.assert_allclose(back, v, rtol=1e-13, atol=0)
    # layout-free: the exponent counts as given, no extras
    free = unfinalize_many(stats, counts)
    assert np.array_equal(free[:, : layout.extras_start], back[:, : layout.extras_start])
    assert free.shape[1] == layout.extras_start


def test_unfinalize_names_what_it_lacks():
    v, layout = _stack(_random_arrays(0)[:3], _extras)
    stats, counts = finalize_many(v, layout)
    with pytest.raises(ValueError, match=r"no statistics \['rm4', 'avg'\]"):
        unfinalize_many({k: a for k, a in stats.items() if k not in ("rm4", "avg")}, counts, layout)
    with pytest.raises(ValueError, match="the layout has"):
        unfinalize_many(stats, counts[:, 1:], layout)
    with pytest.raises(ValueError, match="'mean' has 2 values for 3 rows"):
        unfinalize_many({**stats, "mean": stats["mean"][:2]}, counts, layout)


def test_merge_groups_equals_pairwise_merges():
    v, layout = _stack(_random_arrays(4), _extras)
    rng = np.random.default_rng(5)
    groups = rng.integers(0, 4, len(v))
    groups[:3] = [0, 1, 2]
    merged = merge_groups(v, groups, layout, num_groups=5)
    for g in range(5):
        want = merge_all([v[i] for i in np.flatnonzero(groups == g)], layout)
        exact = [*range(8), *range(layout.counts_start, layout.extras_start)]
        assert np.array_equal(merged[g, exact], want[exact]), g
        np.testing.assert_allclose(merged[g], want, rtol=1e-12, atol=1e-300)
    assert np.array_equal(merged[4], layout.empty())  # a group without rows
    with pytest.raises(ValueError, match=r"lie in \[0, 2\)"):
        merge_groups(v, groups, layout, num_groups=2)
    with pytest.raises(ValueError, match="one integer per row"):
        merge_groups(v, groups[:-1], layout)


def test_merged_inverted_rows_equal_the_reference_of_the_concatenation():
    arrays = _random_arrays(6)
    v, layout = _stack(arrays)
    back = unfinalize_many(*finalize_many(v, layout), layout)
    merged = merge_groups(back, np.zeros(len(v), np.int64), layout)[0]
    want = summarize(np.concatenate(arrays), "float32")[0]
    exact = [*range(8), *range(layout.counts_start, layout.extras_start)]
    assert np.array_equal(merged[exact], want[exact])
    np.testing.assert_allclose(merged, want, rtol=1e-9, atol=0)


def test_aggregate_equals_the_reference_summary_of_the_concatenated_tensors():
    from tandv.analysis import aggregate

    arrays = _random_arrays(7)
    entries = {(f"layer{i}.w", "Weight", 0): x for i, x in enumerate(arrays)}
    entries[("other", "Weight", 0)] = np.array([np.nan, np.nan], np.float32)  # no finite value
    df = log_from_arrays(entries)
    agg = aggregate(df, groups={"model": "^layer", "other": "^other"})
    rows = {r[("metadata", "name")]: r for _, r in agg.iterrows()}
    want, counts = finalize(*summarize(np.concatenate(arrays), "float32"))
    got = rows["model"]["scalar_stats"]
    for k, value in want.items():
        if isinstance(value, int):
            assert got[k] == value, k
        else:
            assert got[k] == pytest.approx(value, rel=1e-9, abs=0), k
    labels = ["-inf", *number_format("float32").exponents, "+inf"]
    logged = rows["model"]["exponent_counts"]
    assert [int(logged.get(lab, 0)) for lab in labels] == counts.tolist()
    other = rows["other"]["scalar_stats"]
    assert (other["numel"], other["nan_count"], other["tensors"]) == (2, 2, 1)
    assert np.isnan([other[k] for k in ("mean", "std", "min", "max", "rm8")]).all()
