"""Column names and fixed values of the tandv log (see the README's "Log schema")."""

from __future__ import annotations

from typing import Final

METADATA: Final = "metadata"
SCALAR_STATS: Final = "scalar_stats"
EXPONENT_COUNTS: Final = "exponent_counts"
#: The three top-level column groups, in order.
GROUPS: Final = (METADATA, SCALAR_STATS, EXPONENT_COUNTS)

NAME: Final = "name"
TYPE: Final = "type"
TENSOR_TYPE: Final = "tensor_type"
STEP: Final = "step"
DTYPE: Final = "dtype"
#: The metadata columns, in order.
META_COLUMNS: Final = (NAME, TYPE, TENSOR_TYPE, STEP, DTYPE)
#: Metadata columns holding strings.
STRING_META: Final = (NAME, TYPE, TENSOR_TYPE, DTYPE)

ACTIVATION: Final = "Activation"
GRADIENT: Final = "Gradient"
WEIGHT: Final = "Weight"
OPTIMISER_STATE: Final = "Optimiser_State"
#: The allowed values of ``("metadata", "tensor_type")``.
TENSOR_TYPES: Final = (ACTIVATION, GRADIENT, WEIGHT, OPTIMISER_STATE)

#: Exponent-count label of values that underflow the number format.
UNDERFLOW: Final = "-inf"
#: Exponent-count label of values that overflow the number format.
OVERFLOW: Final = "+inf"


def meta(column: str) -> tuple[str, str]:
    """The full column key of a metadata column, e.g. ``meta("step")``."""
    return (METADATA, column)


def stat(column: str) -> tuple[str, str]:
    """The full column key of a scalar statistic, e.g. ``stat("rm2")``."""
    return (SCALAR_STATS, column)
