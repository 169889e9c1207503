"""``tracker.log_scalars`` for JAX arrays: an array is kept (arrays are immutable), its copy
to the host started at once, and read once it has arrived."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["capture_jax"]


class _InFlight:
    """A JAX scalar whose copy to the host has been started."""

    __slots__ = ("x",)

    def __init__(self, x: jax.Array) -> None:
        self.x = x
        try:
            x.copy_to_host_async()
        except Exception:  # e.g. an array not on one device: read later, when it is ready
            pass

    def ready(self) -> bool:
        return bool(self.x.is_ready())  # type: ignore[attr-defined]  # missing from jax's stub

    def get(self) -> float:
        return float(np.asarray(self.x).reshape(()))


def capture_jax(name: str, value: Any) -> float | _InFlight | None:
    """A copy under way for a one-element JAX array; ``None`` for other values.

    Raises:
        TypeError: for a traced value (``log_scalars`` called inside ``jax.jit`` or the
            intercepted update): return the value from the update and log it outside.
    """
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"log_scalars({name}=...): got a traced value (inside jax.jit or the intercepted "
            f"update function); return it from the update and call log_scalars after it"
        )
    if not isinstance(value, jax.Array):
        return None
    if value.size != 1:
        raise ValueError(
            f"log_scalars({name}=...): expected one number; got an array of shape {value.shape}"
        )
    if jax.numpy.issubdtype(value.dtype, jax.numpy.complexfloating):
        raise ValueError(
            f"log_scalars({name}=...): expected a real number; got a {value.dtype} array"
        )
    if not value.is_fully_addressable:  # a global array of a multi-process run
        if not value.is_fully_replicated or not value.addressable_shards:
            raise ValueError(
                f"log_scalars({name}=...): a global array that this process does not hold "
                f"a whole copy of; replicate it over the devices (e.g. the loss from a jitted "
                f"step, which JAX replicates) or pass a number"
            )
        value = value.addressable_data(0)  # this process's copy: it can reach the host
    return _InFlight(value)
