"""Framework-neutral tracker core: the shared options, the tracker core both frameworks' trackers
build on, selection, schedules, step bookkeeping, rows, log IO."""

from ...schema.io import read_log, read_parquet, read_pickle
from .adapter import Adapter
from .core import TrackerCore
from .options import ROOT_NAME, TrackKwargs, TrackOptions
from .recorder import StepRecorder
from .rows import TensorKey, build_rows
from .schedule import Schedule, linear, make_schedule
from .selection import Pattern, Selector
from .stream import DEFAULT_LOG_DIR, make_run_record, resolve_out

__all__ = [
    "TrackOptions",
    "TrackKwargs",
    "TrackerCore",
    "Adapter",
    "ROOT_NAME",
    "read_log",
    "read_parquet",
    "read_pickle",
    "DEFAULT_LOG_DIR",
    "StepRecorder",
    "TensorKey",
    "build_rows",
    "make_run_record",
    "resolve_out",
    "Schedule",
    "linear",
    "make_schedule",
    "Pattern",
    "Selector",
]
