"""The tandv log: column names, validation, and pickle/parquet IO (pandas, pyarrow, ml_dtypes only)."""

from .columns import (
    ACTIVATION,
    DTYPE,
    EXPONENT_COUNTS,
    GRADIENT,
    GROUPS,
    META_COLUMNS,
    METADATA,
    NAME,
    OPTIMISER_STATE,
    OVERFLOW,
    SCALAR_STATS,
    STEP,
    TENSOR_TYPE,
    TENSOR_TYPES,
    TYPE,
    UNDERFLOW,
    WEIGHT,
    meta,
    stat,
)
from .io import (
    RUN_ATTR,
    canonical_columns,
    concat_logs,
    drop_empty_exponents,
    log_columns,
    read_log,
    read_parquet,
    read_parquet_chunks,
    read_pickle,
    run_record,
    write_parquet,
    write_pickle,
)
from .scalars import SOURCE_ATTR, read_scalars, scalars_path
from .validate import SchemaError, is_exponent_label, validate
from .writer import FORMATS, LogWriter, PartWriter, PickleWriter, open_writer

__all__ = [
    "ACTIVATION", "DTYPE", "EXPONENT_COUNTS", "GRADIENT", "GROUPS", "META_COLUMNS", "METADATA",
    "NAME", "OPTIMISER_STATE", "OVERFLOW", "SCALAR_STATS", "STEP", "TENSOR_TYPE", "TENSOR_TYPES",
    "TYPE", "UNDERFLOW", "WEIGHT", "meta", "stat",
    "canonical_columns", "concat_logs", "drop_empty_exponents", "log_columns", "read_log", "read_parquet",
    "read_parquet_chunks",
    "read_pickle", "write_parquet", "write_pickle", "RUN_ATTR", "run_record",
    "SchemaError", "is_exponent_label", "validate", "SOURCE_ATTR", "read_scalars", "scalars_path",
    "FORMATS", "LogWriter", "PartWriter", "PickleWriter", "open_writer",
]
