"""Framework-free statistics: number formats, mergeable summaries, their reference."""

from .formats import KNOWN_FORMATS, NumberFormat, format_name, number_format
from .summary import (
    CORE_FIELDS,
    COUNT_STATS,
    DEFAULT_STATS,
    MERGE_RULES,
    POWERS,
    Layout,
    exponent_bins,
    exponent_labels,
    finalize,
    finalize_many,
    merge,
    merge_all,
    summarize,
)

__all__ = [
    "KNOWN_FORMATS",
    "NumberFormat",
    "format_name",
    "number_format",
    "CORE_FIELDS",
    "COUNT_STATS",
    "DEFAULT_STATS",
    "MERGE_RULES",
    "POWERS",
    "Layout",
    "exponent_bins",
    "exponent_labels",
    "finalize",
    "finalize_many",
    "merge",
    "merge_all",
    "summarize",
]
