"""validate(): one test per rule, each asserting the message; and pickle/parquet IO."""

import pickle
import re

import numpy as np
import pandas as pd
import pytest
from logs import make_log

import tandv
from tandv.schema import (
    SchemaError,
    read_parquet,
    read_pickle,
    validate,
    write_parquet,
    write_pickle,
)
from tandv.track.common import read_pickle as seed_read_pickle


def good() -> pd.DataFrame:
    """A minimal valid log, built by hand."""
    cols = pd.MultiIndex.from_tuples(
        [
            ("metadata", "name"),
            ("metadata", "type"),
            ("metadata", "tensor_type"),
            ("metadata", "step"),
            ("metadata", "dtype"),
            ("scalar_stats", "rm2"),
            ("exponent_counts", "-inf"),
            ("exponent_counts", -3),
            ("exponent_counts", 0),
            ("exponent_counts", "+inf"),
        ]
    )
    return pd.DataFrame(
        [
            ["l0", "Linear", "Weight", 0, "float32", 1.5, 0, 2, 1, 0],
            ["l0", "Linear", "Gradient", 0, "bfloat16", 0.5, 1, 0, 3, 0],
        ],
        columns=cols,
    ).astype({("metadata", "step"): "int64"})


def test_good_log_is_valid_and_returned():
    df = good()
    assert validate(df) is df


def test_not_a_dataframe():
    with pytest.raises(SchemaError, match="a log is a pandas DataFrame; found dict"):
        validate({})


def test_flat_columns_rejected():
    with pytest.raises(SchemaError, match="expected a 2-level MultiIndex.*found 1 level"):
        validate(pd.DataFrame({"name": ["x"]}))


def test_unknown_top_level_group():
    df = good()
    df[("extras", "note")] = "x"
    with pytest.raises(SchemaError, match="unknown top-level group 'extras'"):
        validate(df)


def test_missing_metadata_column():
    with pytest.raises(SchemaError, match=r"missing column\(s\) \('metadata', 'dtype'\)"):
        validate(good().drop(columns=[("metadata", "dtype")]))


def test_extra_metadata_column():
    df = good()
    df[("metadata", "run")] = "r1"
    with pytest.raises(SchemaError, match=r"unexpected column\(s\) \('metadata', 'run'\)"):
        validate(df)


def test_metadata_strings_required():
    df = good()
    df[("metadata", "name")] = pd.Series([1, 2], dtype=object)
    with pytest.raises(SchemaError, match=r"\('metadata', 'name'\): expected str values; found 1"):
        validate(df)


def test_step_must_be_integer():
    df = good()
    df[("metadata", "step")] = [0.0, 1.5]
    with pytest.raises(
        SchemaError,
        match=r"\('metadata', 'step'\): expected an integer dtype of steps; "
        r"found float64, holding 1.5 at row 1",
    ):
        validate(df)


def test_step_must_be_non_negative():
    df = good()
    df[("metadata", "step")] = np.array([0, -1], dtype=np.int64)
    with pytest.raises(
        SchemaError, match=r"expected non-negative steps; found -1 \(first at row 1, dtype int64\)$"
    ):
        validate(df)


def test_unknown_tensor_type():
    df = good()
    df[("metadata", "tensor_type")] = ["Weight", "Activations"]
    with pytest.raises(
        SchemaError, match=r"tensor_type'\): expected one of .*Optimiser_State.*found 'Activations'"
    ):
        validate(df)


def test_dtype_must_parse_with_ml_dtypes():
    df = good()
    df[("metadata", "dtype")] = ["float32", "int8"]
    with pytest.raises(
        SchemaError, match="'int8' is not a floating-point dtype name that ml_dtypes.finfo"
    ):
        validate(df)


def test_needs_a_scalar_stat():
    with pytest.raises(
        SchemaError, match="expected at least one scalar statistic column; found none"
    ):
        validate(good().drop(columns=[("scalar_stats", "rm2")]))


def test_scalar_stat_must_be_numeric():
    df = good()
    df[("scalar_stats", "rm2")] = ["a", "b"]
    with pytest.raises(SchemaError, match=r"\('scalar_stats', 'rm2'\): expected a numeric"):
        validate(df)


@pytest.mark.parametrize("label", ["-inf", "+inf"])
def test_infinity_columns_required(label):
    with pytest.raises(SchemaError, match=rf"\('exponent_counts', '\{label}'\): missing"):
        validate(good().drop(columns=[("exponent_counts", label)]))


def test_exponent_labels_must_be_integers():
    df = good()
    df[("exponent_counts", "7")] = 0
    with pytest.raises(SchemaError, match="column labels must be integer exponents.*found '7'"):
        validate(df)


def test_exponent_counts_non_negative():
    df = good()
    df[("exponent_counts", 0)] = [1, -2]
    with pytest.raises(SchemaError, match=r"\('exponent_counts', 0\): expected counts >= 0"):
        validate(df)


def test_exponent_counts_integer_dtype():
    df = good()
    df[("exponent_counts", -3)] = [0.5, 1.0]
    with pytest.raises(
        SchemaError,
        match=r"\('exponent_counts', -3\): expected an integer dtype of counts; found float64",
    ):
        validate(df)


def test_duplicate_rows():
    df = good()
    df[("metadata", "tensor_type")] = ["Weight", "Weight"]
    with pytest.raises(
        SchemaError, match=r"duplicate rows for \(name, tensor_type, step\) = \('l0', 'Weight', 0\)"
    ):
        validate(df)


# ------------------------------------------------------------------ IO


def test_parquet_round_trip_exact(tmp_path):
    df = good()
    write_parquet(df, tmp_path / "x.parquet")
    back = read_parquet(tmp_path / "x.parquet")
    pd.testing.assert_frame_equal(back, df, check_dtype=False)
    labels = list(back["exponent_counts"].columns)
    assert labels == ["-inf", -3, 0, "+inf"]
    assert all(type(l) is int for l in labels[1:-1])
    assert back[("metadata", "step")].dtype == np.int64
    assert all(back[c].dtype == np.int64 for c in back.columns if c[0] == "exponent_counts")


def test_pickle_round_trip_and_seed_import(tmp_path):
    df = good()
    write_pickle(df, tmp_path / "x.pkl")
    for reader in (read_pickle, seed_read_pickle, tandv.read_pickle):
        pd.testing.assert_frame_equal(reader(tmp_path / "x.pkl"), df)


def test_readers_validate(tmp_path):
    bad = good().drop(columns=[("exponent_counts", "+inf")])
    bad.to_pickle(tmp_path / "bad.pkl")
    with pytest.raises(SchemaError, match="missing"):
        read_pickle(tmp_path / "bad.pkl")
    with open(tmp_path / "notlog.pkl", "wb") as f:
        pickle.dump({"a": 1}, f)
    with pytest.raises(SchemaError, match="found dict"):
        read_pickle(tmp_path / "notlog.pkl")
    with pytest.raises(FileNotFoundError, match="no log file"):
        read_parquet(tmp_path / "missing.parquet")


def test_parquet_directory_of_parts_with_different_exponents(tmp_path):
    df, arrays = make_log(tmp_path / "log", steps=4, flush_every=1)
    parts = sorted((tmp_path / "log").glob("*.parquet"))
    assert len(parts) == 4
    # each part holds only its own non-empty exponents; missing ones read back as 0
    per_part = [set(pd.read_parquet(p).columns) for p in parts]
    assert per_part[0] != per_part[3]
    assert list(df[("metadata", "step")]) == sorted(df[("metadata", "step")])
    for (name, tt, step), x in arrays.items():
        row = df[
            (df[("metadata", "name")] == name)
            & (df[("metadata", "tensor_type")] == tt)
            & (df[("metadata", "step")] == step)
        ]
        a = np.abs(x.astype(np.float64))
        a = a[np.isfinite(a) & (a > 0)]
        exps, n = np.unique(np.floor(np.log2(a)).astype(int), return_counts=True)
        counts = row["exponent_counts"].iloc[0]
        assert counts.sum() == a.size
        for e, c in zip(exps, n):
            assert counts[int(e)] == c


def test_parquet_column_selection_and_filters(tmp_path):
    df, _ = make_log(tmp_path / "log", steps=4)
    sub = read_parquet(
        tmp_path / "log",
        columns=["rm2", -1],
        filters=[("step", ">=", 2), ("tensor_type", "==", "Weight")],
    )
    assert set(sub[("metadata", "step")]) == {2, 3}
    assert set(sub[("metadata", "tensor_type")]) == {"Weight"}
    assert list(sub["scalar_stats"].columns) == ["rm2"]
    assert list(sub["exponent_counts"].columns) == ["-inf", -1, "+inf"]
    full = df[(df[("metadata", "step")] >= 2) & (df[("metadata", "tensor_type")] == "Weight")]
    np.testing.assert_allclose(sub[("scalar_stats", "rm2")], full[("scalar_stats", "rm2")])


def test_parquet_rejects_non_log(tmp_path):
    pd.DataFrame({"x": [1]}).to_parquet(tmp_path / "other.parquet")
    with pytest.raises(SchemaError, match="is not a tandv log"):
        read_parquet(tmp_path / "other.parquet")
    (tmp_path / "junk.parquet").write_text("hello")
    with pytest.raises(SchemaError, match="not a readable parquet file"):
        read_parquet(tmp_path / "junk.parquet")


# ------------------------------------------------------------------ strict validate (issue 15)


def test_null_metadata_strings_are_rejected():
    for col in ("name", "type"):
        df = good()
        df[("metadata", col)] = pd.Series(["a", np.nan], dtype="str")
        with pytest.raises(
            SchemaError,
            match=rf"\('metadata', '{col}'\): expected str values \(no missing value\); "
            r"found <NA> \(first at row 1",
        ):
            validate(df)
    df = good()
    df[("metadata", "name")] = pd.Series(["a", None], dtype=object)
    with pytest.raises(
        SchemaError,
        match=r"\('metadata', 'name'\): expected str values; found None \(first at row 1",
    ):
        validate(df)


def test_nullable_step_with_missing_value_is_rejected():
    df = good()
    df[("metadata", "step")] = pd.array([0, None], dtype="Int64")
    with pytest.raises(
        SchemaError,
        match=r"\('metadata', 'step'\): expected steps \(no missing value\); found <NA> "
        r"\(first at row 1, dtype Int64\)",
    ):
        validate(df)
    df[("metadata", "step")] = pd.array([0, 1], dtype="Int64")  # no missing value: a valid log
    assert validate(df) is df


def test_nullable_exponent_count_with_missing_value_is_a_schema_error():
    df = good()
    df[("exponent_counts", 0)] = pd.array([1, None], dtype="Int64")
    with pytest.raises(
        SchemaError,
        match=r"\('exponent_counts', 0\): expected counts \(no missing value\); found <NA> "
        r"\(first at row 1",
    ):
        validate(df)


def test_categorical_metadata_is_a_schema_error():
    df = good()
    df[("metadata", "type")] = df[("metadata", "type")].astype("category")
    with pytest.raises(
        SchemaError,
        match=r"\('metadata', 'type'\): expected str values; found a categorical column; "
        r"convert it with .astype\(str\)",
    ):
        validate(df)


@pytest.mark.parametrize(
    "values, found",
    [([1.0, np.nan], "nan at row 1"), ([2.7, 1.0], "2.7 at row 0"), ([1.0, 3.0], "; convert")],
)
def test_float_counts_name_the_bad_value(values, found):
    df = good()
    df[("exponent_counts", 0)] = values
    with pytest.raises(
        SchemaError,
        match=rf"\('exponent_counts', 0\): expected an integer dtype of counts; found "
        rf"float64.*{found}",
    ):
        validate(df)


# ------------------------------------------------------------------ the fuzzer

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_ODD_VALUES = [
    None,
    np.nan,
    pd.NA,
    -1,
    2.7,
    1.5,
    "abc",
    "",
    b"x",
    [1],
    np.inf,
    True,
    2**70,
    -0.0,
    "Weight",
    0,
]
_ODD_DTYPES = [
    "category",
    "Int64",
    "Float64",
    "str",
    "object",
    "float64",
    "bool",
    "uint8",
    "int32",
    "boolean",
]
_ODD_LABELS = ["abc", 1.5, "7", None, ("x",), np.int64(9), True, "-inf", -3]


def _fuzz_base() -> pd.DataFrame:
    df = good()
    df[("scalar_stats", "numel")] = np.array([4, 4], dtype=np.int64)
    return df[
        pd.MultiIndex.from_tuples(
            [c for c in df.columns if c[0] == "metadata"]
            + [("scalar_stats", "rm2"), ("scalar_stats", "numel")]
            + [c for c in df.columns if c[0] == "exponent_counts"]
        )
    ]


@st.composite
def mutated_logs(draw):
    df = _fuzz_base()
    cols = list(df.columns)
    touched = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["value", "dtype", "label", "drop", "duplicate_row", "add"]))
        col = draw(st.sampled_from(cols))
        if col not in df.columns:
            continue
        if kind == "value":
            v = draw(st.sampled_from(_ODD_VALUES))
            s = df[col].astype(object)
            s.iloc[draw(st.integers(0, len(df) - 1))] = v
            try:
                df[col] = s.infer_objects() if draw(st.booleans()) else s
            except (TypeError, ValueError, OverflowError):
                continue
        elif kind == "dtype":
            try:
                df[col] = df[col].astype(draw(st.sampled_from(_ODD_DTYPES)))
            except (TypeError, ValueError, OverflowError):
                continue
        elif kind == "label":
            new = (col[0], draw(st.sampled_from(_ODD_LABELS)))
            if new in df.columns:
                continue
            df.columns = pd.MultiIndex.from_tuples([new if c == col else c for c in df.columns])
            col = new
        elif kind == "drop":
            df = df.drop(columns=[col])
        elif kind == "duplicate_row":
            df = pd.concat([df, df.iloc[:1]], ignore_index=True)
        else:
            group = draw(st.sampled_from(["metadata", "scalar_stats", "exponent_counts", "other"]))
            col = (group, draw(st.sampled_from(["x", 5, "numel2"])))
            if col in df.columns:
                continue
            df[col] = (
                draw(st.sampled_from([[0, 1], [0.5, 1.0], ["a", "b"]]))[:1] * len(df)
                if len(df) != 2
                else draw(st.sampled_from([[0, 1], [0.5, 1.0], ["a", "b"]]))
            )
        touched.append((kind, col))
    return df, touched


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_logs())
def test_fuzzed_logs_are_accepted_and_round_trip_or_rejected_with_a_schema_error(
    tmp_path_factory, case
):
    """Mutations of a valid log: validate accepts the frame (and then the parquet writer
    and reader give back the same values) or raises SchemaError, and nothing else; the
    message names a column or the frame's structure."""
    df, touched = case
    try:
        validate(df)
    except SchemaError as e:
        msg = str(e)
        assert re.match(
            r"\(|'(metadata|scalar_stats|exponent_counts)'|columns:|metadata:|a log is", msg
        ), msg
        return
    path = tmp_path_factory.mktemp("fuzz") / "x.parquet"
    write_parquet(df, path)
    back = read_parquet(path)
    assert list(back.columns) == tandv.schema.io.canonical_columns(df.columns)
    for c in df.columns:
        a, b = df[c].to_numpy(dtype=object), back[c].to_numpy(dtype=object)
        assert all((x == y) or (x != x and y != y) for x, y in zip(a, b)), (c, a, b)


# ------------------------------------------------------------------ strict readers (issue 15)

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from tandv.schema.io import seal_part  # noqa: E402


def _write_raw(path, **overrides):
    """A parquet file laid out like a log part, with some flat columns replaced."""
    cols = {
        "metadata.name": pa.array(["a", "b"]),
        "metadata.type": pa.array(["L", "L"]),
        "metadata.tensor_type": pa.array(["Weight", "Weight"]),
        "metadata.step": pa.array([0, 0]),
        "metadata.dtype": pa.array(["float32", "float32"]),
        "scalar_stats.rm2": pa.array([1.0, 2.0]),
        "exponent_counts.-inf": pa.array([0, 0]),
        "exponent_counts.0": pa.array([3, 4]),
        "exponent_counts.+inf": pa.array([0, 0]),
    }
    cols.update(overrides)
    table = pa.table({k: v for k, v in cols.items() if v is not None})
    pq.write_table(seal_part(table), path)
    return path


@pytest.mark.parametrize(
    "values, found, row",
    [([1.0, float("nan")], "nan", 1), ([2.7, 1.0], "2.7", 0), ([1.0, -2.0], "-2.0", 1)],
)
def test_read_parquet_rejects_stored_non_counts_naming_file_column_row(
    tmp_path, values, found, row
):
    path = _write_raw(tmp_path / "p.parquet", **{"exponent_counts.0": pa.array(values)})
    with pytest.raises(
        SchemaError,
        match=rf"p\.parquet', column 'exponent_counts\.0', row {row}: expected a whole "
        rf"count >= 0; found {found}",
    ):
        read_parquet(path)


def test_read_parquet_rejects_negative_and_null_integer_counts(tmp_path):
    _write_raw(tmp_path / "part-0.parquet", **{"exponent_counts.0": pa.array([3, -4])})
    with pytest.raises(
        SchemaError,
        match=r"part-0\.parquet', column 'exponent_counts\.0', row 1: expected a count >= 0; "
        r"found -4",
    ):
        read_parquet(tmp_path)
    d = tmp_path / "nulls"
    d.mkdir()
    _write_raw(d / "part-0.parquet", **{"exponent_counts.5": None})  # absent: zeros
    _write_raw(
        d / "part-1.parquet",
        **{"metadata.step": pa.array([1, 1]), "exponent_counts.5": pa.array([2, None], pa.int64())},
    )
    with pytest.raises(
        SchemaError,
        match=r"part-1\.parquet', column 'exponent_counts\.5', row 1: expected a count; "
        r"found a missing value",
    ):
        read_parquet(d)


@pytest.mark.parametrize("label", ["abc", "1.5"])
def test_read_parquet_rejects_non_integer_exponent_labels(tmp_path, label):
    path = _write_raw(tmp_path / "p.parquet", **{f"exponent_counts.{label}": pa.array([0, 0])})
    with pytest.raises(
        SchemaError,
        match=rf"column 'exponent_counts\.{re.escape(label)}': exponent labels must be "
        r"integers",
    ):
        read_parquet(path)


def test_missing_exponent_columns_are_zero_only_where_absent(tmp_path):
    _write_raw(tmp_path / "part-0.parquet", **{"exponent_counts.5": None})
    _write_raw(
        tmp_path / "part-1.parquet",
        **{"metadata.step": pa.array([1, 1]), "exponent_counts.5": pa.array([2, 0])},
    )
    df = read_parquet(tmp_path)
    assert list(df[("exponent_counts", 5)]) == [0, 0, 2, 0]
    assert df[("exponent_counts", 5)].dtype == np.int64


def test_filters_on_an_exponent_column_some_parts_lack(tmp_path):
    df, _ = make_log(tmp_path / "log", steps=4, flush_every=1)
    per_part = [set(pq.read_schema(p).names) for p in sorted((tmp_path / "log").glob("*.parquet"))]
    label = next(
        int(n.split(".", 1)[1])
        for n in sorted(set.union(*per_part) - set.intersection(*per_part))
        if n.split(".", 1)[1].lstrip("-").isdigit()
    )
    counts = df[("exponent_counts", label)]
    for op, value, keep in ((">", 0, counts > 0), ("==", 0, counts == 0)):
        sub = read_parquet(tmp_path / "log", filters=[(label, op, value)])
        expected = df[keep.to_numpy()].reset_index(drop=True)
        assert 0 < len(sub) < len(df)
        pd.testing.assert_frame_equal(sub, expected[sub.columns], check_dtype=False)


def test_exponent_columns_alone_give_a_valid_log(tmp_path):
    df, _ = make_log(tmp_path / "log", steps=4)
    label = next(c for g, c in df.columns if g == "exponent_counts" and c not in ("-inf", "+inf"))
    sub = read_parquet(tmp_path / "log", columns=[label])
    assert list(sub.columns) == [c for c in df.columns if c[0] == "metadata"] + [
        ("scalar_stats", "numel"),
        ("exponent_counts", "-inf"),
        ("exponent_counts", label),
        ("exponent_counts", "+inf"),
    ]
    pd.testing.assert_frame_equal(sub, df[sub.columns])
    with pytest.raises(SchemaError, match=r"no column \('scalar_stats', 'nope'\) in the log"):
        read_parquet(tmp_path / "log", columns=["nope"])


def test_step_filter_reads_only_matching_parts_and_chunks_agree(tmp_path):
    df, _ = make_log(tmp_path / "log", steps=4, flush_every=1)
    sub = read_parquet(tmp_path / "log", filters=[("step", ">=", 3)])
    pd.testing.assert_frame_equal(
        sub,
        df[df[("metadata", "step")] >= 3].reset_index(drop=True)[sub.columns],
        check_dtype=False,
    )
    # row-group statistics let the scan skip the other parts without decoding them: a
    # damaged page in an excluded part goes unnoticed by the filtered read only
    first = sorted((tmp_path / "log").glob("*.parquet"))[0]
    raw = bytearray(first.read_bytes())
    raw[40:48] = b"\xff" * 8
    first.write_bytes(bytes(raw))
    pd.testing.assert_frame_equal(read_parquet(tmp_path / "log", filters=[("step", ">=", 3)]), sub)
    with pytest.raises(SchemaError, match=rf"{first.name}': damaged part"):
        read_parquet(tmp_path / "log")
    first.unlink()
    chunks = list(tandv.schema.read_parquet_chunks(tmp_path / "log", chunk_rows=5))
    assert all(len(c) >= 5 for c in chunks[:-1]) and len(chunks) > 1
    rest = df[df[("metadata", "step")] >= 1].reset_index(drop=True)
    got = tandv.schema.concat_logs(chunks)
    pd.testing.assert_frame_equal(got, rest[got.columns], check_dtype=False)
    assert (
        (rest[[c for c in rest.columns if c not in got.columns]] == 0).all().all()
    )  # only part 0 had them


def test_chunks_detect_duplicates_across_chunks(tmp_path):
    _write_raw(tmp_path / "part-0.parquet")
    _write_raw(tmp_path / "part-1.parquet")
    with pytest.raises(
        SchemaError, match=r"duplicate rows for \(name, tensor_type, step\) = \('a', 'Weight', 0\)"
    ):
        list(tandv.schema.read_parquet_chunks(tmp_path, chunk_rows=2))
    with pytest.raises(SchemaError, match=r"part-1\.parquet', row 0: metadata: duplicate rows"):
        read_parquet(tmp_path)


def test_damaged_pages_are_reported_never_read_as_data(tmp_path):
    """Flip one byte at many places in the data pages of a part written by tandv (its
    footer intact): every read either raises SchemaError naming the part or gives back
    exactly the original log."""
    df, _ = make_log(tmp_path / "log", steps=2)
    part = next((tmp_path / "log").glob("*.parquet"))
    raw = part.read_bytes()
    footer_len = int.from_bytes(raw[-8:-4], "little")
    data_end = len(raw) - 8 - footer_len
    raised = 0
    for offset in range(4, data_end, max(1, (data_end - 4) // 150)):
        bad = bytearray(raw)
        bad[offset] ^= 0xFF
        target = tmp_path / "bad" / part.name
        target.parent.mkdir(exist_ok=True)
        target.write_bytes(bytes(bad))
        try:
            back = read_parquet(target.parent)
        except SchemaError as e:
            assert str(target) in str(e)
            raised += 1
        else:
            pd.testing.assert_frame_equal(back, df)
    assert raised > 50


def test_duckdb_reads_our_parts(tmp_path):
    duckdb = pytest.importorskip("duckdb")
    df, _ = make_log(tmp_path / "log", steps=4, flush_every=1)
    got = duckdb.sql(
        f"""SELECT "metadata.name" AS name, "metadata.tensor_type" AS tt, "metadata.step" AS step,
                   "scalar_stats.rm2" AS rm2, coalesce("exponent_counts.-1", 0) AS e
            FROM read_parquet('{tmp_path / "log"}/*.parquet', union_by_name = true)
            ORDER BY step, name, tt"""
    ).df()
    m = df["metadata"]
    ref = pd.DataFrame(
        {
            "name": m["name"],
            "tt": m["tensor_type"],
            "step": m["step"],
            "rm2": df[("scalar_stats", "rm2")],
            "e": df[("exponent_counts", -1)],
        }
    )
    ref = ref.sort_values(["step", "name", "tt"]).reset_index(drop=True)
    pd.testing.assert_frame_equal(got, ref, check_dtype=False)


def test_frames_read_are_ordinary_editable_frames(tmp_path):
    """The reader hands its arrays to pandas without copying them; the frame must still be
    an ordinary one that users can edit in place."""
    df, _ = make_log(tmp_path / "log", steps=3, flush_every=1)
    for back in (
        read_parquet(tmp_path / "log"),
        read_parquet(tmp_path / "log", filters=[("step", ">=", 1)]),
        next(tandv.schema.read_parquet_chunks(tmp_path / "log")),
    ):
        back.loc[back.index[0], ("scalar_stats", "rm2")] = 5.0
        back[("exponent_counts", "-inf")] += 1
        assert back[("scalar_stats", "rm2")].iloc[0] == 5.0
        assert (back[("exponent_counts", "-inf")] >= 1).all()


# ------------------------------------------------------------------ no silent misreads (issue 30)


@pytest.mark.parametrize("label", ["07", "0012", "-0", "+3", "-03"])
def test_exponent_labels_only_in_the_writers_spelling(tmp_path, label):
    """`exponent_counts.07` is not the column 7 (nor 0012 the 12, -0 the 0): refused,
    naming the file and the column, by read_parquet and `tandv validate`."""
    from tandv.cli import main

    path = _write_raw(tmp_path / "p.parquet", **{f"exponent_counts.{label}": pa.array([5, 5])})
    with pytest.raises(
        SchemaError,
        match=rf"p\.parquet', column 'exponent_counts\.{re.escape(label)}': exponent labels "
        r"must be integers as tandv writes them",
    ):
        read_parquet(path)
    assert main(["validate", str(path)]) == 1


def test_a_column_twice_in_a_part_is_refused(tmp_path):
    table = pa.Table.from_arrays(
        [
            pa.array(["a"]),
            pa.array(["L"]),
            pa.array(["Weight"]),
            pa.array([0]),
            pa.array(["float32"]),
            pa.array([1.0]),
            pa.array([0]),
            pa.array([1]),
            pa.array([2]),
            pa.array([0]),
        ],
        names=[
            "metadata.name",
            "metadata.type",
            "metadata.tensor_type",
            "metadata.step",
            "metadata.dtype",
            "scalar_stats.rm2",
            "exponent_counts.-inf",
            "exponent_counts.-3",
            "exponent_counts.-3",
            "exponent_counts.+inf",
        ],
    )
    pq.write_table(seal_part(table), tmp_path / "p.parquet")
    with pytest.raises(
        SchemaError, match=r"p\.parquet', column 'exponent_counts\.-3': the column appears twice"
    ):
        read_parquet(tmp_path / "p.parquet")


@pytest.mark.parametrize("version", [b"3", b"0", b"999", None])
def test_unknown_log_versions_are_refused(tmp_path, version):
    path = _write_raw(tmp_path / "p.parquet")
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    if version is None:
        del meta[b"tandv.log"]
        match = r"p\.parquet' is not a tandv log: it is not marked as one"
    else:
        meta[b"tandv.log"] = version
        match = (
            rf"p\.parquet': log format version '{version.decode()}'; this tandv reads "
            rf"versions 1 and 2"
        )
    pq.write_table(table.replace_schema_metadata(meta), path)
    with pytest.raises(SchemaError, match=match):
        read_parquet(path)


def test_version_1_parts_written_before_the_checksum_still_read(tmp_path):
    """A part an older tandv wrote (marked version 1, no schema checksum) reads as the
    same frame; the checksum is required of version-2 parts only."""
    path = _write_raw(tmp_path / "p.parquet")
    want = read_parquet(path)
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    assert meta[b"tandv.log"] == b"2"
    del meta[b"tandv.schema_sha256"]
    pq.write_table(table.replace_schema_metadata(meta), path)
    with pytest.raises(SchemaError, match="no schema checksum"):
        read_parquet(path)
    meta[b"tandv.log"] = b"1"
    pq.write_table(table.replace_schema_metadata(meta), path)
    pd.testing.assert_frame_equal(read_parquet(path), want)


@pytest.mark.parametrize(
    "old, new",
    [
        (b"scalar_stats.max_abs", b"scalar_stats.?ax_abs"),  # a statistic renamed
        (b"exponent_counts.-50", b"exponent_counts.-57"),  # counts moved to another bin
        (b"exponent_counts.-50", b"exponent_counts.-52"),  # ... onto an existing one
    ],
)
def test_footer_damage_that_still_parses_is_caught_by_the_schema_checksum(tmp_path, old, new):
    extra = {
        "scalar_stats.max_abs": pa.array([1.0, 2.0]),
        "exponent_counts.-52": pa.array([1, 1]),
        "exponent_counts.-50": pa.array([2, 2]),
    }
    path = _write_raw(tmp_path / "p.parquet", **extra)
    data = path.read_bytes()
    footer = len(data) - int.from_bytes(data[-8:-4], "little") - 8
    assert data.count(old, footer) >= 1  # the name as the footer stores it
    path.write_bytes(data[:footer] + data[footer:].replace(old, new))
    with pytest.raises(SchemaError, match=r"p\.parquet'.*(damaged footer|appears twice)"):
        read_parquet(path)


def test_a_name_that_is_not_utf8_is_a_schema_error(tmp_path):
    path = _write_raw(tmp_path / "p.parquet")
    data = path.read_bytes()
    footer = len(data) - int.from_bytes(data[-8:-4], "little") - 8
    path.write_bytes(
        data[:footer] + data[footer:].replace(b"scalar_stats.rm2", b"scalar_stats.r\xff2")
    )
    with pytest.raises(SchemaError, match=r"p\.parquet' is not a readable parquet file"):
        read_parquet(path)


def test_column_selection_and_filters_as_pandas_on_the_full_frame(tmp_path):
    """Two parts, the second with a statistic and an exponent column the first lacks:
    selections and filters give what pandas gives on the whole frame (a missing
    statistic is NaN there, a missing count 0)."""
    d = tmp_path / "log"
    d.mkdir()
    _write_raw(d / "part-0.parquet", **{"metadata.step": pa.array([0, 0])})
    _write_raw(
        d / "part-1.parquet",
        **{
            "metadata.step": pa.array([1, 1]),
            "scalar_stats.peak": pa.array([5.0, 7.0]),
            "exponent_counts.-3": pa.array([0, 9]),
        },
    )
    full = read_parquet(d)
    peak = full[("scalar_stats", "peak")]
    assert peak.isna().tolist() == [True, True, False, False]
    for filters, mask in [
        ([("peak", "!=", 5.0)], peak != 5.0),
        ([("peak", "<", 6.0)], peak < 6.0),
        ([("peak", "not in", [7.0])], ~peak.isin([7.0])),
        ([(-3, "==", 0)], full[("exponent_counts", -3)] == 0),
    ]:
        got = read_parquet(d, filters=filters)
        pd.testing.assert_frame_equal(got, full[mask.to_numpy()].reset_index(drop=True))
    absent = read_parquet(d, columns=[99, "rm2"])
    assert absent[("exponent_counts", 99)].tolist() == [0, 0, 0, 0]
    assert absent[("exponent_counts", 99)].dtype == np.int64
    with pytest.raises(ValueError, match=r"column \('x',\): a column key is a \(group, label\)"):
        read_parquet(d, columns=[("x",)])
    with pytest.raises(ValueError, match=r"column 1\.5: expected a statistic name"):
        read_parquet(d, columns=[1.5])
    with pytest.raises(ValueError, match=r"\('step', '>=', '1'\): the column holds numbers"):
        read_parquet(d, filters=[("step", ">=", "1")])
    with pytest.raises(ValueError, match=r"\('name', '==', 3\): the column holds strings"):
        read_parquet(d, filters=[("name", "==", 3)])
