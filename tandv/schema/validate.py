"""``validate(df)``: check that a DataFrame is a tandv log, with errors that say what to fix."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pandas as pd
from pandas.api import types as ptypes

from .columns import (
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
    DTYPE,
)

__all__ = ["SchemaError", "validate", "is_exponent_label"]


class SchemaError(ValueError):
    """A DataFrame does not follow the tandv log schema; the message names the column."""


def is_exponent_label(label: object) -> bool:
    """True for an integer exponent label (not bool), e.g. ``-3`` or ``np.int64(7)``."""
    return isinstance(label, (int, np.integer)) and not isinstance(label, (bool, np.bool_))


def _plain(v: object) -> object:
    """numpy scalars as Python values, so messages read ``-1`` rather than ``np.int64(-1)``."""
    return v.item() if isinstance(v, np.generic) else v


def _examples(values: pd.Series | list, limit: int = 3) -> str:
    vals = list(dict.fromkeys(_plain(v) for v in values))[:limit]
    return ", ".join(repr(v) for v in vals)


def validate(df: pd.DataFrame) -> pd.DataFrame:
    """Check ``df`` against the log schema and return it unchanged.

    Raises:
        SchemaError: naming the offending column, what was expected and what was found.
    """
    if not isinstance(df, pd.DataFrame):
        raise SchemaError(f"a log is a pandas DataFrame; found {type(df).__name__}")
    cols = df.columns
    if not isinstance(cols, pd.MultiIndex) or cols.nlevels != 2:
        levels = cols.nlevels if isinstance(cols, pd.MultiIndex) else 1
        raise SchemaError(
            f"columns: expected a 2-level MultiIndex ({', '.join(GROUPS)}, column name); "
            f"found {levels} level(s), e.g. {_examples(list(cols))}"
        )
    tops = list(dict.fromkeys(cols.get_level_values(0)))
    unknown = [t for t in tops if t not in GROUPS]
    if unknown:
        raise SchemaError(
            f"columns: unknown top-level group {_examples(unknown)}; expected only {', '.join(GROUPS)}"
        )
    if cols.duplicated().any():
        raise SchemaError(f"columns: duplicated column {_examples(list(cols[cols.duplicated()]))}")

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
        s = df[(METADATA, c)]
        if ptypes.infer_dtype(s, skipna=False) in ("string", "empty"):
            continue  # all values are str (checked in C)
        bad = s[~s.map(lambda v: isinstance(v, str))]
        if len(bad):
            raise SchemaError(
                f"{(METADATA, c)!r}: expected str values; found {_examples(bad)} "
                f"(dtype {s.dtype})"
            )
    step = df[(METADATA, STEP)]
    if not ptypes.is_integer_dtype(step.dtype) or ptypes.is_bool_dtype(step.dtype):
        raise SchemaError(
            f"{(METADATA, STEP)!r}: expected an integer dtype; found {step.dtype} "
            f"(e.g. {_examples(step)}); convert with .astype('int64')"
        )
    if (step < 0).any():
        raise SchemaError(
            f"{(METADATA, STEP)!r}: expected non-negative steps; found {_examples(step[step < 0])}"
        )
    tt = df[(METADATA, TENSOR_TYPE)]
    bad = tt[~tt.isin(TENSOR_TYPES)]
    if len(bad):
        raise SchemaError(
            f"{(METADATA, TENSOR_TYPE)!r}: expected one of {list(TENSOR_TYPES)}; found {_examples(bad)}"
        )
    for name in pd.unique(df[(METADATA, DTYPE)]):
        try:
            ml_dtypes.finfo(name)
        except Exception:
            raise SchemaError(
                f"{(METADATA, DTYPE)!r}: {name!r} is not a floating-point dtype name that "
                f"ml_dtypes.finfo can parse (e.g. 'float32', 'bfloat16', 'float8_e4m3fn')"
            ) from None

    stats = [c for t, c in cols if t == SCALAR_STATS]
    if not stats:
        raise SchemaError(f"{SCALAR_STATS!r}: expected at least one scalar statistic column; found none")
    for c in stats:
        dt = df[(SCALAR_STATS, c)].dtype
        if not ptypes.is_numeric_dtype(dt) or ptypes.is_bool_dtype(dt):
            raise SchemaError(f"{(SCALAR_STATS, c)!r}: expected a numeric (float or int) dtype; found {dt}")

    exps = [c for t, c in cols if t == EXPONENT_COUNTS]
    for label in (UNDERFLOW, OVERFLOW):
        if label not in exps:
            raise SchemaError(
                f"{(EXPONENT_COUNTS, label)!r}: missing; every log holds the underflow "
                f"({UNDERFLOW!r}) and overflow ({OVERFLOW!r}) counts (all zeros if none)"
            )
    bad_labels = [c for c in exps if c not in (UNDERFLOW, OVERFLOW) and not is_exponent_label(c)]
    if bad_labels:
        raise SchemaError(
            f"{EXPONENT_COUNTS!r}: column labels must be integer exponents or "
            f"{UNDERFLOW!r}/{OVERFLOW!r}; found {_examples(bad_labels)}"
        )
    exp_dtypes = df.dtypes[[(EXPONENT_COUNTS, c) for c in exps]]
    for (_, c), dt in exp_dtypes.items():
        if not ptypes.is_integer_dtype(dt) or ptypes.is_bool_dtype(dt):
            raise SchemaError(f"{(EXPONENT_COUNTS, c)!r}: expected an integer dtype of counts; found {dt}")
    negative = (df[[(EXPONENT_COUNTS, c) for c in exps]].to_numpy() < 0).any(axis=0)
    for c, neg in zip(exps, negative):
        if neg:
            s = df[(EXPONENT_COUNTS, c)]
            raise SchemaError(f"{(EXPONENT_COUNTS, c)!r}: expected counts >= 0; found {_examples(s[s < 0])}")

    key = [(METADATA, NAME), (METADATA, TENSOR_TYPE), (METADATA, STEP)]
    dup = df.duplicated(subset=key, keep=False)
    if dup.any():
        first = [_plain(v) for v in df.loc[dup, key].iloc[0].tolist()]
        raise SchemaError(
            f"metadata: duplicate rows for (name, tensor_type, step) = {tuple(first)}; "
            f"each tensor has at most one row per step"
        )
    return df
