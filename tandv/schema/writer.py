"""Streaming log writers: rows leave memory as a run goes.

:class:`PartWriter` writes each flushed batch of rows as one parquet part file in a
directory (``part-000000.parquet``, ...), renamed into place atomically, so a crash
loses at most the rows not yet flushed and closing never re-reads the log.
:class:`PickleWriter` keeps the rows and writes one pickle file at close.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import pandas as pd

from .io import concat_logs, drop_empty_exponents, write_parquet, write_pickle

__all__ = ["LogWriter", "PartWriter", "PickleWriter", "open_writer", "FORMATS"]

#: Accepted values of ``out_format``.
FORMATS = ("parquet", "pickle")


class LogWriter:
    """Base class: ``write(df)`` some rows, ``close()`` once; ``path`` is where the log is."""

    path: Path
    rows_written: int = 0

    def write(self, df: pd.DataFrame, *, allow_empty: bool = False) -> None:  # pragma: no cover
        """Write rows; an empty frame is skipped unless ``allow_empty`` (an empty log)."""
        raise NotImplementedError

    def close(self) -> Path:  # pragma: no cover - interface
        raise NotImplementedError


class PartWriter(LogWriter):
    """Writes a directory of parquet part files, one per :meth:`write`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise FileExistsError(f"parquet log directory {str(self.path)!r} is an existing file")
        if self.path.is_dir() and any(self.path.glob("*.parquet")):
            raise FileExistsError(
                f"parquet log directory {str(self.path)!r} already holds a log; "
                f"choose another `out` or remove it"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        self._parts = 0
        self.rows_written = 0

    def write(self, df: pd.DataFrame, *, allow_empty: bool = False) -> None:
        if df.empty and not allow_empty:
            return
        write_parquet(drop_empty_exponents(df), self.path / f"part-{self._parts:06d}.parquet")
        self._parts += 1
        self.rows_written += len(df)

    def close(self) -> Path:
        return self.path


class PickleWriter(LogWriter):
    """Collects rows in memory and writes one pickle file at :meth:`close`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise IsADirectoryError(f"pickle log path {str(self.path)!r} is a directory; give a file name")
        self._frames: list[pd.DataFrame] = []
        self.rows_written = 0

    def write(self, df: pd.DataFrame, *, allow_empty: bool = False) -> None:
        if df.empty and not allow_empty:
            return
        self._frames.append(drop_empty_exponents(df))
        self.rows_written += len(df)

    def close(self) -> Path:
        if self._frames:
            write_pickle(concat_logs(self._frames), self.path)
            self._frames = []
        return self.path


def open_writer(path: str | os.PathLike, out_format: Literal["parquet", "pickle"]) -> LogWriter:
    """A writer for ``out_format`` at ``path`` (a directory for parquet, a file for pickle)."""
    if out_format == "parquet":
        return PartWriter(path)
    if out_format == "pickle":
        return PickleWriter(path)
    raise ValueError(f"out_format={out_format!r}: expected one of {FORMATS}")
