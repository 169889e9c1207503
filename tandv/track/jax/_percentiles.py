"""``track(..., percentiles=(1, 50, 99))`` for JAX: exact percentiles of each tracked array,
traced into the program that summarizes it (``jnp.nanpercentile``: a sort of the array,
NaN left out, linear interpolation as ``np.percentile``). Computed in float32 for
arrays of at most float32 precision (float64 with ``jax_enable_x64``); far slower than
the summary itself: select the arrays that need it with ``include``/``exclude``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

__all__ = ["percentile_stat"]


def percentile_stat(columns: tuple[tuple[str, float], ...]) -> Callable[[Any], dict[str, Any]]:
    """A custom statistic (``x -> {column: scalar}``) giving the percentiles ``columns``
    (``((name, q), ...)``, q in [0, 100]) of the non-NaN elements of ``x``."""
    names = [n for n, _ in columns]
    qs = jnp.asarray([q for _, q in columns], dtype=jnp.float32)

    def percentiles(x: Any) -> dict[str, Any]:
        v = jnp.ravel(x)
        if not jnp.issubdtype(v.dtype, jnp.floating) or jnp.dtype(v.dtype).itemsize < 4:
            v = v.astype(jnp.float32)
        if v.size == 0:
            return {n: jnp.float32(jnp.nan) for n in names}
        out = jnp.nanpercentile(v, qs.astype(v.dtype))
        return {n: out[i] for i, n in enumerate(names)}

    return percentiles
