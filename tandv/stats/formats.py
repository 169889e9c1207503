"""Number formats: the exponent range of a floating-point format, from ml_dtypes.

A *number format* answers three questions the exponent histogram needs:
which exponents its finite non-zero values can have (from the smallest
subnormal to the largest finite value), below which magnitude a non-zero
value underflows to zero, and above which magnitude it overflows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["NumberFormat", "number_format", "format_name", "KNOWN_FORMATS"]

#: Float formats accepted by name (every float ``ml_dtypes.finfo`` understands).
KNOWN_FORMATS: tuple[str, ...] = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e4m3b11fnuz",
    "float8_e4m3",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e3m4",
    "float8_e8m0fnu",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "float4_e2m1fn",
)


@dataclass(frozen=True)
class NumberFormat:
    """The range of one floating-point format.

    Attributes:
        name: canonical name, e.g. ``"float8_e4m3fn"`` (parseable by ``ml_dtypes.finfo``).
        min_exponent: exponent n of the smallest subnormal, 2**n (smallest normal if none).
        max_exponent: exponent n of the largest finite value, 2**n <= max < 2**(n+1).
        max: largest finite value; magnitudes above it overflow.
        smallest_normal: smallest positive normal value.
        smallest_subnormal: smallest positive value; non-zero magnitudes below it underflow.
    """

    name: str
    min_exponent: int
    max_exponent: int
    max: float
    smallest_normal: float
    smallest_subnormal: float

    @property
    def num_bins(self) -> int:
        """Number of exponent columns, min_exponent..max_exponent inclusive."""
        return self.max_exponent - self.min_exponent + 1

    @property
    def exponents(self) -> range:
        """The exponents of this format's finite non-zero values, ascending."""
        return range(self.min_exponent, self.max_exponent + 1)

    @property
    def underflow_threshold(self) -> float:
        """Non-zero magnitudes strictly below this value underflow (count in ``-inf``)."""
        return self.smallest_subnormal

    @property
    def overflow_threshold(self) -> float:
        """Magnitudes strictly above this value overflow (count in ``+inf``)."""
        return self.max


def format_name(spec: Any) -> str:
    """The canonical ml_dtypes name of a dtype given as a string, numpy/torch/jax dtype or type.

    Called for every tracked tensor, so answers are cached per (hashable) spec.

    Raises:
        ValueError: if ``spec`` does not name a floating-point format; the message lists
            the accepted names.
    """
    try:
        return _format_name_cached(spec)
    except TypeError:  # unhashable spec
        return _format_name(spec)


@lru_cache(maxsize=1024)
def _format_name_cached(spec: Any) -> str:
    return _format_name(spec)


def _format_name(spec: Any) -> str:
    if isinstance(spec, NumberFormat):
        return spec.name
    if isinstance(spec, str):
        name = spec.strip()
    else:
        # torch dtypes print as "torch.float32"; numpy/jax dtypes and scalar types
        # convert through np.dtype (ml_dtypes registers its types with numpy).
        text = str(spec)
        if text.startswith("torch."):
            name = text[len("torch.") :]
        else:
            try:
                name = np.dtype(spec).name
            except TypeError:
                name = text
    name = {"float": "float32", "double": "float64", "half": "float16"}.get(name, name)
    if name not in KNOWN_FORMATS:
        raise ValueError(
            f"unknown number format {spec!r}: expected a floating-point format name, one of "
            f"{', '.join(KNOWN_FORMATS)} (or the numpy/torch/jax dtype of one)"
        )
    return name


def _floor_log2(x: float) -> int:
    """Exact floor(log2(x)) for a positive finite float (math.log2 rounds near powers of two)."""
    return math.frexp(x)[1] - 1


@cache
def _format_by_name(name: str) -> NumberFormat:
    info = ml_dtypes.finfo(name)  # type: ignore[no-untyped-call]  # ml_dtypes: no annotations
    smallest_subnormal = float(info.smallest_subnormal)
    fmax = float(info.max)
    return NumberFormat(
        name=name,
        min_exponent=_floor_log2(smallest_subnormal),
        max_exponent=_floor_log2(fmax),
        max=fmax,
        smallest_normal=float(info.smallest_normal),
        smallest_subnormal=smallest_subnormal,
    )


def number_format(spec: Any) -> NumberFormat:
    """The :class:`NumberFormat` of ``spec``: a name ``ml_dtypes.finfo`` accepts
    (``"bfloat16"``, ``"float8_e4m3fn"``, ...), a numpy/torch/jax dtype, or a NumberFormat.

    Example:
        >>> f = number_format("float8_e4m3fn")
        >>> (f.min_exponent, f.max_exponent, f.max)
        (-9, 8, 448.0)
    """
    if isinstance(spec, NumberFormat):
        return spec
    return _format_by_name(format_name(spec))
