"""Streaming log writers: rows leave memory as a run goes.

:class:`PartWriter` writes each flushed batch of rows as one parquet part file in a
directory (``part-000000.parquet``, ...), renamed into place atomically, so a crash
loses at most the rows not yet flushed and closing never re-reads the log.
:class:`PickleWriter` keeps the rows and writes one pickle file at close.

A log path belongs to one run from the moment its writer opens: the writer creates a
claim file (``<dir>/.tandv-claim`` for parquet, ``.<name>.tandv-claim`` beside a pickle)
with ``O_CREAT | O_EXCL``, which a second run on the same path finds at once and is
refused by. The claim goes when the writer closes; the pickle's final file is linked
into place (``os.link``), which fails rather than replace a file someone else made.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import ml_dtypes
import numpy as np
import pandas as pd
import pyarrow as pa

from .columns import (
    EXPONENT_COUNTS,
    META_COLUMNS,
    METADATA,
    OVERFLOW,
    SCALAR_STATS,
    TENSOR_TYPES,
    UNDERFLOW,
)
from .io import (
    PICKLE_SUFFIXES,
    RUN_ATTR,
    atomic_write,
    concat_logs,
    drop_empty_exponents,
    exclusive_write,
    pickle_bytes,
    seal_part,
    write_parquet,
    write_part_table,
)
from .validate import is_exponent_label, validate

__all__ = [
    "Rows",
    "LogWriter",
    "PartWriter",
    "PickleWriter",
    "open_writer",
    "prepare_directory",
    "claim_log",
    "check_suffix",
    "FORMATS",
]

#: Accepted values of ``out_format``.
FORMATS = ("parquet", "pickle")
#: Name of a parquet log's claim file inside its directory.
CLAIM_NAME = ".tandv-claim"


def claim_file(path: Path, out_format: str) -> Path:
    """Where the claim of the log at ``path`` lives."""
    if out_format == "parquet":
        return path / CLAIM_NAME
    return path.with_name(f".{path.name}.tandv-claim")


def claim_log(path: Path, out_format: str) -> Path:
    """Claim the log path ``path`` for this run: create its claim file atomically
    (``O_CREAT | O_EXCL``) holding this process's id, host and start time; returns it.

    Raises:
        FileExistsError: if another run holds the claim (the message names that run and
            says how to free a claim that a crashed run left behind).
    """
    claim = claim_file(path, out_format)
    note = {"pid": os.getpid(), "host": platform.node(), "since": time.time()}
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:
            held = json.loads(claim.read_text())
            who = (
                f"process {held['pid']} on host {held['host']}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(held['since']))}"
            )
        except (OSError, ValueError, KeyError, TypeError, OverflowError):
            who = "an unknown process"
        raise FileExistsError(
            f"log {str(path)!r} is being written by another run ({who}); choose another "
            f"`out`, or, if no run is writing it (a run that crashed), remove {str(claim)!r}",
        ) from None
    with os.fdopen(fd, "w") as f:
        json.dump(note, f)
    return claim


def release_claim(claim: Path | None) -> None:
    """Remove a claim file made by :func:`claim_log` in this process (never another's)."""
    if claim is None:
        return
    try:
        if json.loads(claim.read_text()).get("pid") == os.getpid():
            claim.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def check_suffix(path: Path, out_format: str) -> None:
    """Refuse a log path whose suffix says the other format: readers choose the format by
    the suffix (``.pkl``/``.pickle``: pickle; anything else: parquet), so such a log could
    not be read back.

    Raises:
        ValueError: naming ``out_format``, the path and what to change.
    """
    pickled = path.suffix.lower() in PICKLE_SUFFIXES
    if out_format == "pickle" and not pickled:
        raise ValueError(
            f"out_format='pickle' with out={str(path)!r}: a pickle log's name must end in "
            f"{' or '.join(PICKLE_SUFFIXES)} (readers choose the format by the suffix); "
            f"add the suffix or use out_format='parquet'"
        )
    if out_format == "parquet" and pickled:
        raise ValueError(
            f"out_format='parquet' with out={str(path)!r}: a name ending in {path.suffix} is "
            f"read as a pickle; drop the suffix or use out_format='pickle'"
        )


def step_period(steps: np.ndarray, *columns: Sequence[Any]) -> int:
    """The length ``p`` of the blocks rows come in when each block is one step's and holds
    the same values of ``columns`` in the same order as the first (a batch of steps that
    each logged the same tensors, a training loop's steady state); 0 where they do not
    (or there are no rows). The steps are compared by numpy, each column block by block
    by a list comparison, which compares each value's identity first: a few microseconds
    for thousands of rows, where building or checking every row's strings costs hundreds.
    Columns that are not lists give 0."""
    n = len(steps)
    if not n or not all(type(c) is list and len(c) == n for c in columns):
        return 0
    later = np.flatnonzero(steps != steps[0])
    p = int(later[0]) if later.size else n
    if n % p:
        return 0
    blocks = steps.reshape(n // p, p)
    if not (blocks == blocks[:, :1]).all():
        return 0
    for c in columns:
        first = c[:p]
        if any(c[i : i + p] != first for i in range(p, n, p)):
            return 0
    return p


@dataclass(frozen=True)
class Rows:
    """Log rows as plain columns, before any DataFrame: what a tracker's recorder builds
    for each part (:func:`tandv.track.common.build_rows` makes the DataFrame of them).

    A parquet part is written from these columns straight into Arrow
    (:meth:`PartWriter.write`): building, checking and converting a two-level
    pandas frame cost most of the writer thread's time per step.

    Attributes:
        names, types, tensor_types, dtypes: the string metadata columns, one value per row.
        steps: the step of each row (int64).
        stats: the scalar statistics by column name, in column order (float64, or int64
            for the counts).
        labels: the exponent-count column labels in column order (``-inf``, ascending
            exponents, ``+inf``).
        counts: the ``(rows, len(labels))`` int64 exponent counts.
    """

    names: Sequence[str]
    types: Sequence[str]
    tensor_types: Sequence[str]
    steps: np.ndarray
    dtypes: Sequence[str]
    stats: dict[str, np.ndarray]
    labels: Sequence[int | str]
    counts: np.ndarray

    def __len__(self) -> int:
        return len(self.steps)

    def _meta(self) -> dict[str, Any]:
        return dict(
            zip(META_COLUMNS, (self.names, self.types, self.tensor_types, self.steps, self.dtypes))
        )

    def frame(self) -> pd.DataFrame:
        """The rows as a log DataFrame (two-level columns: metadata, scalar_stats,
        exponent_counts)."""
        parts = [
            pd.DataFrame(self._meta(), columns=list(META_COLUMNS)),
            pd.DataFrame(self.stats),
            pd.DataFrame(self.counts, columns=list(self.labels)),
        ]
        return pd.concat(parts, axis=1, keys=[METADATA, SCALAR_STATS, EXPONENT_COUNTS])

    def table(self) -> pa.Table:
        """The rows as the Arrow table of a parquet part (flat column names
        ``"<group>.<label>"``), exponent columns that are zero in every row left out (as
        :func:`~tandv.schema.io.drop_empty_exponents` does); the same columns, types and
        values as :func:`~tandv.schema.io.write_parquet` stores for :meth:`frame`."""
        arrays: list[pa.Array] = []
        names: list[str] = []
        p, n = self._period, len(self)
        for c, values in self._meta().items():
            if c == "step":
                arrays.append(pa.array(values))
            elif p and n > p:  # one block's strings, repeated (see step_period)
                arrays.append(pa.concat_arrays([pa.array(values[:p], pa.string())] * (n // p)))
            else:
                arrays.append(pa.array(values, pa.string()))
            names.append(f"{METADATA}.{c}")
        for c, values in self.stats.items():
            arrays.append(pa.array(values))
            names.append(f"{SCALAR_STATS}.{c}")
        keep: np.ndarray = (
            self._column_bits != 0
            if self.counts.dtype == np.int64
            else np.asarray(self.counts.any(axis=0))
        )
        kept = [
            j for j, label in enumerate(self.labels) if keep[j] or label in (UNDERFLOW, OVERFLOW)
        ]
        # the kept columns alone (most exponent columns are empty: transposing them all cost
        # the writer thread more than the rest of the table), one contiguous run each of
        # one Arrow array (an Arrow array per numpy column costs ~10 us each, per part)
        block = pa.array(self.counts.T[kept].reshape(-1))
        for i, j in enumerate(kept):
            arrays.append(block.slice(i * n, n))
            names.append(f"{EXPONENT_COUNTS}.{self.labels[j]}")
        return pa.Table.from_arrays(arrays, names=names)

    @cached_property
    def _period(self) -> int:
        """:func:`step_period` of the rows' steps and string columns: the rows' strings
        repeat every so many rows, one step per block (0: they do not)."""
        return step_period(self.steps, self.names, self.types, self.tensor_types, self.dtypes)

    @cached_property
    def _column_bits(self) -> np.ndarray:
        """Per exponent column, the bitwise OR of its int64 counts: nonzero where the column
        holds a count, negative where one is negative. One pass over the counts (the widest
        part of the rows) tells :meth:`conforms` and :meth:`table` both."""
        bits: np.ndarray = np.bitwise_or.reduce(self.counts, axis=0)
        return bits

    def conforms(self) -> bool:
        """Whether the rows certainly pass :func:`~tandv.schema.validate.validate`, told
        from the columns without a DataFrame (what :meth:`frame` would be checked for: str
        metadata, known tensor types, float dtype names, non-negative steps and counts,
        numeric statistics, no repeated column and no repeated (name, tensor_type, step)).
        ``False`` says only that the full check must decide."""
        n = len(self)
        string_cols: tuple[Sequence[str], ...] = (
            self.names,
            self.types,
            self.tensor_types,
            self.dtypes,
        )
        if any(len(c) != n for c in string_cols) or self.counts.shape != (n, len(self.labels)):
            return False
        p = self._period  # (a block's strings are every block's: each is asked once)
        if p:
            string_cols = tuple(c[:p] for c in string_cols)
        for col in string_cols:
            if not all(type(v) is str for v in set(col)):
                return False
        _, _, tensor_types, dtypes = string_cols
        if not set(tensor_types) <= set(TENSOR_TYPES):
            return False
        if not all(_float_dtype_name(d) for d in set(dtypes)):
            return False
        if self.steps.dtype != np.int64 or (n and self.steps.min() < 0):
            return False
        if self.counts.dtype != np.int64 or (self.counts.size and self._column_bits.min() < 0):
            return False
        if not self.stats or not all(
            type(k) is str and k and v.dtype.kind in "if" and v.shape == (n,)
            for k, v in self.stats.items()
        ):
            return False
        labels = list(self.labels)
        if (
            UNDERFLOW not in labels
            or OVERFLOW not in labels
            or len(set(labels)) != len(labels)
            or not all(is_exponent_label(x) or x in (UNDERFLOW, OVERFLOW) for x in labels)
        ):
            return False
        if p:  # one step per block: distinct blocks' steps, distinct rows within a block
            firsts = self.steps[::p]
            names, _, tensor_types, _ = string_cols
            return len(np.unique(firsts)) == len(firsts) and len(set(zip(names, tensor_types))) == p
        return len(set(zip(self.names, self.tensor_types, self.steps.tolist()))) == n


#: dtype names known to be parsed by ``ml_dtypes.finfo`` (the schema's rule for them).
_FLOAT_NAMES: set[str] = set()


def _float_dtype_name(name: str) -> bool:
    if name not in _FLOAT_NAMES:
        try:
            ml_dtypes.finfo(name)  # type: ignore[no-untyped-call]  # (ml_dtypes ships no types)
        except Exception:
            return False
        _FLOAT_NAMES.add(name)
    return True


class LogWriter:
    """Base class: ``write(df)`` some rows, ``close()`` once; ``path`` is where the log is."""

    path: Path
    rows_written: int = 0
    #: The record of how the log was made, written with every part (see ``run_record``).
    run: dict[str, Any] | None = None

    def write(
        self, df: pd.DataFrame | Rows, *, allow_empty: bool = False
    ) -> None:  # pragma: no cover
        """Write rows (a log DataFrame, or :class:`Rows`); none at all is skipped unless
        ``allow_empty`` (an empty log)."""
        raise NotImplementedError

    def close(self) -> Path:  # pragma: no cover - interface
        raise NotImplementedError


def prepare_directory(directory: Path, log: Path) -> None:
    """Create ``directory`` (and its parents) and check that files can be created in it,
    so that a log path that cannot work fails when tracking starts, not when the run ends.

    Raises:
        NotADirectoryError: if ``directory`` or one of its parents is a file.
        OSError: (e.g. PermissionError) if no file can be created in ``directory``;
            the message names the log.
    """
    for p in (directory, *directory.parents):
        if p.exists() and not p.is_dir():
            raise NotADirectoryError(
                f"cannot write the log {str(log)!r}: {str(p)!r} is a file, not a directory"
            )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tandv-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise type(e)(
            e.errno,
            f"cannot write the log {str(log)!r}: cannot create files in "
            f"{str(directory)!r} ({e.strerror})",
        ) from e


class PartWriter(LogWriter):
    """Writes a directory of parquet part files, one per :meth:`write`.

    Rows are written in the order given, which the recorder keeps sorted by step, so that
    each part's statistics cover a step range and a step filter skips the others.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise FileExistsError(f"parquet log directory {str(self.path)!r} is an existing file")
        prepare_directory(self.path, self.path)
        self.claim: Path | None = claim_log(self.path, "parquet")
        # checked once the claim is held: a run that closed just now has its parts in place
        if any(self.path.glob("*.parquet")):
            self.close()
            raise FileExistsError(
                f"parquet log directory {str(self.path)!r} already holds a log; "
                f"choose another `out` or remove it"
            )
        self._parts = 0
        self.rows_written = 0

    def write(self, df: pd.DataFrame | Rows, *, allow_empty: bool = False) -> None:
        """Write rows as one part file. :class:`Rows` go straight from their columns into
        Arrow (the same file content as their DataFrame, :meth:`Rows.frame`, would give);
        rows that may not conform to the schema are checked as a DataFrame first
        (:func:`validate` raises its usual error)."""
        if isinstance(df, Rows):
            self._write_rows(df)
            return
        if df.empty and not allow_empty:
            return
        part = drop_empty_exponents(df)
        if self.run:
            part.attrs[RUN_ATTR] = self.run
        write_parquet(part, self.path / f"part-{self._parts:06d}.parquet")
        self._parts += 1
        self.rows_written += len(df)

    def _write_rows(self, rows: Rows) -> None:
        if not len(rows):
            return
        if not rows.conforms():
            validate(rows.frame())
        table = seal_part(rows.table(), self.run)
        atomic_write(
            self.path / f"part-{self._parts:06d}.parquet",
            lambda tmp: write_part_table(table, tmp),
        )
        self._parts += 1
        self.rows_written += len(rows)

    def close(self) -> Path:
        """Give up the claim on the directory (its parts stay)."""
        release_claim(self.claim)
        self.claim = None
        return self.path


class PickleWriter(LogWriter):
    """Collects rows in memory and writes one pickle file at :meth:`close`.

    The path is checked and claimed when the writer opens, as for parquet: an existing
    file is refused, and so are a parent that is not a directory and a directory where no
    file can be created; ``claimed`` says the caller holds the claim already
    (:func:`claim_log`, as ``resolve_out`` does for a default path).
    """

    def __init__(self, path: str | os.PathLike[str], *, claimed: bool = False) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise IsADirectoryError(
                f"pickle log path {str(self.path)!r} is a directory; give a file name"
            )
        prepare_directory(self.path.parent, self.path)
        self.claim: Path | None = (
            claim_file(self.path, "pickle") if claimed else claim_log(self.path, "pickle")
        )
        if self.path.exists() or self.path.is_symlink():
            release_claim(self.claim)
            raise FileExistsError(
                f"pickle log {str(self.path)!r} already exists; choose another `out` or remove it"
            )
        self._frames: list[pd.DataFrame] = []
        self.rows_written = 0

    def write(self, df: pd.DataFrame | Rows, *, allow_empty: bool = False) -> None:
        if isinstance(df, Rows):
            df = df.frame()
        if df.empty and not allow_empty:
            return
        self._frames.append(drop_empty_exponents(df))
        self.rows_written += len(df)

    def close(self) -> Path:
        """Write the pickle (atomically, never replacing a file that appeared at the path
        meanwhile) and give up the claim.

        Raises:
            RuntimeError: naming the log path, with the cause attached, if writing fails.
        """
        try:
            if self._frames:
                try:
                    df = concat_logs(self._frames)
                    if self.run:
                        df.attrs[RUN_ATTR] = self.run
                    validate(df)
                    data = pickle_bytes(df)
                    exclusive_write(self.path, lambda tmp: Path(tmp).write_bytes(data))
                except Exception as e:
                    raise RuntimeError(
                        f"tandv: writing the log to {str(self.path)!r} failed: "
                        f"{type(e).__name__}: {e}"
                    ) from e
                self._frames = []
        finally:
            release_claim(self.claim)
            self.claim = None
        return self.path


def open_writer(
    path: str | os.PathLike[str],
    out_format: Literal["parquet", "pickle"],
    *,
    claimed: bool = False,
    run: dict[str, Any] | None = None,
) -> LogWriter:
    """A writer for ``out_format`` at ``path`` (a directory for parquet, a file for pickle);
    ``claimed`` says that the caller holds the pickle path's claim (:func:`claim_log`);
    ``run`` is the record of how the log was made (stored with the rows).

    Raises:
        ValueError: for an unknown format, or a path whose suffix says the other format.
        FileExistsError: if another run has claimed the path or a log is there.
    """
    if out_format not in FORMATS:
        raise ValueError(f"out_format={out_format!r}: expected one of {FORMATS}")
    check_suffix(Path(path), out_format)
    if out_format == "parquet":
        writer: LogWriter = PartWriter(path)
    else:
        writer = PickleWriter(path, claimed=claimed)
    writer.run = dict(run) if run else None
    return writer
