"""What a :class:`~tandv.snapshot.Snapshot` needs from each array framework, and which
framework a value belongs to.

The framework's own operations (:data:`NUMPY_OPS`, :func:`torch_ops`, :func:`jax_ops`) live
here, below both the framework-neutral snapshot (:mod:`tandv.snapshot._core`) and the
adapters that build snapshots (:mod:`tandv.snapshot.torch`, :mod:`tandv.snapshot.jax`), so
that neither imports the other. torch and JAX are imported the first time one of their
arrays is seen.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..stats.summary import framework_of

__all__ = ["Ops", "NUMPY_OPS", "np_norm", "torch_ops", "jax_ops", "ops_for"]


@dataclass(frozen=True)
class Ops:
    """What a snapshot needs from one array framework.

    Arguments:
        sqrt: elementwise square root, result in the same framework and device.
        norm: ``norm(x, p)``, the vector p-norm of all elements of ``x`` as a Python float
            (``p = inf`` the largest magnitude).
        to_numpy: a host copy of ``x`` as a numpy array (float32 for dtypes numpy lacks)
            and the name of ``x``'s dtype (``"bfloat16"``).
        clone: an independent copy of ``x`` that later in-place changes do not reach.
    """

    sqrt: Callable[[Any], Any]
    norm: Callable[[Any, float], float]
    to_numpy: Callable[[Any], tuple[np.ndarray, str]]
    clone: Callable[[Any], Any]


def np_norm(x: Any, p: float) -> float:
    """The p-norm of ``x`` read as float64 on the host (``p = inf``: the largest magnitude)."""
    a = np.abs(np.asarray(x, dtype=np.float64)).ravel()
    if a.size == 0:
        return 0.0
    if math.isinf(p):
        return float(a.max())
    return float(np.sum(a**p) ** (1.0 / p))


def _np_to_numpy(x: Any) -> tuple[np.ndarray, str]:
    arr = np.asarray(x)
    return arr, arr.dtype.name


NUMPY_OPS = Ops(
    sqrt=np.sqrt,
    norm=np_norm,
    to_numpy=_np_to_numpy,
    clone=lambda x: np.array(x, copy=True) if isinstance(x, np.ndarray) else x,
)


@functools.cache
def torch_ops() -> Ops:
    """The operations a snapshot of torch tensors uses."""
    import torch

    half = (torch.float16, torch.bfloat16)

    def norm(x: torch.Tensor, p: float) -> float:
        x = x.detach()
        if x.numel() == 0:
            return 0.0
        if not (x.is_floating_point() or x.is_complex()):
            x = x.double()  # integer/bool buffers (num_batches_tracked): norms need floats
        # Half-precision inputs accumulate in float32 (their own sums lose digits fast).
        dtype = torch.float32 if x.dtype in half else None
        return float(torch.linalg.vector_norm(x, ord=p, dtype=dtype))

    def to_numpy(x: torch.Tensor) -> tuple[np.ndarray, str]:
        x = x.detach().cpu()
        name = str(x.dtype).removeprefix("torch.")
        if x.dtype in half:
            x = x.float()  # exact: every half value is a float32 value
        return x.numpy(), name

    return Ops(sqrt=torch.sqrt, norm=norm, to_numpy=to_numpy, clone=lambda x: x.detach().clone())


@functools.cache
def jax_ops() -> Ops:
    """The operations a snapshot of JAX arrays uses (arrays are immutable, so a clone is the
    array itself)."""
    import jax.numpy as jnp

    def norm(x: Any, p: float) -> float:
        if x.size == 0:
            return 0.0
        if not jnp.issubdtype(x.dtype, jnp.inexact):  # integer/bool leaves: float64 on the host
            return np_norm(np.asarray(x), p)
        # bfloat16/float16 accumulate in float32.
        x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        return float(jnp.linalg.norm(x.ravel(), ord=p))

    def to_numpy(x: Any) -> tuple[np.ndarray, str]:
        return np.asarray(x), jnp.dtype(x.dtype).name

    return Ops(sqrt=jnp.sqrt, norm=norm, to_numpy=to_numpy, clone=lambda x: x)


def ops_for(x: Any) -> Ops:
    """The :class:`Ops` of the framework ``x`` belongs to (numpy for numbers and numpy arrays)."""
    framework = framework_of(x)
    if framework == "torch":
        return torch_ops()
    if framework == "jax":
        return jax_ops()
    return NUMPY_OPS
