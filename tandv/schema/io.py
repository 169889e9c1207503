"""Reading and writing logs as pickle or parquet, and combining log parts.

Parquet is the safe, portable format: it stores each column under a flat name
``"<group>.<label>"`` (``"metadata.step"``, ``"exponent_counts.-3"``) and this module
rebuilds the two-level columns on read, turning exponent labels back into ints, so
a log round-trips exactly. A parquet log may be one file or a directory of part files
(``part-000000.parquet``, ...), read in name order.

Exponent columns may differ between parts: a missing exponent column always means a
count of zero, and :func:`concat_logs` fills it so.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .columns import EXPONENT_COUNTS, GROUPS, META_COLUMNS, METADATA, OVERFLOW, SCALAR_STATS, UNDERFLOW
from .validate import SchemaError, is_exponent_label, validate

__all__ = [
    "read_pickle",
    "write_pickle",
    "read_parquet",
    "write_parquet",
    "read_log",
    "concat_logs",
    "canonical_columns",
    "drop_empty_exponents",
    "atomic_write",
]

PathLike = str | os.PathLike


def canonical_columns(columns: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Columns in log order: metadata (schema order), scalar stats (as given), then
    exponent counts ``-inf``, ascending exponents, ``+inf``."""
    cols = list(columns)
    meta = [(METADATA, c) for c in META_COLUMNS if (METADATA, c) in cols]
    stats = [c for c in cols if c[0] == SCALAR_STATS]
    exps = [c[1] for c in cols if c[0] == EXPONENT_COUNTS]
    ints = sorted(e for e in exps if e not in (UNDERFLOW, OVERFLOW))
    ordered = [UNDERFLOW] * (UNDERFLOW in exps) + ints + [OVERFLOW] * (OVERFLOW in exps)
    return meta + stats + [(EXPONENT_COUNTS, e) for e in ordered]


def concat_logs(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """Stack log parts row-wise: exponent columns absent from a part are zero there,
    columns come in :func:`canonical_columns` order, the index is reset."""
    frames = [f for f in frames if f is not None]
    if not frames:
        raise ValueError("concat_logs: no log parts to combine")
    if len(frames) == 1:
        out = frames[0].reset_index(drop=True)
    else:
        out = pd.concat(frames, ignore_index=True, sort=False)
    exp_cols = [c for c in out.columns if c[0] == EXPONENT_COUNTS]
    if exp_cols and out[exp_cols].isna().any().any():
        out[exp_cols] = out[exp_cols].fillna(0)
    for c in exp_cols:
        if out[c].dtype != "int64":
            out[c] = out[c].astype("int64")
    order = canonical_columns(out.columns)
    return out[pd.MultiIndex.from_tuples(order)] if list(out.columns) != order else out


def drop_empty_exponents(df: pd.DataFrame) -> pd.DataFrame:
    """Drop exponent columns that are zero in every row (``-inf``/``+inf`` are kept).

    Allowed by the schema because a missing exponent column means a count of zero."""
    droppable = np.array([c[0] == EXPONENT_COUNTS and c[1] not in (UNDERFLOW, OVERFLOW)
                          for c in df.columns], dtype=bool)
    if not droppable.any():
        return df
    empty = np.zeros(len(droppable), dtype=bool)
    empty[droppable] = ~df.iloc[:, np.flatnonzero(droppable)].to_numpy().any(axis=0)
    # by position: DataFrame.drop on MultiIndex columns costs ~80 ms for 300 columns
    return df.iloc[:, np.flatnonzero(~empty)] if empty.any() else df


def atomic_write(path: PathLike, write: Any) -> Path:
    """Call ``write(tmp_path)`` then rename the temporary file to ``path``, so a reader
    never sees a half-written file (the rename is atomic on POSIX)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files; give the usual permissions
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# ----------------------------------------------------------------------------- pickle


def write_pickle(df: pd.DataFrame, path: PathLike) -> Path:
    """Validate ``df`` and write it to ``path`` as a pickle (atomically)."""
    validate(df)
    return atomic_write(path, lambda tmp: df.to_pickle(tmp))


def read_pickle(path: PathLike) -> pd.DataFrame:
    """Read a pickled log and validate it.

    Warning:
        Unpickling runs code stored in the file: only read pickles you trust.
        Parquet (:func:`read_parquet`) holds data only and is the safe format to share.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        SchemaError: if the file holds something other than a valid log.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no log file at {str(path)!r}")
    try:
        df = pd.read_pickle(path)
    except Exception as e:
        raise SchemaError(f"{str(path)!r} is not a readable pickle: {e}") from e
    return validate(df)


# ----------------------------------------------------------------------------- parquet

_SEP = "."
_MARK = b"tandv.log"


def _flat(col: tuple[str, Any]) -> str:
    return f"{col[0]}{_SEP}{col[1]}"


def _unflat(name: str) -> tuple[str, Any]:
    group, _, label = name.partition(_SEP)
    if group == EXPONENT_COUNTS and label not in (UNDERFLOW, OVERFLOW):
        try:
            return (group, int(label))
        except ValueError:
            pass
    return (group, label)


def write_parquet(df: pd.DataFrame, path: PathLike) -> Path:
    """Validate ``df`` and write it to the parquet file ``path`` (atomically)."""
    validate(df)
    # Arrow arrays straight from the columns' numpy values: pa.Table.from_pandas spends
    # ~0.2 ms per column on pandas bookkeeping (a 300-column flush took 60 ms that way).
    table = pa.Table.from_arrays([pa.array(df[c].to_numpy()) for c in df.columns],
                                 names=[_flat(c) for c in df.columns])
    table = table.replace_schema_metadata({_MARK: b"1"})
    return atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def _parquet_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.glob("*.parquet") if not p.name.startswith("."))
        if not files:
            raise FileNotFoundError(f"no .parquet part files in directory {str(path)!r}")
        return files
    if path.is_file():
        return [path]
    raise FileNotFoundError(f"no log file or directory at {str(path)!r}")


def _flat_key(key: Any) -> str:
    """A user's column key (tuple, metadata name, or flat name) as a flat parquet name."""
    if isinstance(key, tuple):
        return _flat(key)
    if key in META_COLUMNS:
        return _flat((METADATA, key))
    if isinstance(key, str) and key.partition(_SEP)[0] in GROUPS:
        return key
    if is_exponent_label(key) or key in (UNDERFLOW, OVERFLOW):
        return _flat((EXPONENT_COUNTS, key))
    return _flat((SCALAR_STATS, key))


def read_parquet(
    path: PathLike,
    columns: Sequence[Any] | None = None,
    filters: Sequence[Any] | None = None,
) -> pd.DataFrame:
    """Read a parquet log (one file, or a directory of part files) and validate it.

    Arguments:
        path: a ``.parquet`` file or a directory of them.
        columns: scalar statistics and exponent columns to read, each as a tuple
            (``("scalar_stats", "rm2")``), a statistic name (``"rm2"``) or an exponent
            label (``-3``, ``"+inf"``). Metadata and the ``-inf``/``+inf`` counts are always
            read. Default: everything.
        filters: row filters in pyarrow's form, e.g. ``[("step", ">=", 100),
            ("tensor_type", "==", "Gradient")]``; metadata columns may be named bare.

    Raises:
        FileNotFoundError: if nothing is at ``path``.
        SchemaError: if a file is not a tandv log.
    """
    files = _parquet_files(Path(path))
    wanted = None
    if columns is not None:
        wanted = [_flat((METADATA, c)) for c in META_COLUMNS]
        wanted += [_flat((EXPONENT_COUNTS, UNDERFLOW)), _flat((EXPONENT_COUNTS, OVERFLOW))]
        wanted += [k for k in map(_flat_key, columns) if k not in wanted]
    flt = None
    if filters:
        def one(f: Any) -> tuple:
            return (_flat_key(f[0]), *f[1:])
        flt = [[one(f) for f in conj] for conj in filters] if isinstance(filters[0], list) else [one(f) for f in filters]
    frames = []
    for f in files:
        try:
            names = pq.read_schema(f).names
        except Exception as e:
            raise SchemaError(f"{str(f)!r} is not a readable parquet file: {e}") from e
        if not any(n.startswith(METADATA + _SEP) for n in names):
            raise SchemaError(f"{str(f)!r} is not a tandv log: it has no {METADATA!r} columns")
        cols = None if wanted is None else [c for c in wanted if c in names]
        table = pq.read_table(f, columns=cols, filters=flt)
        part = table.to_pandas()
        part.columns = pd.MultiIndex.from_tuples([_unflat(c) for c in part.columns])
        frames.append(part)
    return validate(concat_logs(frames))


def read_log(path: PathLike, **kwargs: Any) -> pd.DataFrame:
    """Read a log in either format: ``.pkl``/``.pickle`` files as pickle, else parquet."""
    p = Path(path)
    if p.suffix in (".pkl", ".pickle"):
        if kwargs:
            raise TypeError(f"read_log: {sorted(kwargs)} apply to parquet logs only")
        return read_pickle(p)
    return read_parquet(p, **kwargs)
