"""Reading and writing logs as pickle or parquet, and combining log parts.

Parquet is the safe, portable format: it stores each column under a flat name
``"<group>.<label>"`` (``"metadata.step"``, ``"exponent_counts.-3"``) and this module
rebuilds the two-level columns on read, turning exponent labels back into ints, so
a log round-trips exactly. A parquet log may be one file or a directory of part files
(``part-000000.parquet``, ...), read in name order through one ``pyarrow.dataset``.

Exponent columns may differ between parts: a missing exponent column always means a
count of zero, and the readers (and :func:`concat_logs`) fill it so. Nothing else is
ever filled in or converted: a value the schema forbids is a :class:`SchemaError`
naming the file, the column and the row.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import json
import operator
import os
import pickle
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from pandas.api import types as ptypes

from .columns import (
    EXPONENT_COUNTS,
    GROUPS,
    META_COLUMNS,
    METADATA,
    OVERFLOW,
    SCALAR_STATS,
    STEP,
    UNDERFLOW,
)
from .validate import SchemaError, check, is_exponent_label, validate

__all__ = [
    "RUN_ATTR",
    "SOURCE_ATTR",
    "run_record",
    "read_pickle",
    "write_pickle",
    "read_parquet",
    "read_parquet_chunks",
    "write_parquet",
    "write_part_table",
    "read_log",
    "log_columns",
    "concat_logs",
    "canonical_columns",
    "drop_empty_exponents",
    "atomic_write",
    "exclusive_write",
    "seal_part",
    "LOG_VERSION",
    "PICKLE_SUFFIXES",
]

#: ``df.attrs[SOURCE_ATTR]``: the path a log frame was read from (set by the readers), so
#: that its scalars can be found from the frame alone (:func:`tandv.schema.scalars.read_scalars`).
SOURCE_ATTR = "tandv.source"

PathLike = str | os.PathLike[str]


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
    """Stack log parts row-wise: an exponent column absent from a part is zero in that
    part's rows (stored values are kept as they are, so a stored NaN stays for
    :func:`validate` to reject); columns come in :func:`canonical_columns` order, the index
    is reset."""
    frames = [f for f in frames if f is not None]
    if not frames:
        raise ValueError("concat_logs: no log parts to combine")
    exp_cols = list(dict.fromkeys(c for f in frames for c in f.columns if c[0] == EXPONENT_COUNTS))
    filled = []
    for f in frames:
        absent = [c for c in exp_cols if c not in f.columns]
        if absent:
            zeros = pd.DataFrame(
                np.zeros((len(f), len(absent)), np.int64),
                index=f.index,
                columns=pd.MultiIndex.from_tuples(absent),
            )
            f = pd.concat([f, zeros], axis=1)
        filled.append(f)
    out = (
        filled[0].reset_index(drop=True)
        if len(filled) == 1
        else pd.concat(filled, ignore_index=True, sort=False)
    )
    order = canonical_columns(out.columns)
    return out[pd.MultiIndex.from_tuples(order)] if list(out.columns) != order else out


def drop_empty_exponents(df: pd.DataFrame) -> pd.DataFrame:
    """Drop exponent columns that are zero in every row (``-inf``/``+inf`` are kept).

    Allowed by the schema because a missing exponent column means a count of zero."""
    droppable = np.array(
        [c[0] == EXPONENT_COUNTS and c[1] not in (UNDERFLOW, OVERFLOW) for c in df.columns],
        dtype=bool,
    )
    if not droppable.any():
        return df
    empty = np.zeros(len(droppable), dtype=bool)
    empty[droppable] = ~df.iloc[:, np.flatnonzero(droppable)].to_numpy().any(axis=0)
    # by position: DataFrame.drop on MultiIndex columns is slow (schema/DESIGN.md)
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


def exclusive_write(path: PathLike, write: Any) -> Path:
    """Call ``write(tmp_path)`` then link the temporary file to ``path``: like
    :func:`atomic_write`, but it never replaces a file at ``path`` (``os.link`` fails
    where a file exists, atomically; the log then stays in the temporary file, named in
    the error).

    Raises:
        FileExistsError: if a file appeared at ``path`` meanwhile.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        write(tmp)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise FileExistsError(
            f"a file appeared at {str(path)!r} while this run held its claim; it was left "
            f"alone and this run's log is in {tmp!r}",
        ) from None
    except OSError:  # a file system without hard links: the claim still keeps others out
        if path.exists():
            raise FileExistsError(
                f"a file appeared at {str(path)!r}; this run's log is in {tmp!r}"
            ) from None
        os.replace(tmp, path)
        return path
    os.unlink(tmp)
    return path


# ----------------------------------------------------------------------------- pickle


#: What follows the pickle in a pickle log tandv writes: then the SHA-256 (hex) of the bytes
#: before it. Unpicklers stop at the pickle's end, so ``pandas.read_pickle`` reads the file.
_PICKLE_SUM = b"\ntandv-sha256:"


def pickle_bytes(df: pd.DataFrame) -> bytes:
    """``df`` pickled, followed by the checksum :func:`read_pickle` verifies."""
    data = pickle.dumps(df, protocol=pickle.HIGHEST_PROTOCOL)
    return data + _PICKLE_SUM + hashlib.sha256(data).hexdigest().encode()


def write_pickle(df: pd.DataFrame, path: PathLike) -> Path:
    """Validate ``df`` and write it to ``path`` as a pickle (atomically), with a checksum
    of its bytes after it that :func:`read_pickle` verifies (a damaged file is an error,
    not altered values)."""
    validate(df)
    data = pickle_bytes(df)
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def _magic(path: Path) -> str | None:
    """``"parquet"`` or ``"pickle"`` from a file's first bytes (None for neither)."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PAR1":
        return "parquet"
    if head[:1] == b"\x80":  # pickle protocol 2 and later
        return "pickle"
    return None


def _checked_restore(restore: Any) -> Any:
    """``pyarrow``'s array reconstructor, followed by a full validation of the array it
    rebuilt (offsets within the data, valid UTF-8): a damaged pickle otherwise yields an
    Arrow string array whose offsets point anywhere, which crashes the process when read."""

    def restored(*args: Any) -> Any:
        array = restore(*args)
        array.validate(full=True)
        return array

    return restored


def _check_unpickled(df: Any) -> None:
    """Check the internal structure of an unpickled DataFrame before anything reads it: a
    damaged pickle can rebuild a frame whose column codes or block placements point outside
    its arrays, which pandas does not check and crashes on. Raises ValueError."""
    if not isinstance(df, pd.DataFrame):
        return  # validate() says what it is
    cols = df.columns
    if isinstance(cols, pd.MultiIndex):
        for level, codes in zip(cols.levels, cols.codes):
            codes = np.asarray(codes)
            if len(codes) != len(cols.codes[0]) or (
                codes.size and (codes.min() < -1 or codes.max() >= len(level))
            ):
                raise ValueError("column codes out of range")
    ncols, nrows = len(cols), len(df.index)
    seen = np.zeros(ncols, dtype=np.int64)
    for blk in df._mgr.blocks:
        locs = np.asarray(blk.mgr_locs.as_array)
        shape = blk.values.shape
        width = shape[0] if len(shape) == 2 else 1
        if len(shape) == 2 and shape[1] != nrows or len(shape) == 1 and shape[0] != nrows:
            raise ValueError("a block's length differs from the index's")
        if len(locs) != width or (locs.size and (locs.min() < 0 or locs.max() >= ncols)):
            raise ValueError("a block's column placement is out of range")
        np.add.at(seen, locs, 1)
    if not (seen == 1).all():
        raise ValueError("the blocks do not cover each column exactly once")


class _CheckedUnpickler(pickle.Unpickler):
    """The standard unpickler, except that Arrow arrays are validated as they are rebuilt."""

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        if module == "pyarrow.lib" and name == "_restore_array":
            return _checked_restore(found)
        return found


def read_pickle(path: PathLike) -> pd.DataFrame:
    """Read a pickled log and validate it.

    Warning:
        Unpickling runs code stored in the file: only read pickles you trust.
        Parquet (:func:`read_parquet`) holds data only and is the safe format to share.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        SchemaError: if the file holds something other than a valid log (parquet data
            is recognized and not unpickled).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no log file at {str(path)!r}")
    if _magic(path) == "parquet":
        raise SchemaError(
            f"{str(path)!r} holds parquet data, not a pickle; rename it to end in .parquet "
            f"(or read it with read_parquet)"
        )
    try:
        data = path.read_bytes()
        end = data.rfind(_PICKLE_SUM, max(0, len(data) - len(_PICKLE_SUM) - 64))
        if end >= 0:  # written by tandv: the bytes must be those written
            digest = data[end + len(_PICKLE_SUM) :]
            if hashlib.sha256(memoryview(data)[:end]).hexdigest().encode() != digest:
                raise SchemaError(
                    f"{str(path)!r}: damaged pickle, its checksum does not match its contents; "
                    f"restore it from a copy"
                )
            data = data[:end]
        df = _CheckedUnpickler(io.BytesIO(data)).load()
        _check_unpickled(df)
    except SchemaError:
        raise
    except Exception as e:
        raise SchemaError(f"{str(path)!r} is not a readable pickle: {type(e).__name__}: {e}") from e
    try:
        df = validate(df)
    except SchemaError as e:
        raise SchemaError(f"{str(path)!r}: {e}", column=e.column, row=e.row) from None
    df.attrs[SOURCE_ATTR] = str(path.resolve())  # where read_scalars(df) finds the scalars
    return df


# ----------------------------------------------------------------------------- parquet

_SEP = "."
_MARK = b"tandv.log"
#: Rows per row group in :func:`write_parquet`: row-group statistics of a step-sorted log
#: then let a step filter skip whole row groups.
ROW_GROUP_ROWS = 65536
#: Rows per frame yielded by :func:`read_parquet_chunks`.
CHUNK_ROWS = 65536
#: Rows per batch of the dataset scan.
_BATCH_ROWS = 65536
_FILTER_OPS = {
    "==": operator.eq,
    "=": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    ">": operator.gt,
    "<=": operator.le,
    ">=": operator.ge,
}
_STRING_META = frozenset(c for c in META_COLUMNS if c != STEP)
#: An exponent label as the writer spells it: no leading zeros, no "-0", no "+".
_INT_LABEL = re.compile(r"0|-?[1-9][0-9]*")


def _flat(col: tuple[str, Any]) -> str:
    return f"{col[0]}{_SEP}{col[1]}"


def _unflat(name: str) -> tuple[str, Any]:
    """The column key of a flat parquet name whose label was checked (:func:`_check_part`)."""
    group, _, label = name.partition(_SEP)
    if group == EXPONENT_COUNTS and label not in (UNDERFLOW, OVERFLOW):
        return (group, int(label))
    return (group, label)


#: Where a log keeps the record of how it was made: ``df.attrs[RUN_ATTR]`` (a JSON-able
#: dict: number format, tracker options, versions, model, world size and rank, start time),
#: stored in each parquet part's schema metadata under :data:`_RUN_KEY` and in the pickle.
RUN_ATTR = "tandv"
_RUN_KEY = b"tandv.run"


def run_record(df: pd.DataFrame) -> dict[str, Any]:
    """The record of how a log was made (``{}`` for a log that holds none)."""
    got = df.attrs.get(RUN_ATTR)
    return dict(got) if isinstance(got, Mapping) else {}


#: The log format version this module writes (``tandv.log`` in each part): 2, parts with a
#: schema checksum. Version 1 (written before the checksum existed: no footer check is
#: possible) is still read; any other version is refused.
LOG_VERSION = b"2"
#: The version of parts written before the schema checksum, still read.
_UNSEALED_VERSION = b"1"
#: Schema metadata key of a part's schema checksum (:func:`_schema_sum`).
_SUM_KEY = b"tandv.schema_sha256"


def _schema_sum(schema: pa.Schema, rows: int) -> bytes:
    """SHA-256 (hex) of what a part's footer says about its contents: each column's name
    and type, the row count, and tandv's own metadata (version, run record). Written with
    the part and compared on read, it catches footer damage that still parses (a renamed
    column, a changed type), which page checksums do not cover."""
    meta = schema.metadata or {}
    h = hashlib.sha256()
    for field in schema:
        h.update(f"{field.name}\t{field.type}\n".encode())
    h.update(f"rows\t{rows}\n".encode())
    for key in (_MARK, _RUN_KEY):
        h.update(key + b"\t" + meta.get(key, b"") + b"\n")
    return h.hexdigest().encode()


def seal_part(table: pa.Table, run: Mapping[str, Any] | None = None) -> pa.Table:
    """``table`` with the schema metadata of a log part: the format version, the record of
    how the log was made (if any), and the schema checksum the readers verify."""
    meta = {_MARK: LOG_VERSION}
    if run:
        meta[_RUN_KEY] = json.dumps(run, default=str).encode()
    table = table.replace_schema_metadata(meta)
    meta[_SUM_KEY] = _schema_sum(table.schema, table.num_rows)
    return table.replace_schema_metadata(meta)


def _check_seal(path: Path, schema: pa.Schema, rows: int) -> None:
    """SchemaError unless the part is marked with this log version and its schema checksum
    matches its footer."""
    meta = schema.metadata or {}
    version = meta.get(_MARK)
    if version is None:
        raise SchemaError(
            f"{str(path)!r} is not a tandv log: it is not marked as one (no "
            f"{_MARK.decode()!r} version in its schema metadata); write logs with tandv "
            f"(write_parquet or a tracker)"
        )
    if version == _UNSEALED_VERSION:
        return  # an older tandv's part: its footer carries no checksum to verify
    if version != LOG_VERSION:
        raise SchemaError(
            f"{str(path)!r}: log format version {version.decode(errors='replace')!r}; this "
            f"tandv reads versions {_UNSEALED_VERSION.decode()} and {LOG_VERSION.decode()} "
            f"(a newer tandv wrote it, or the footer is damaged)"
        )
    stored = meta.get(_SUM_KEY)
    if stored is None:
        raise SchemaError(
            f"{str(path)!r}: no schema checksum ({_SUM_KEY.decode()!r}) in its footer; the "
            f"footer is damaged or the part was not written by this version of tandv"
        )
    if stored != _schema_sum(schema, rows):
        raise SchemaError(
            f"{str(path)!r}: damaged footer, its schema checksum does not match its column "
            f"names, types and row count; restore the part or move it out of the log"
        )


def write_parquet(df: pd.DataFrame, path: PathLike) -> Path:
    """Validate ``df`` and write it to the parquet file ``path`` (atomically); the record
    of how the log was made (:func:`run_record`) goes into the file's schema metadata.

    Row order is kept; row groups hold :data:`ROW_GROUP_ROWS` rows, so a log sorted by
    step can be read by step range without decoding the rest. Data pages carry CRC32
    checksums, which the readers verify: a damaged file is reported, never read as data.
    """
    validate(df)
    table = pa.Table.from_arrays(_arrow_columns(df), names=[_flat(c) for c in df.columns])
    table = seal_part(table, run_record(df))
    return atomic_write(path, lambda tmp: write_part_table(table, tmp))


def write_part_table(table: pa.Table, path: str) -> None:
    """Write a log part's Arrow table (flat column names) to the parquet file ``path``:
    row groups of :data:`ROW_GROUP_ROWS` rows, CRC32 page checksums, and dictionary
    encoding for the metadata columns alone. Names, types and steps repeat from row to row;
    statistics and exponent counts seldom do, and building their dictionaries only to give
    them up cost most of the write (a part of 3,180 rows with counts in 30 columns:
    8.2 -> 3.3 ms, and 771 -> 618 KB)."""
    metadata = [name for name in table.column_names if name.startswith(METADATA + _SEP)]
    pq.write_table(
        table,
        path,
        row_group_size=ROW_GROUP_ROWS,
        write_page_checksum=True,
        use_dictionary=metadata,
    )


def _arrow_columns(df: pd.DataFrame) -> list[pa.Array]:
    """The columns of ``df`` as Arrow arrays, in order, built straight from their values
    (not ``pa.Table.from_pandas``, whose pandas bookkeeping dominated a flush), and the
    numeric columns of one numpy dtype read as one block: looking columns up one by one in
    the two-level index cost most of a flush (schema/DESIGN.md)."""
    dtypes = list(df.dtypes)
    arrays: list[pa.Array | None] = [None] * len(dtypes)
    blocks: dict[np.dtype, list[int]] = {}
    for i, (c, dt) in enumerate(zip(df.columns, dtypes)):
        if c[0] != METADATA and isinstance(dt, np.dtype) and dt.kind in "iuf":
            blocks.setdefault(dt, []).append(i)
    for dt, at in blocks.items():
        block = np.ascontiguousarray(df.iloc[:, at].to_numpy(dtype=dt).T)  # a row per column
        for i, values in zip(at, block):
            arrays[i] = pa.array(values)
    for i, c in enumerate(df.columns):
        if arrays[i] is not None:
            continue
        s = df.iloc[:, i]
        kind = pa.string() if c[0] == METADATA and c[1] != STEP else None
        if kind is not None and len(s) == 0:
            arrays[i] = pa.array([], kind)  # an empty frame's str columns may have any dtype
        else:
            arrays[i] = pa.array(
                s.array if ptypes.is_extension_array_dtype(s.dtype) else s.to_numpy(), type=kind
            )
    return arrays


def _parquet_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.glob("*.parquet") if not p.name.startswith("."))
        if not files:
            raise FileNotFoundError(f"no .parquet part files in directory {str(path)!r}")
        for p in files:
            if not p.is_file():
                raise SchemaError(
                    f"{str(p)!r} is not a part file (a directory or a special file named like "
                    f"one); move it out of the log"
                )
        return files
    if path.is_file():
        return [path]
    raise FileNotFoundError(f"no log file or directory at {str(path)!r}")


def _flat_key(key: Any) -> str:
    """A user's column key as a flat parquet name: a ``(group, label)`` tuple, a metadata
    name, a flat name (``"exponent_counts.-3"``), an exponent label (``-3``, ``"+inf"``)
    or a statistic name.

    Raises:
        ValueError: for anything else (a tuple of another length, a float, an unknown
            group or metadata column, an exponent label not spelt as tandv writes it).
    """
    if isinstance(key, tuple):
        if len(key) != 2:
            raise ValueError(
                f"column {key!r}: a column key is a (group, label) tuple with a group in "
                f"{list(GROUPS)}, e.g. ('scalar_stats', 'rm2') or ('exponent_counts', -3)"
            )
        group, label = key
    elif isinstance(key, str) and key in META_COLUMNS:
        group, label = METADATA, key
    elif isinstance(key, str) and key.partition(_SEP)[0] in GROUPS:
        group, _, label = key.partition(_SEP)
    elif is_exponent_label(key) or key in (UNDERFLOW, OVERFLOW):
        group, label = EXPONENT_COUNTS, key
    elif isinstance(key, str) and key:
        group, label = SCALAR_STATS, key
    else:
        raise ValueError(
            f"column {key!r}: expected a statistic name (str), an exponent label (int, "
            f"{UNDERFLOW!r} or {OVERFLOW!r}), a metadata name or a (group, label) tuple"
        )
    if group == METADATA and label not in META_COLUMNS:
        raise ValueError(f"column {key!r}: the metadata columns are {list(META_COLUMNS)}")
    if group == EXPONENT_COUNTS and not (
        is_exponent_label(label)
        or label in (UNDERFLOW, OVERFLOW)
        or (isinstance(label, str) and _INT_LABEL.fullmatch(label))
    ):
        raise ValueError(
            f"column {key!r}: an exponent label is an int (e.g. -3) or {UNDERFLOW!r}/{OVERFLOW!r}"
        )
    if group == SCALAR_STATS and not (isinstance(label, str) and label):
        raise ValueError(f"column {key!r}: a statistic name is a non-empty str")
    if group not in GROUPS:
        raise ValueError(f"column {key!r}: unknown group {group!r}; expected one of {GROUPS}")
    if group == EXPONENT_COUNTS and not isinstance(label, str):
        label = int(label)
    return f"{group}{_SEP}{label}"


def _part_error(
    path: Path, what: str, row: int | None = None, column: str | None = None
) -> SchemaError:
    where = (
        f"{str(path)!r}"
        + (f", column {column!r}" if column else "")
        + (f", row {row}" if row is not None else "")
    )
    return SchemaError(
        f"{where}: {what}", column=None if column is None else _unflat_safe(column), row=row
    )


def _unflat_safe(name: str) -> Any:
    try:
        return _unflat(name)
    except ValueError:
        return name


def _first_bad_count(values: pa.ChunkedArray | pa.Array) -> tuple[int, Any] | None:
    """The first row of a stored count column that is not a whole number >= 0 (null, NaN,
    a fraction, a negative value), with that value; None if every value is fine."""
    if values.null_count:
        nulls = np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))
        return int(nulls[0]), None
    a = values.to_numpy(zero_copy_only=False)
    if a.dtype.kind == "f":
        bad = ~np.isfinite(a) | (a < 0) | (a != np.round(a))
    else:
        bad = a < 0
    rows = np.flatnonzero(bad)
    return (int(rows[0]), a[rows[0]].item()) if rows.size else None


def _is_string_type(t: pa.DataType) -> bool:
    """A string column as Arrow stores it: plain, large, or dictionary-encoded."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


def _check_meta_field(path: Path, name: str, label: str, t: pa.DataType) -> None:
    """A part's metadata column ``name`` (``label`` within the group), stored as ``t``."""
    if label not in META_COLUMNS:
        raise _part_error(
            path,
            f"unexpected metadata column; expected exactly {list(META_COLUMNS)}",
            column=name,
        )
    ok = pa.types.is_integer(t) if label == STEP else _is_string_type(t)
    if not ok:
        raise _part_error(
            path,
            f"expected {'integer steps' if label == STEP else 'strings'}; stored as {t}",
            column=name,
        )


def _check_count_field(path: Path, name: str, label: str, t: pa.DataType) -> None:
    """A part's exponent-count column ``name`` (``label`` within the group), stored as
    ``t``; a float column's values are read and checked to be whole counts >= 0."""
    if label not in (UNDERFLOW, OVERFLOW) and not _INT_LABEL.fullmatch(label):
        raise _part_error(
            path,
            f"exponent labels must be integers as tandv writes them (e.g. "
            f"'-3', '0', '12': no leading zeros, no '-0') or "
            f"{UNDERFLOW!r}/{OVERFLOW!r}; found {label!r}",
            column=name,
        )
    if pa.types.is_floating(t):
        bad = _first_bad_count(pq.read_table(path, columns=[name]).column(0))
        if bad is not None:
            raise _part_error(path, f"expected a whole count >= 0; found {bad[1]!r}", bad[0], name)
    elif not pa.types.is_integer(t):
        raise _part_error(path, f"expected integer counts; stored as {t}", column=name)


def _check_part(path: Path, schema: pa.Schema) -> None:
    """Check one part's columns against the log schema from its footer alone, and the
    values of any count column stored as floats (read here, for this part only)."""
    names = schema.names
    if not any(n.startswith(METADATA + _SEP) for n in names):
        raise SchemaError(f"{str(path)!r} is not a tandv log: it has no {METADATA!r} columns")
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise _part_error(path, "the column appears twice in the part", column=twice)
    for i, name in enumerate(names):
        group, sep, label = name.partition(_SEP)
        if not sep or group not in GROUPS:
            raise _part_error(
                path,
                f"not a tandv log column; expected '<group>.<label>' with a group "
                f"in {list(GROUPS)}",
                column=name,
            )
        t = schema.field(i).type
        if group == METADATA:
            _check_meta_field(path, name, label, t)
        elif group == SCALAR_STATS:
            if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
                raise _part_error(path, f"expected a numeric statistic; stored as {t}", column=name)
        else:
            _check_count_field(path, name, label, t)
    missing = [c for c in META_COLUMNS if _flat((METADATA, c)) not in names]
    if missing:
        raise _part_error(
            path, f"missing metadata column(s) {missing}; every part holds {list(META_COLUMNS)}"
        )


def _check_filter_value(f: Any, value: Any, strings: bool) -> None:
    """ValueError unless ``value`` can be compared with the column: a str for the string
    metadata, a number (not a bool) for steps, statistics and counts."""
    if strings:
        if not isinstance(value, str):
            raise ValueError(f"filters: {f!r}: the column holds strings; compare it with a str")
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise ValueError(
            f"filters: {f!r}: the column holds numbers; compare it with a number, "
            f"not {type(value).__name__}"
        )


def _open_fragments(path: Path, files: Sequence[Path], fmt: Any) -> tuple[Any, list[Any]]:
    """The dataset over a log's part ``files`` (no schema inference) and its fragments."""
    try:
        found = ds.dataset([str(f) for f in files], schema=pa.schema([]), format=fmt)
        return found, list(found.get_fragments())
    except pa.ArrowException as e:
        if isinstance(e, OSError):
            raise
        raise SchemaError(
            f"{str(path)!r}: not a readable log: {' '.join(str(e).split())}"
        ) from None


def _read_footer(f: Path, fragment: Any, statistics: bool) -> tuple[pa.Schema, int, list[str]]:
    """Part ``f``'s schema, row count and column names from its footer (kept by the
    fragment for the scan with ``statistics``)."""
    try:
        if statistics:  # footer read once, kept by the fragment for the scan
            fragment.ensure_complete_metadata()
            schema, rows = fragment.physical_schema, fragment.metadata.num_rows
        else:
            footer = pq.read_metadata(f)
            schema, rows = footer.schema.to_arrow_schema(), footer.num_rows
        names = schema.names  # decoded here: a damaged name is not UTF-8
    except (OSError, pa.ArrowException, UnicodeDecodeError) as e:
        raise SchemaError(
            f"{str(f)!r} is not a readable parquet file: {' '.join(str(e).split())}"
        ) from None
    return schema, int(rows), list(names)


def _run_of(f: Path, schema: pa.Schema) -> dict[str, Any]:
    """The record of how the log was made, from part ``f``'s schema metadata ({} if none)."""
    if not (schema.metadata and _RUN_KEY in schema.metadata):
        return {}
    try:
        return cast(dict[str, Any], json.loads(schema.metadata[_RUN_KEY]))
    except ValueError:
        raise SchemaError(
            f"{str(f)!r}: the record of how the log was made "
            f"({_RUN_KEY.decode()} in the schema metadata) is not JSON"
        ) from None


def _union_schema(
    stat_types: Mapping[str, set[pa.DataType]],
    exps: Iterable[str],
    present: Mapping[str, int],
    num_parts: int,
) -> pa.Schema:
    """The schema of a log whose parts hold the statistics ``stat_types`` (name -> the
    types they are stored as), the exponent-count columns ``exps``, and each column in
    ``present[name]`` of its ``num_parts`` parts."""
    fields = [
        pa.field(_flat((METADATA, c)), pa.int64() if c == STEP else pa.string())
        for c in META_COLUMNS
    ]
    for name, types in stat_types.items():  # in order of first appearance
        # a statistic some part lacks is NaN there: only a float column can say so
        whole = all(pa.types.is_integer(t) for t in types) and present[name] == num_parts
        fields.append(pa.field(name, pa.int64() if whole else pa.float64()))
    for key in canonical_columns(_unflat(n) for n in exps):
        fields.append(pa.field(_flat(key), pa.int64()))
    return pa.schema(fields)


class ParquetLog:
    """An opened parquet log: its part files, each checked from its footer, and one
    ``pyarrow.dataset`` over them whose schema is the union of the parts' columns."""

    def __init__(self, path: PathLike, *, statistics: bool = True) -> None:
        """Open the log at ``path``: read and check every part's footer. With
        ``statistics`` the footers stay in memory (about 0.2 MB per part of 70 columns) for
        the scan to skip parts and row groups by their statistics; a scan of every row
        needs none, and reads each footer again as it opens the part."""
        self.path = Path(path)
        self.files = _parquet_files(self.path)
        if self.path.is_file() and _magic(self.path) == "pickle":
            raise SchemaError(
                f"{str(self.path)!r} holds a pickle but its name does not end in .pkl or .pickle; "
                f"pickles are read only by that suffix (reading one runs code from the file): "
                f"rename it if you trust it"
            )
        fmt = ds.ParquetFileFormat(
            default_fragment_scan_options=ds.ParquetFragmentScanOptions(
                page_checksum_verification=True
            )
        )
        found, fragments = _open_fragments(self.path, self.files, fmt)
        self.part_names: dict[str, frozenset[str]] = {}
        stat_types: dict[str, set[pa.DataType]] = {}
        exps: set[str] = set()
        checked: set[pa.Schema] = set()  # parts mostly share a schema: check each once
        present: dict[str, int] = {}  # column -> parts holding it
        self.num_rows = 0
        self.run: dict[str, Any] = {}
        for f, fragment in zip(self.files, fragments):
            schema, rows, names = _read_footer(f, fragment, statistics)
            _check_seal(f, schema, rows)
            if not self.run:
                self.run = _run_of(f, schema)
            if schema not in checked:
                _check_part(f, schema)
                if not any(
                    pa.types.is_floating(t.type)
                    for t in schema
                    if t.name.startswith(EXPONENT_COUNTS + _SEP)
                ):
                    checked.add(schema)
                for field in schema:
                    group = field.name.partition(_SEP)[0]
                    if group == SCALAR_STATS:
                        stat_types.setdefault(field.name, set()).add(field.type)
                    elif group == EXPONENT_COUNTS:
                        exps.add(field.name)
            self.part_names[fragment.path] = frozenset(names)
            self.num_rows += rows
            for name in names:
                present[name] = present.get(name, 0) + 1
        self.schema = _union_schema(stat_types, exps, present, len(fragments))
        self._fragments = fragments if statistics else []
        self.dataset = (
            ds.FileSystemDataset(fragments, self.schema, fmt, found.filesystem)
            if statistics
            else ds.dataset([str(f) for f in self.files], schema=self.schema, format=fmt)
        )

    @property
    def columns(self) -> list[tuple[str, Any]]:
        """The log's column keys, in log order."""
        return [_unflat(n) for n in self.schema.names]

    def projection(self, columns: Sequence[Any] | None) -> list[str]:
        """Flat names to read for the user's ``columns``: metadata and the -inf/+inf counts
        always, and a statistic (``numel`` if the log has it) when none is asked for, so
        that the result is a valid log."""
        if columns is None:
            return cast(list[str], self.schema.names)
        if isinstance(columns, (str, bytes, tuple)) or not isinstance(columns, Iterable):
            raise ValueError(
                f"columns={columns!r}: expected a list of statistic names, exponent labels "
                f"or (group, label) tuples"
            )
        wanted = [_flat((METADATA, c)) for c in META_COLUMNS]
        wanted += [k for k in map(_flat_key, columns) if k not in wanted]
        for k in wanted:
            if k not in self.schema.names and k.partition(_SEP)[0] != EXPONENT_COUNTS:
                raise SchemaError(
                    f"{str(self.path)!r}: no column {_unflat_safe(k)!r} in the log; it has "
                    f"{[c for g, c in self.columns if g == SCALAR_STATS]} "
                    f"(statistics) and exponent columns"
                )
        self._add_exponents([k for k in wanted if k not in self.schema.names])
        stats = [n for n in self.schema.names if n.startswith(SCALAR_STATS + _SEP)]
        if stats and not any(k.startswith(SCALAR_STATS + _SEP) for k in wanted):
            wanted.append(
                _flat((SCALAR_STATS, "numel"))
                if _flat((SCALAR_STATS, "numel")) in stats
                else stats[0]
            )
        for label in (UNDERFLOW, OVERFLOW):
            if _flat((EXPONENT_COUNTS, label)) not in wanted:
                wanted.append(_flat((EXPONENT_COUNTS, label)))
        return [n for n in map(_flat, canonical_columns(map(_unflat, wanted)))]

    def _add_exponents(self, names: list[str]) -> None:
        """Exponent columns no part holds, added to the scan's schema: they read as zero
        counts everywhere, as a missing exponent column means."""
        if names:
            self.schema = pa.schema(
                [*self.schema, *(pa.field(n, pa.int64()) for n in names)], self.schema.metadata
            )
            self.dataset = self.dataset.replace_schema(self.schema)

    def filter_expression(self, filters: Sequence[Any] | None) -> ds.Expression | None:
        """``filters`` in pyarrow's list form (``[(col, op, value), ...]``, or a list of
        such lists meaning OR) as a dataset expression. An exponent column reads as 0 in a
        part that lacks it, as everywhere else."""
        if not filters:
            return None
        if not isinstance(filters, (list, tuple)):
            raise ValueError(f"filters={filters!r}: expected a list of (column, op, value) tuples")
        dnf = filters if isinstance(filters[0], list) else [filters]

        def term(f: Any) -> ds.Expression:
            if not (isinstance(f, (tuple, list)) and len(f) == 3):
                raise ValueError(f"filters: {f!r} is not a (column, op, value) tuple")
            key, op, value = f
            name = _flat_key(key)
            group = name.partition(_SEP)[0]
            if group == EXPONENT_COUNTS:
                field = (
                    pc.coalesce(ds.field(name), pa.scalar(0, pa.int64()))
                    if name in self.schema.names
                    else ds.scalar(0)
                )
            elif name in self.schema.names:
                field = ds.field(name)
                if pa.types.is_floating(self.schema.field(name).type):
                    # as in the full frame: NaN where a part lacks the statistic
                    field = pc.coalesce(field, pa.scalar(float("nan")))
            else:
                raise SchemaError(
                    f"filters: no column {_unflat_safe(name)!r} in the log at {str(self.path)!r}"
                )
            strings = group == METADATA and name != _flat((METADATA, STEP))
            if op in ("in", "not in"):
                if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
                    raise ValueError(f"filters: {f!r}: {op!r} takes a list of values")
                value = list(value)
                for v in value:
                    _check_filter_value(f, v, strings)
                e = field.isin(value)
                return ~e if op == "not in" else e
            if op in _FILTER_OPS:
                _check_filter_value(f, value, strings)
                return _FILTER_OPS[op](field, value)
            raise ValueError(
                f"filters: unknown operator {op!r} in {f!r}; expected one of "
                f"{[*_FILTER_OPS, 'in', 'not in']}"
            )

        expr = None
        used: set[str] = set()
        for conj in dnf:
            c = None
            for f in conj:
                t = term(f)
                used.add(_flat_key(f[0]))
                c = t if c is None else c & t
            if c is not None:
                expr = c if expr is None else expr | c
        self._check_statistics(used)
        return expr

    def _check_statistics(self, names: set[str]) -> None:
        """SchemaError for a part whose footer describes a filtered column's chunks with a
        physical type other than its schema's, or with statistics that do not decode: the
        scan evaluates the filter on those statistics, and pyarrow then hangs or aborts the
        process instead of raising (a bit flip in the footer can do it)."""
        for fragment in self._fragments:
            md = fragment.metadata
            at = {md.schema.column(i).path: i for i in range(md.num_columns)}
            for name in names & at.keys():
                i = at[name]
                want = md.schema.column(i).physical_type
                for r in range(md.num_row_groups):
                    try:
                        chunk = md.row_group(r).column(i)
                        ok = chunk.physical_type == want
                        if ok and chunk.is_stats_set and chunk.statistics.has_min_max:
                            _ = (chunk.statistics.min, chunk.statistics.max)  # they decode
                    except (OSError, ValueError, pa.ArrowException):
                        ok = False
                    if not ok:
                        raise _part_error(
                            Path(fragment.path),
                            "damaged footer: the column's chunks are described with another "
                            "type than its schema's; restore the part or move it out of the log",
                            column=name,
                        )

    def tables(
        self, names: list[str], expr: ds.Expression | None, chunk_rows: int | None
    ) -> Iterator[tuple[dict[str, np.ndarray | pa.ChunkedArray], list[tuple[int, str, int]]]]:
        """The selected rows and columns (numpy arrays, arrow strings), of at least
        ``chunk_rows`` rows (all rows in one table if None), each with its provenance:
        ``(first row in the table, part file, rows of that part read before)`` per piece.

        Numeric columns are copied, batch by batch as the scan goes, into one contiguous
        numpy array each (which pandas then takes over without a copy): an exponent column a
        part lacks is zeros there, a statistic it lacks NaN; a null stored in a count or
        step column, or a damaged page, is a SchemaError naming the part."""
        numeric = [
            (i, n, np.dtype(self.schema.field(n).type.to_pandas_dtype()))
            for i, n in enumerate(names)
            if self.schema.field(n).type != pa.string()
        ]
        count_names = {n for n in names if n.startswith(EXPONENT_COUNTS + _SEP)}
        strings = [(i, n) for i, n in enumerate(names) if self.schema.field(n).type == pa.string()]
        capacity = (
            self.num_rows if chunk_rows is None else min(self.num_rows, chunk_rows + _BATCH_ROWS)
        )
        # chunks are consumed slower than threads decode: the threads' read-ahead would
        # hold up to a gigabyte of decoded batches, so chunks are decoded on demand
        scanner = self.dataset.scanner(
            columns=names, filter=expr, batch_size=_BATCH_ROWS, use_threads=chunk_rows is None
        )

        def fresh() -> tuple[dict[str, np.ndarray], dict[str, list[pa.Array]]]:
            # One block per dtype, one row per column: a single large allocation is mapped
            # and unmapped whole, where many 1 MB arrays per chunk would fragment the C heap
            # and leave resident memory behind; np.empty reserves address space only, so
            # pages a filter leaves unwritten cost nothing.
            nums: dict[str, np.ndarray] = {}
            for dt in {dt for _, _, dt in numeric}:
                cols = [n for _, n, d in numeric if d == dt]
                block = np.empty((len(cols), capacity), dt)
                nums.update(zip(cols, block))
            return nums, {n: [] for _, n in strings}

        def table(
            nums: dict[str, np.ndarray], strs: dict[str, list[pa.Array]], rows: int
        ) -> dict[str, np.ndarray | pa.ChunkedArray]:
            return {
                n: pa.chunked_array(strs[n], pa.string()) if n in strs else nums[n][:rows]
                for n in names
            }

        nums, strs = fresh()
        origin: list[tuple[int, str, int]] = []
        rows = 0
        seen: dict[str, int] = {}
        last = None
        it = iter(scanner.scan_batches())
        while True:
            try:
                tagged = next(it)
            except StopIteration:
                break
            except (OSError, pa.ArrowException) as e:
                raise self._damaged(names, last, e) from None
            batch, part = tagged.record_batch, tagged.fragment.path
            last = part
            n = batch.num_rows
            if n == 0:
                continue
            for i, name, dt in numeric:
                self._copy_column(
                    batch.column(i),
                    nums[name][rows : rows + n],
                    (part, name, dt),
                    name in count_names,
                    seen.get(part, 0),
                    expr is not None,
                )
            for i, name in strings:
                strs[name].append(batch.column(i))
            origin.append((rows, part, seen.get(part, 0)))
            seen[part] = seen.get(part, 0) + n
            rows += n
            if chunk_rows is not None and rows >= chunk_rows:
                yield table(nums, strs, rows), origin
                nums, strs = fresh()
                origin, rows = [], 0
        if rows or chunk_rows is None:
            yield table(nums, strs, rows), origin

    def _copy_column(
        self,
        col: pa.Array,
        out: np.ndarray,
        where: tuple[str, str, np.dtype[Any]],
        is_count: bool,
        before: int,
        filtered: bool,
    ) -> None:
        """Copy one batch's column ``col`` into ``out``; ``where``: its part, column name
        and numpy dtype; ``before``: the part's rows read before this batch. A column the
        part lacks is zeros (a statistic: NaN); a count's rule (>= 0) is checked here, on
        data still in cache, so that validating the frame need not read every count again
        (``check(counts=False)``)."""
        part, name, dt = where
        if col.null_count:
            if name not in self.part_names[part]:
                out[:] = np.nan if dt.kind == "f" else 0  # absent from this part
                return
            if dt.kind != "f":
                raise self._stored_null(part, name)
        out[:] = col.to_numpy(zero_copy_only=False)  # a stored null statistic reads NaN
        if is_count and out.min() < 0:
            row = int(np.argmin(out >= 0))
            which = " (counting the rows the filters kept)" if filtered else ""
            raise _part_error(
                Path(part),
                f"expected a count >= 0; found {out[row].item()}{which}",
                before + row,
                name,
            )

    def _stored_null(self, part: str, name: str) -> SchemaError:
        col = pq.read_table(part, columns=[name]).column(0)
        bad = _first_bad_count(col)
        row = None if bad is None else bad[0]
        return _part_error(Path(part), "expected a count; found a missing value (null)", row, name)

    def _damaged(self, names: list[str], last: str | None, err: BaseException) -> SchemaError:
        """The error for a scan that failed: the first part, from the last one read on,
        that fails when read alone (page checksums verified)."""
        paths = list(self.part_names)
        start = 0 if last is None else paths.index(last)
        for f in paths[start:]:
            cols = [n for n in names if n in self.part_names[f]]
            try:
                pq.read_table(f, columns=cols, page_checksum_verification=True)
            except (OSError, pa.ArrowException) as e:
                why = " ".join(str(e).split())  # arrow's messages span lines
                return SchemaError(
                    f"{str(f)!r}: damaged part, its data cannot be decoded ({why}); "
                    f"restore it or move it out of the log"
                )
        return SchemaError(
            f"{str(self.path)!r}: reading the log failed: {' '.join(str(err).split())}"
        )


def _frame(columns: dict[str, np.ndarray | pa.ChunkedArray]) -> pd.DataFrame:
    """A log DataFrame from flat columns: numpy arrays are taken over as they are (one
    block each, writable, not copied), arrow strings become pandas' string columns."""
    keys = [_unflat(n) for n in columns]
    df = pd.DataFrame(
        {n: c.to_pandas() if isinstance(c, pa.ChunkedArray) else c for n, c in columns.items()},
        copy=False,
    )
    df.columns = pd.MultiIndex.from_tuples(keys)
    return df


def _validated(
    df: pd.DataFrame, origin: list[tuple[int, str, int]], filtered: bool, duplicates: bool = True
) -> pd.DataFrame:
    """``validate(df)``; an error about one row also names the part file and its row there."""
    try:
        return check(df, duplicates=duplicates, counts=False)  # counts: checked in tables()
    except SchemaError as e:
        if e.row is None or not origin:
            raise
        starts = [o[0] for o in origin]
        k = bisect.bisect_right(starts, e.row) - 1
        first, part, before = origin[k]
        row = before + e.row - first
        where = f"row {row} of the rows read with the filters" if filtered else f"row {row}"
        raise SchemaError(f"{str(part)!r}, {where}: {e}", column=e.column, row=row) from None


def read_parquet(
    path: PathLike,
    columns: Sequence[Any] | None = None,
    filters: Sequence[Any] | None = None,
) -> pd.DataFrame:
    """Read a parquet log (one file, or a directory of part files) and validate it.

    Built on ``pyarrow.dataset``: the parts' columns are unified (an exponent column a
    part lacks reads as 0 there, the only value ever filled in), only the columns asked
    for are decoded, and filters are pushed down, so row-group statistics skip the parts
    and row groups a step filter excludes.

    Arguments:
        path: a ``.parquet`` file or a directory of them.
        columns: scalar statistics and exponent columns to read, each as a tuple
            (``("scalar_stats", "rm2")``), a statistic name (``"rm2"``) or an exponent
            label (``-3``, ``"+inf"``). Metadata and the ``-inf``/``+inf`` counts are always
            read, and ``numel`` when no statistic is asked for. Default: everything.
        filters: row filters in pyarrow's form, e.g. ``[("step", ">=", 100),
            ("tensor_type", "==", "Gradient")]`` (a list of such lists means OR);
            metadata columns may be named bare, exponent columns by label.

    Raises:
        FileNotFoundError: if nothing is at ``path``.
        SchemaError: if a file is not a tandv log, is damaged, or holds a value the
            schema forbids (the message names the file, the column and the row).
    """
    log = ParquetLog(path, statistics=bool(filters))
    names = log.projection(columns)
    expr = log.filter_expression(filters)
    table, origin = next(log.tables(names, expr, None))
    df = _validated(_frame(table), origin, expr is not None)
    if log.run:
        df.attrs[RUN_ATTR] = log.run
    df.attrs[SOURCE_ATTR] = str(log.path.resolve())  # where read_scalars(df) finds the scalars
    return df


def read_parquet_chunks(
    path: PathLike | ParquetLog,
    columns: Sequence[Any] | None = None,
    filters: Sequence[Any] | None = None,
    chunk_rows: int = CHUNK_ROWS,
) -> Iterator[pd.DataFrame]:
    """:func:`read_parquet` in pieces of about ``chunk_rows`` rows, each a validated log
    frame, so that a log larger than memory can be summarized. Rows come in the log's
    order; once all are read, a (name, tensor_type, step) seen twice anywhere in the log
    raises SchemaError, as :func:`read_parquet` would."""
    log = path if isinstance(path, ParquetLog) else ParquetLog(path, statistics=bool(filters))
    names = log.projection(columns)
    expr = log.filter_expression(filters)
    ids: dict[tuple[str, str], int] = {}
    # every row's (name, tensor_type) id and step, for the log-wide duplicate check: one
    # allocation each (long-lived small arrays, one per chunk, would fragment the C heap)
    keys = np.empty(log.num_rows, np.int64)
    steps = np.empty(log.num_rows, np.int64)
    done = 0
    for table, origin in log.tables(names, expr, chunk_rows):
        df = _validated(_frame(table), origin, expr is not None, duplicates=False)
        if log.run:
            df.attrs[RUN_ATTR] = log.run
        # (name, tensor_type) -> an id over the whole log, through the chunk's codes
        name_codes, name_values = pd.factorize(df[(METADATA, "name")])
        kind_codes, kind_values = pd.factorize(df[(METADATA, "tensor_type")])
        name_values, kind_values = (
            list(np.asarray(name_values, object)),
            list(np.asarray(kind_values, object)),
        )
        pair = name_codes.astype(np.int64) * max(1, len(kind_values)) + kind_codes
        pairs, inverse = np.unique(pair, return_inverse=True)
        gid = np.array(
            [
                ids.setdefault(
                    (name_values[p // len(kind_values)], kind_values[p % len(kind_values)]),
                    len(ids),
                )
                for p in pairs.tolist()
            ],
            dtype=np.int64,
        )
        keys[done : done + len(df)] = gid[inverse.ravel()]
        steps[done : done + len(df)] = df[(METADATA, STEP)].to_numpy(dtype=np.int64)
        done += len(df)
        yield df
    if done:
        _check_unique(log.path, ids, keys[:done], steps[:done])


def _check_unique(
    path: Path, ids: dict[tuple[str, str], int], k: np.ndarray, st: np.ndarray
) -> None:
    """SchemaError if a (name, tensor_type) id and step pair occurs twice: the pairs as
    one int64 key, sorted in place (lean: no hash table over millions of rows)."""
    low, span = int(st.min()), int(st.max()) - int(st.min()) + 1
    if len(ids) * span < 2**62:
        k *= span
        k += st
        k -= low
        k.sort()
        same = np.flatnonzero(k[1:] == k[:-1])
        if same.size:
            key = int(k[same[0]])
            gid, step = key // span, key % span + low
            name = next(n for n, v in ids.items() if v == gid)
            raise SchemaError(
                f"{str(path)!r}: duplicate rows for (name, tensor_type, step) = "
                f"{(*name, step)}; each tensor has at most one row per step"
            )
        return
    dup = pd.DataFrame({"k": k, "s": st}).duplicated().to_numpy()  # no room for one key
    if dup.any():
        i = int(np.flatnonzero(dup)[0])
        name = next(n for n, v in ids.items() if v == k[i])
        raise SchemaError(
            f"{str(path)!r}: duplicate rows for (name, tensor_type, step) = "
            f"{(*name, int(st[i]))}; each tensor has at most one row per step"
        )


def log_columns(path: PathLike, *, trust_pickle: bool = False) -> list[tuple[str, Any]]:
    """The column keys of a log in log order (a parquet log's from its footers alone; a
    pickle's only with ``trust_pickle=True``, as :func:`read_log`)."""
    p = Path(path)
    if _suffix_format(p) == "pickle":
        require_trust(p, trust_pickle, "log_columns")
        return list(read_pickle(p).columns)
    return ParquetLog(p, statistics=False).columns


# ----------------------------------------------------------------------------- either

#: The suffixes of a pickle log (any other path is read as parquet).
PICKLE_SUFFIXES = (".pkl", ".pickle")


def _suffix_format(path: Path) -> str:
    return "pickle" if path.suffix.lower() in PICKLE_SUFFIXES else "parquet"


def require_trust(path: PathLike, trust_pickle: bool, what: str) -> None:
    """Refuse to unpickle ``path`` unless the caller said it trusts it.

    Raises:
        ValueError: for a ``.pkl``/``.pickle`` path without ``trust_pickle=True``.
    """
    if _suffix_format(Path(path)) == "pickle" and trust_pickle is not True:
        raise ValueError(
            f"{what}: {str(path)!r} is a pickle, and reading a pickle runs code stored in it; "
            f"pass trust_pickle=True if you made it or trust its source (parquet logs are data "
            f"only and need no such flag)"
        )


def read_log(path: PathLike, *, trust_pickle: bool = False, **kwargs: Any) -> pd.DataFrame:
    """Read a log in either format; the suffix decides: ``.pkl``/``.pickle`` files are
    read as pickle, and only with ``trust_pickle=True`` (unpickling runs code stored in
    the file; :func:`read_pickle` is the explicit call), anything else as parquet (a file
    or a directory of parts; ``kwargs`` go to :func:`read_parquet`).

    Raises:
        SchemaError: also when the content does not match the suffix (parquet data in a
            ``.pkl`` file, a pickle without one), saying how to rename it.
        ValueError: for a pickle without ``trust_pickle=True``.
    """
    p = Path(path)
    if _suffix_format(p) == "pickle":
        require_trust(p, trust_pickle, "read_log")
        if kwargs:
            raise TypeError(f"read_log: {sorted(kwargs)} apply to parquet logs only")
        return read_pickle(p)
    return read_parquet(p, **kwargs)
