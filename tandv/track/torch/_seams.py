"""The torch tracker as its extensions see it: the :class:`TrackerSeam` protocol.

Two extensions of the tracker run in hooks of their own: the compiled model's hooks
(:mod:`._compiled`: a custom operator inside dynamo's graphs calls back into the tracker)
and the update capture (:mod:`._updates`: optimizer hooks around the update). Neither
imports the tracker nor reads its private state: each is given an object with the members
below, which the tracker implements (``tracker._Seam``), and everything it asks of the
tracker goes through them. So the tracker's inside can change without them, and they
without it (tests/test_import_graph.py holds both to it).

The object holds the tracker by a weak reference (hooks and dynamo's graphs may outlive
it): once the tracker is gone, :attr:`~TrackerSeam.recording` is False and the other
members find nothing to record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import nn

__all__ = ["Item", "TrackerSeam"]

#: One tensor to summarize: ``(row name, tensor type, owning module, tensor)``, the tensor
#: type one of ``tandv.schema.columns``' (``"Activation"``, ``"Gradient"``, ``"Weight"``...).
Item = tuple[str, str, nn.Module, torch.Tensor]


class TrackerSeam(Protocol):
    """What the torch tracker's extensions ask of it."""

    @property
    def recording(self) -> bool:
        """Whether the current step is scheduled: observations made now are its rows
        (False once the tracker is gone)."""
        ...

    @property
    def module(self) -> nn.Module:
        """The tracked model (a compiled model's original module)."""
        ...

    @property
    def kinds(self) -> Mapping[str, bool]:
        """Which tensor types the tracker records, by tensor type."""
        ...

    @property
    def track_eval(self) -> bool:
        """Whether forwards of modules in eval mode are recorded too."""
        ...

    def hooked_modules(self) -> list[tuple[str, nn.Module]]:
        """The modules whose outputs (and output gradients) are tracked, each with the
        name of its rows, in the model's order: the selected modules that have a forward
        of their own."""
        ...

    def parameter(self, p: torch.Tensor) -> tuple[str, nn.Module] | None:
        """The path of parameter ``p`` in the tracked model and the module owning it, if
        ``p`` is one of its parameters and selected for tracking; else ``None``."""
        ...

    def observe(
        self, name: str, kind: str, owner: nn.Module, x: torch.Tensor, *, fresh: bool = False
    ) -> None:
        """Summarize ``x`` into the current step as the ``kind`` row ``name`` of module
        ``owner``, as the eager hooks would. ``fresh``: ``x`` may have been written in
        place without a version bump (a compiled kernel's buffer), so a summary the
        tracker made of the same tensor object is not reused; a later call with the same
        ``x`` and ``fresh=False`` (the same gradient under another name) reuses this one."""
        ...

    def record(self, items: Sequence[Item]) -> None:
        """Summarize several distinct tensors into the current step together (tensors
        sharing a layout are reduced in one call or launch)."""
        ...
