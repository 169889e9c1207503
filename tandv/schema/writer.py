"""Streaming log writers: rows leave memory as a run goes.

:class:`PartWriter` writes each flushed batch of rows as one parquet part file in a
directory (``part-000000.parquet``, ...), renamed into place atomically, so a crash
loses at most the rows not yet flushed and closing never re-reads the log.
:class:`PickleWriter` keeps the rows and writes one pickle file at close.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Literal

import pandas as pd

from .io import RUN_ATTR, concat_logs, drop_empty_exponents, write_parquet, write_pickle

__all__ = ["LogWriter", "PartWriter", "PickleWriter", "open_writer", "prepare_directory", "FORMATS"]

#: Accepted values of ``out_format``.
FORMATS = ("parquet", "pickle")


class LogWriter:
    """Base class: ``write(df)`` some rows, ``close()`` once; ``path`` is where the log is."""

    path: Path
    rows_written: int = 0
    #: The record of how the log was made, written with every part (see ``run_record``).
    run: dict | None = None

    def write(self, df: pd.DataFrame, *, allow_empty: bool = False) -> None:  # pragma: no cover
        """Write rows; an empty frame is skipped unless ``allow_empty`` (an empty log)."""
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

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise FileExistsError(f"parquet log directory {str(self.path)!r} is an existing file")
        if self.path.is_dir() and any(self.path.glob("*.parquet")):
            raise FileExistsError(
                f"parquet log directory {str(self.path)!r} already holds a log; "
                f"choose another `out` or remove it"
            )
        prepare_directory(self.path, self.path)
        self._parts = 0
        self.rows_written = 0

    def write(self, df: pd.DataFrame, *, allow_empty: bool = False) -> None:
        if df.empty and not allow_empty:
            return
        part = drop_empty_exponents(df)
        if self.run:
            part.attrs[RUN_ATTR] = self.run
        write_parquet(part, self.path / f"part-{self._parts:06d}.parquet")
        self._parts += 1
        self.rows_written += len(df)

    def close(self) -> Path:
        return self.path


class PickleWriter(LogWriter):
    """Collects rows in memory and writes one pickle file at :meth:`close`.

    The path is checked when the writer opens, as for parquet: an existing file is
    refused (unless ``reserved``: the empty placeholder that reserved a default path), and
    so are a parent that is not a directory and a directory where no file can be created.
    """

    def __init__(self, path: str | os.PathLike, *, reserved: bool = False) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise IsADirectoryError(
                f"pickle log path {str(self.path)!r} is a directory; give a file name"
            )
        if self.path.exists() and not (reserved and self.path.stat().st_size == 0):
            raise FileExistsError(
                f"pickle log {str(self.path)!r} already exists; choose another `out` or remove it"
            )
        prepare_directory(self.path.parent, self.path)
        self._frames: list[pd.DataFrame] = []
        self.rows_written = 0

    def write(self, df: pd.DataFrame, *, allow_empty: bool = False) -> None:
        if df.empty and not allow_empty:
            return
        self._frames.append(drop_empty_exponents(df))
        self.rows_written += len(df)

    def close(self) -> Path:
        """Write the pickle (atomically).

        Raises:
            RuntimeError: naming the log path, with the cause attached, if writing fails.
        """
        if self._frames:
            try:
                df = concat_logs(self._frames)
                if self.run:
                    df.attrs[RUN_ATTR] = self.run
                write_pickle(df, self.path)
            except Exception as e:
                raise RuntimeError(
                    f"tandv: writing the log to {str(self.path)!r} failed: {type(e).__name__}: {e}"
                ) from e
            self._frames = []
        return self.path


def open_writer(
    path: str | os.PathLike,
    out_format: Literal["parquet", "pickle"],
    *,
    reserved: bool = False,
    run: dict | None = None,
) -> LogWriter:
    """A writer for ``out_format`` at ``path`` (a directory for parquet, a file for pickle);
    ``reserved`` says that an empty file at ``path`` is the caller's own placeholder;
    ``run`` is the record of how the log was made (stored with the rows)."""
    if out_format == "parquet":
        writer: LogWriter = PartWriter(path)
    elif out_format == "pickle":
        writer = PickleWriter(path, reserved=reserved)
    else:
        raise ValueError(f"out_format={out_format!r}: expected one of {FORMATS}")
    writer.run = dict(run) if run else None
    return writer
