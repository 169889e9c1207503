"""tandv: track and visualize the numerics of neural-network training.

The public face: read and validate logs here; trackers live in ``tandv.track.torch``
and ``tandv.track.jax``, figures in ``tandv.viz``.
"""

from importlib import metadata as _metadata

from .analysis import first_nonfinite
from .compare import compare, first_divergence
from .schema import (
    SchemaError,
    read_log,
    read_parquet,
    read_pickle,
    read_scalars,
    validate,
    write_parquet,
    write_pickle,
)
from .track.common.alerts import AlertError, NonFiniteError

try:  # written once, in pyproject.toml; read from the installed package's metadata
    __version__ = _metadata.version("tandv")
except _metadata.PackageNotFoundError:  # a source tree used without installing it
    __version__ = "0+unknown"

__all__ = [
    "AlertError",
    "NonFiniteError",
    "SchemaError",
    "compare",
    "first_divergence",
    "first_nonfinite",
    "read_scalars",
    "read_log",
    "read_parquet",
    "read_pickle",
    "validate",
    "write_parquet",
    "write_pickle",
    "__version__",
]
