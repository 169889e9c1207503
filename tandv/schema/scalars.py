"""Training scalars (loss, learning rate, ...) stored beside a log, and read back.

A tracker's ``log_scalars(loss=..., lr=...)`` writes one row per step into a table of
its own, next to the tensor log (a table with one row per step does not fit the log's
one row per tensor and step):

* a parquet log directory ``run/`` keeps them in its sub-directory ``run/scalars/``
  (part files; the log reader reads only the ``*.parquet`` files directly in ``run/``);
* a single-file log ``run.pkl`` (or ``run.parquet``) keeps them in the directory
  ``run.scalars/`` beside it.

Each part holds a ``step`` column (int64) and one float64 column per scalar name; parts
may hold different names (a validation loss logged every 100 steps). :func:`read_scalars`
combines them into one frame sorted by step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .io import SOURCE_ATTR, atomic_write

__all__ = ["SCALARS_DIR", "SOURCE_ATTR", "scalars_path", "write_scalars_part", "read_scalars"]

#: The scalars' sub-directory of a parquet log directory.
SCALARS_DIR = "scalars"
_MARK = b"tandv.scalars"


def scalars_path(log: str | os.PathLike[str]) -> Path:
    """The directory holding the scalars of the log at ``log`` (see the module docstring).

    A path that does not exist yet is taken as a parquet log directory unless its name
    ends in ``.pkl``, ``.pickle`` or ``.parquet``."""
    p = Path(log)
    single = p.is_file() or (not p.exists() and p.suffix.lower() in (".pkl", ".pickle", ".parquet"))
    return p.with_name(p.stem + ".scalars") if single else p / SCALARS_DIR


def write_scalars_part(
    directory: Path, index: int, steps: list[int], rows: list[dict[str, float]]
) -> Path:
    """Write the scalars of ``steps`` (``rows[i]``: name -> value at ``steps[i]``) as part
    ``index`` of ``directory`` (created if needed), atomically."""
    names: dict[str, None] = {}
    for r in rows:
        names.update(dict.fromkeys(r))
    arrays = [pa.array(np.asarray(steps, dtype=np.int64))]
    arrays += [
        pa.array(np.array([r.get(n, np.nan) for r in rows], dtype=np.float64)) for n in names
    ]
    table = pa.Table.from_arrays(arrays, names=["step", *names]).replace_schema_metadata(
        {_MARK: b"1"}
    )
    return atomic_write(
        directory / f"part-{index:06d}.parquet", lambda tmp: pq.write_table(table, tmp)
    )


def read_scalars(source: Any) -> pd.DataFrame:
    """The training scalars logged with ``tracker.log_scalars``, one row per step.

    Arguments:
        source: the log's path (a parquet directory or a ``.pkl``/``.parquet`` file), or a
            log frame read by ``tandv.read_log``/``read_parquet``/``read_pickle`` (which
            remember where they read it from).

    Returns:
        A frame with a ``step`` column and one float column per scalar name, sorted by
        step; NaN where a name was not logged at a step. A name logged twice for one step
        keeps its last value. A log without scalars gives a frame with a ``step`` column
        only (no rows), which ``viz.interactive`` and the report skip.

    Raises:
        ValueError: ``source`` is a frame that was not read from a file (say its path).
        FileNotFoundError: nothing is at the path.
    """
    if isinstance(source, pd.DataFrame):
        where = source.attrs.get(SOURCE_ATTR)
        if not where:
            raise ValueError(
                "read_scalars(source=<DataFrame>): this frame does not say which file it was read "
                "from (it was built or changed in memory); pass the log's path instead"
            )
        source = where
    log = Path(source)
    if not log.exists():
        raise FileNotFoundError(f"read_scalars: no log at {str(log)!r}")
    directory = scalars_path(log)
    parts = (
        sorted(p for p in directory.glob("*.parquet") if not p.name.startswith("."))
        if directory.is_dir()
        else []
    )
    if not parts:
        return pd.DataFrame({"step": pd.Series([], dtype=np.int64)})
    frames = []
    for part in parts:
        table = pq.read_table(part)
        if (
            table.schema.metadata is None
            or _MARK not in table.schema.metadata
            or "step" not in table.column_names
        ):
            raise ValueError(
                f"read_scalars: {str(part)!r} is not a tandv scalars table (no 'step' column "
                f"or marker); move it out of {str(directory)!r}"
            )
        frames.append(table.to_pandas())
    df = pd.concat(frames, ignore_index=True, sort=False)
    # several rows of one step (logged after a flush): the last value of each name wins
    df = df.groupby("step", sort=True).last().reset_index()
    df["step"] = df["step"].astype(np.int64)
    return df
