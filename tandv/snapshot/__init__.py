"""Snapshots of a model's tensors with arithmetic, norms and statistics (nnstat's workflow).

``tandv.snapshot.torch`` and ``tandv.snapshot.jax`` build them (``from_weight``,
``from_grad``, ``from_optimizer_state``, ``from_activation``); this package itself needs
neither framework.
"""

from ._core import DESCRIBE_COLUMNS, EXTRA_COLUMNS, Snapshot, sqrt
from ._ops import Ops

__all__ = ["DESCRIBE_COLUMNS", "EXTRA_COLUMNS", "Ops", "Snapshot", "sqrt"]
