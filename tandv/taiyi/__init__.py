"""Taiyi's quantities (DLCV-BUAA/Taiyi) as built-in statistics: covariance spectra of module
inputs, norms, dead neurons, RankMe and BatchNorm's train/inference discrepancy, chosen per
module type with per-quantity schedules from Taiyi's own config form.

``tandv.taiyi.QUANTITIES`` defines each quantity; ``tandv.taiyi.torch.Monitor`` computes
them for a PyTorch model (imported lazily here as ``tandv.taiyi.Monitor``, so reading a table
needs no torch), ``tandv.taiyi.jax.Monitor`` the forward ones for a Flax linen model;
:func:`read_taiyi` reads the table a Monitor wrote beside a tandv log.
"""

from __future__ import annotations

from typing import Any

from ._core import (
    COLUMNS,
    QUANTITIES,
    QuantitySpec,
    TableWriter,
    UserQuantity,
    describe_quantities,
    parse_quantity_list,
    parse_schedule,
    read_taiyi,
    taiyi_dir,
    to_nested,
)

__all__ = [
    "COLUMNS",
    "QUANTITIES",
    "QuantitySpec",
    "TableWriter",
    "UserQuantity",
    "Monitor",
    "describe_quantities",
    "parse_quantity_list",
    "parse_schedule",
    "read_taiyi",
    "taiyi_dir",
    "to_nested",
]


def __getattr__(name: str) -> Any:
    if name == "Monitor":
        from .torch import Monitor

        return Monitor
    raise AttributeError(f"module 'tandv.taiyi' has no attribute {name!r}")
