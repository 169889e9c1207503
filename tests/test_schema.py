"""validate(): one test per rule, each asserting the message; and pickle/parquet IO."""

import pickle

import numpy as np
import pandas as pd
import pytest

import tandv
from tandv.schema import SchemaError, read_parquet, read_pickle, validate, write_parquet, write_pickle
from tandv.track.common import read_pickle as seed_read_pickle

from logs import make_log


def good() -> pd.DataFrame:
    """A minimal valid log, built by hand."""
    cols = pd.MultiIndex.from_tuples([
        ("metadata", "name"), ("metadata", "type"), ("metadata", "tensor_type"),
        ("metadata", "step"), ("metadata", "dtype"),
        ("scalar_stats", "rm2"),
        ("exponent_counts", "-inf"), ("exponent_counts", -3), ("exponent_counts", 0),
        ("exponent_counts", "+inf"),
    ])
    return pd.DataFrame(
        [["l0", "Linear", "Weight", 0, "float32", 1.5, 0, 2, 1, 0],
         ["l0", "Linear", "Gradient", 0, "bfloat16", 0.5, 1, 0, 3, 0]],
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
    with pytest.raises(SchemaError, match=r"\('metadata', 'step'\): expected an integer dtype of steps; found float64, holding 1.5 at row 1"):
        validate(df)


def test_step_must_be_non_negative():
    df = good()
    df[("metadata", "step")] = np.array([0, -1], dtype=np.int64)
    with pytest.raises(SchemaError, match=r"expected non-negative steps; found -1 \(first at row 1, dtype int64\)$"):
        validate(df)


def test_unknown_tensor_type():
    df = good()
    df[("metadata", "tensor_type")] = ["Weight", "Activations"]
    with pytest.raises(SchemaError, match=r"tensor_type'\): expected one of .*Optimiser_State.*found 'Activations'"):
        validate(df)


def test_dtype_must_parse_with_ml_dtypes():
    df = good()
    df[("metadata", "dtype")] = ["float32", "int8"]
    with pytest.raises(SchemaError, match="'int8' is not a floating-point dtype name that ml_dtypes.finfo"):
        validate(df)


def test_needs_a_scalar_stat():
    with pytest.raises(SchemaError, match="expected at least one scalar statistic column; found none"):
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
    with pytest.raises(SchemaError, match=r"\('exponent_counts', -3\): expected an integer dtype of counts; found float64"):
        validate(df)


def test_duplicate_rows():
    df = good()
    df[("metadata", "tensor_type")] = ["Weight", "Weight"]
    with pytest.raises(SchemaError, match=r"duplicate rows for \(name, tensor_type, step\) = \('l0', 'Weight', 0\)"):
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
        row = df[(df[("metadata", "name")] == name) & (df[("metadata", "tensor_type")] == tt)
                 & (df[("metadata", "step")] == step)]
        a = np.abs(x.astype(np.float64))
        a = a[np.isfinite(a) & (a > 0)]
        exps, n = np.unique(np.floor(np.log2(a)).astype(int), return_counts=True)
        counts = row["exponent_counts"].iloc[0]
        assert counts.sum() == a.size
        for e, c in zip(exps, n):
            assert counts[int(e)] == c


def test_parquet_column_selection_and_filters(tmp_path):
    df, _ = make_log(tmp_path / "log", steps=4)
    sub = read_parquet(tmp_path / "log", columns=["rm2", -1], filters=[("step", ">=", 2), ("tensor_type", "==", "Weight")])
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
