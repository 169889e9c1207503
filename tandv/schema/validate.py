"""``validate(df)``: check that a DataFrame is a tandv log, with errors that say what to fix.

Every rejection is a :class:`SchemaError` naming the column, what was expected and what
was found, and for a bad value the first row (by position) that holds it. Whatever
``validate`` accepts, the writers can store and the readers give back unchanged.
"""

from __future__ import annotations

from typing import Any, cast

import ml_dtypes
import numpy as np
import pandas as pd
from pandas.api import types as ptypes

from .columns import (
    DTYPE,
    EXPONENT_COUNTS,
    GROUPS,
    META_COLUMNS,
    METADATA,
    NAME,
    OVERFLOW,
    SCALAR_STATS,
    STEP,
    STRING_META,
    TENSOR_TYPE,
    TENSOR_TYPES,
    UNDERFLOW,
)

__all__ = ["SchemaError", "validate", "is_exponent_label"]


class SchemaError(ValueError):
    """A log does not follow the tandv log schema; the message names the column (and the
    file and row where known).

    Attributes:
        column: the offending column key, when one column is at fault.
        row: the position (0-based) of the first offending row, when one row is at fault.
    """

    def __init__(self, message: str, *, column: Any = None, row: int | None = None) -> None:
        super().__init__(message)
        self.column = column
        self.row = row


def is_exponent_label(label: object) -> bool:
    """True for an integer exponent label (not bool), e.g. ``-3`` or ``np.int64(7)``."""
    return isinstance(label, (int, np.integer)) and not isinstance(label, (bool, np.bool_))


def _plain(v: object) -> object:
    """numpy scalars as Python values, so messages read ``-1`` rather than ``np.int64(-1)``."""
    return v.item() if isinstance(v, np.generic) else v


def _examples(values: Any, limit: int = 3) -> str:
    """Up to ``limit`` distinct values, as reprs (works for unhashable values too)."""
    out: list[str] = []
    for v in values:
        r = repr(_plain(v))
        if r not in out:
            out.append(r)
            if len(out) == limit:
                break
    return ", ".join(out)


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _bad_value(
    col: Any, s: pd.Series, mask: np.ndarray, expected: str, hint: str = ""
) -> SchemaError:
    """The error for the values of ``s`` where ``mask`` holds, naming the first row."""
    row = _first(mask)
    found = (
        _examples(s[mask].iloc[:50])
        if not ptypes.is_extension_array_dtype(s.dtype) or not pd.isna(s.iloc[row])
        else "<NA>"
    )
    return SchemaError(
        f"{col!r}: expected {expected}; found {found} (first at row {row}, dtype {s.dtype}){hint}",
        column=col,
        row=row,
    )


def _check_strings(df: pd.DataFrame, c: str) -> None:
    col = (METADATA, c)
    s = df[col]
    dt = s.dtype
    if isinstance(dt, pd.CategoricalDtype):
        raise SchemaError(
            f"{col!r}: expected str values; found a categorical column; convert it "
            f"with .astype(str)",
            column=col,
        )
    if isinstance(dt, pd.StringDtype):
        na = s.isna().to_numpy()
        if na.any():
            raise _bad_value(col, s, na, "str values (no missing value)")
        return
    if dt == np.dtype(object) and ptypes.infer_dtype(s, skipna=False) in ("string", "empty"):
        return  # all values are str (checked in C)
    bad = ~np.fromiter((isinstance(v, str) for v in s.array), dtype=bool, count=len(s))
    if bad.any():
        raise _bad_value(col, s, bad, "str values")


def _integer(col: Any, s: pd.Series, what: str, hint: str) -> np.ndarray:
    """The values of an integer column as a numpy int array, or a SchemaError: a float,
    bool or other dtype, a missing value (nullable dtypes), or a float's NaN/fraction."""
    dt = s.dtype
    if ptypes.is_bool_dtype(dt) or not ptypes.is_numeric_dtype(dt):
        raise SchemaError(
            f"{col!r}: expected an integer dtype of {what}; found {dt} "
            f"(e.g. {_examples(s.iloc[:20])}){hint}",
            column=col,
        )
    if ptypes.is_float_dtype(dt):
        v = s.to_numpy(dtype=np.float64, na_value=np.nan)
        bad = ~np.isfinite(v) | (v != np.round(v))
        row = _first(bad) if bad.any() else None
        which = "" if row is None else f", holding {_examples([s.iloc[row]])} at row {row}"
        raise SchemaError(
            f"{col!r}: expected an integer dtype of {what}; found {dt}{which}{hint}",
            column=col,
            row=row,
        )
    if not ptypes.is_integer_dtype(dt):
        raise SchemaError(
            f"{col!r}: expected an integer dtype of {what}; found {dt}{hint}", column=col
        )
    if ptypes.is_extension_array_dtype(dt):
        na = s.isna().to_numpy()
        if na.any():
            raise _bad_value(col, s, na, f"{what} (no missing value)")
        return cast(np.ndarray, s.to_numpy(dtype=np.int64))
    return cast(np.ndarray, s.to_numpy())


def _duplicates(df: pd.DataFrame, step: np.ndarray) -> np.ndarray:
    """Rows repeating an earlier row's (name, tensor_type, step): the three as one int64
    key (name code, type code, step offset), looked up in one hash table."""
    names, _ = pd.factorize(df[(METADATA, NAME)])
    kinds, kind_values = pd.factorize(df[(METADATA, TENSOR_TYPE)])
    if not len(step):
        return np.zeros(0, dtype=bool)
    low = int(step.min())
    span = int(step.max()) - low + 1
    if (int(names.max()) + 1) * len(kind_values) * span >= 2**62:  # no room: pandas' general way
        return cast(
            np.ndarray,
            df.duplicated(
                subset=[(METADATA, NAME), (METADATA, TENSOR_TYPE), (METADATA, STEP)]
            ).to_numpy(),
        )
    k = (names.astype(np.int64) * len(kind_values) + kinds) * span + (step.astype(np.int64) - low)
    return cast(np.ndarray, pd.Series(k).duplicated().to_numpy())


_INT64_MAX = np.iinfo(np.int64).max
#: Values checked together by :func:`_counts_out_of_range` (bounds the copy it makes to
#: 32 MB: a tracker's part is one block, a frame of millions of rows a column at a time).
_BLOCK_VALUES = 2**22


def _counts_out_of_range(df: pd.DataFrame, at: np.ndarray, dtypes: list[Any]) -> bool:
    """Whether an integer count column at positions ``at`` holds a value below 0 or, in an
    unsigned column, above the int64 maximum (which parquet readers cannot give back as
    the log's int64 counts). Columns of one dtype are read by position, as many at a time
    as fit in :data:`_BLOCK_VALUES`."""
    by_dtype: dict[np.dtype, list[int]] = {}
    for i, dt in zip(at, dtypes):
        by_dtype.setdefault(dt, []).append(int(i))
    step = max(1, _BLOCK_VALUES // max(1, len(df)))
    for dt, cols in by_dtype.items():
        for k in range(0, len(cols), step):
            block = df.iloc[:, cols[k : k + step]].to_numpy(dtype=dt)
            if dt.kind == "i" and block.min(initial=0) < 0:
                return True
            if dt.kind == "u" and block.max(initial=0) > _INT64_MAX:
                return True
    return False


def validate(df: pd.DataFrame) -> pd.DataFrame:
    """Check ``df`` against the log schema and return it unchanged.

    Raises:
        SchemaError: naming the offending column, what was expected and what was found,
            and for a bad value the first row (position) holding it.
    """
    return check(df)


def check(df: pd.DataFrame, *, duplicates: bool = True, counts: bool = True) -> pd.DataFrame:
    """:func:`validate`, optionally without the duplicate-row rule (for a reader that
    checks it across chunks itself) or without looking at the values of plain int64 count
    columns (for a reader that checked them in Arrow as it decoded them)."""
    if not isinstance(df, pd.DataFrame):
        raise SchemaError(f"a log is a pandas DataFrame; found {type(df).__name__}")
    _check_columns(df.columns)
    step = _check_metadata(df)
    _check_scalar_stats(df)
    _check_exponent_counts(df, counts)
    if duplicates:
        _check_duplicates(df, step)
    return df


def _check_columns(cols: pd.Index) -> None:
    """The column index: two levels, known groups, no column twice."""
    if not isinstance(cols, pd.MultiIndex) or cols.nlevels != 2:
        levels = cols.nlevels if isinstance(cols, pd.MultiIndex) else 1
        raise SchemaError(
            f"columns: expected a 2-level MultiIndex ({', '.join(GROUPS)}, column name); "
            f"found {levels} level(s), e.g. {_examples(list(cols))}"
        )
    tops = list(dict.fromkeys(cols.get_level_values(0)))
    unknown = [t for t in tops if not (isinstance(t, str) and t in GROUPS)]
    if unknown:
        raise SchemaError(
            f"columns: unknown top-level group {_examples(unknown)}; "
            f"expected only {', '.join(GROUPS)}"
        )
    if cols.duplicated().any():
        raise SchemaError(f"columns: duplicated column {_examples(list(cols[cols.duplicated()]))}")


def _check_metadata(df: pd.DataFrame) -> np.ndarray:
    """The metadata columns and their values; returns the steps (as integers)."""
    cols = df.columns
    meta = [c for t, c in cols if t == METADATA]
    missing = [c for c in META_COLUMNS if c not in meta]
    if missing:
        raise SchemaError(
            f"metadata: missing column(s) {', '.join(repr((METADATA, c)) for c in missing)}; "
            f"expected exactly {list(META_COLUMNS)}"
        )
    extra = [c for c in meta if c not in META_COLUMNS]
    if extra:
        raise SchemaError(
            f"metadata: unexpected column(s) {', '.join(repr((METADATA, c)) for c in extra)}; "
            f"expected exactly {list(META_COLUMNS)} (put statistics under {SCALAR_STATS!r})"
        )
    for c in STRING_META:
        _check_strings(df, c)
    step_col = (METADATA, STEP)
    step = _integer(step_col, df[step_col], "steps", "; convert with .astype('int64')")
    if (step < 0).any():
        raise _bad_value(step_col, df[step_col], step < 0, "non-negative steps")
    tt_col = (METADATA, TENSOR_TYPE)
    bad = ~df[tt_col].isin(TENSOR_TYPES).to_numpy()
    if bad.any():
        raise _bad_value(tt_col, df[tt_col], bad, f"one of {list(TENSOR_TYPES)}")
    for name in pd.unique(df[(METADATA, DTYPE)]):
        try:
            ml_dtypes.finfo(name)  # type: ignore[no-untyped-call]  # ml_dtypes: no annotations
        except Exception:
            raise SchemaError(
                f"{(METADATA, DTYPE)!r}: {name!r} is not a floating-point dtype name that "
                f"ml_dtypes.finfo can parse (e.g. 'float32', 'bfloat16', 'float8_e4m3fn')",
                column=(METADATA, DTYPE),
            ) from None
    return step


def _check_scalar_stats(df: pd.DataFrame) -> None:
    """The statistic columns: at least one, named by a string, numeric, no <NA>."""
    cols = df.columns
    groups = cols.get_level_values(0)
    dtypes = df.dtypes
    stat_at = np.flatnonzero(groups == SCALAR_STATS)  # positions: no lookup per column
    stats = [cols[i][1] for i in stat_at]
    if not stats:
        raise SchemaError(
            f"{SCALAR_STATS!r}: expected at least one scalar statistic column; found none"
        )
    bad_labels = [c for c in stats if not (isinstance(c, str) and c)]
    if bad_labels:
        raise SchemaError(
            f"{SCALAR_STATS!r}: statistic names must be non-empty str; found "
            f"{_examples(bad_labels)}"
        )
    for c, dt in zip(stats, dtypes.iloc[stat_at]):
        col = (SCALAR_STATS, c)
        if not ptypes.is_numeric_dtype(dt) or ptypes.is_bool_dtype(dt):
            raise SchemaError(
                f"{col!r}: expected a numeric (float or int) dtype; found {dt}", column=col
            )
        if isinstance(dt, np.dtype) and dt.kind == "u" and len(df):
            v = df[col].to_numpy()
            if v.max() > _INT64_MAX:
                raise _bad_value(
                    col, df[col], v > _INT64_MAX, f"values <= {_INT64_MAX} (the int64 maximum)"
                )
        if ptypes.is_extension_array_dtype(dt):
            na = df[col].isna().to_numpy()
            if na.any():
                raise _bad_value(
                    col,
                    df[col],
                    na,
                    "numbers (a missing statistic is NaN in a float dtype, not <NA>)",
                    "; convert with .astype('float64')",
                )


def _check_exponent_counts(df: pd.DataFrame, counts: bool) -> None:
    """The exponent-count columns: the underflow and overflow counts, integer labels,
    integer counts in range (their values only with ``counts``, or where not plain int64)."""
    cols = df.columns
    groups = cols.get_level_values(0)
    dtypes = df.dtypes
    exp_at = np.flatnonzero(groups == EXPONENT_COUNTS)
    exps = [cols[i][1] for i in exp_at]
    for label in (UNDERFLOW, OVERFLOW):
        if label not in exps:
            raise SchemaError(
                f"{(EXPONENT_COUNTS, label)!r}: missing; every log holds the underflow "
                f"({UNDERFLOW!r}) and overflow ({OVERFLOW!r}) counts (all zeros if none)",
                column=(EXPONENT_COUNTS, label),
            )
    bad_labels = [c for c in exps if c not in (UNDERFLOW, OVERFLOW) and not is_exponent_label(c)]
    if bad_labels:
        raise SchemaError(
            f"{EXPONENT_COUNTS!r}: column labels must be integer exponents or "
            f"{UNDERFLOW!r}/{OVERFLOW!r}; found {_examples(bad_labels)}"
        )
    exp_dtypes = list(dtypes.iloc[exp_at])
    kinds = {dt.kind if isinstance(dt, np.dtype) else "?" for dt in exp_dtypes}
    # plain numpy integer columns (what the trackers write) are checked in blocks of
    # columns by position (no lookup per column, a bounded copy); the others, or a block
    # holding a count out of range, column by column, for the exact error
    if not kinds <= {"i", "u"} or (
        counts and len(df) and _counts_out_of_range(df, exp_at, exp_dtypes)
    ):
        for c in exps:
            col = (EXPONENT_COUNTS, c)
            v = _integer(col, df[col], "counts", "; convert with .astype('int64')")
            if v.dtype.kind == "i" and v.size and v.min() < 0:
                raise _bad_value(col, df[col], v < 0, "counts >= 0")
            if v.dtype.kind == "u" and v.size and v.max() > _INT64_MAX:
                raise _bad_value(
                    col, df[col], v > _INT64_MAX, f"counts <= {_INT64_MAX} (the int64 maximum)"
                )


def _check_duplicates(df: pd.DataFrame, step: np.ndarray) -> None:
    """No two rows for one (name, tensor_type, step)."""
    step_col = (METADATA, STEP)
    key = [(METADATA, NAME), (METADATA, TENSOR_TYPE), step_col]
    dup = _duplicates(df, step)
    if dup.any():
        row = _first(dup)
        first = [_plain(v) for v in df[key].iloc[row].tolist()]
        raise SchemaError(
            f"metadata: duplicate rows for (name, tensor_type, step) = {tuple(first)} "
            f"(row {row} repeats an earlier row); each tensor has at most one row per step",
            row=row,
        )
