"""Naming the tensors inside a module's output, as a tandv log names them.

A module's output may be a tensor or a structure of them (tuple, list, dict, dataclass,
nested to a depth of 8); each floating tensor in it is named ``<path>[i]`` / ``<path>[key]``
after the module's path (``<path>[0][logits]`` when nested). A public module of the PyTorch
adapter: the tracker's hooks and :mod:`tandv.snapshot.torch` both name outputs with it, so
that snapshots and logs use the same names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["flatten_outputs"]

#: How deep :func:`flatten_outputs` looks into nested structures.
MAX_DEPTH = 8


def flatten_outputs(
    value: Any, name: str, out: list[tuple[str, torch.Tensor]], depth: int = 0
) -> None:
    """Append to ``out`` the floating tensors inside ``value`` (a possibly nested module
    output) with their names, ``name`` being the name of ``value`` itself."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            out.append((name, value))
        return
    if depth > MAX_DEPTH:
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            flatten_outputs(v, f"{name}[{k}]", out, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            flatten_outputs(getattr(value, f.name), f"{name}[{f.name}]", out, depth + 1)
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            flatten_outputs(v, f"{name}[{i}]", out, depth + 1)
