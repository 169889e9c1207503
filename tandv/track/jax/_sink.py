"""How taps reach their tracker: the :class:`TapSink` protocol and the registry of sinks.

A tap's rules run inside the user's program, traced and compiled once and run at every
tracked step, its host callbacks possibly after its tracker has closed; so a tap knows its
tracker only by a token (an int), and :func:`sink_of` turns the token into the tracker's
sink (None once the tracker is gone: the registry holds sinks weakly). Everything a tap
says to the tracker goes through the sink's four members; the tracker implements them
(``_tracker._TapSink``), and nothing in the tap modules touches the tracker itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Protocol

from ..common.options import ROOT_NAME
from ._summary import DeviceSummary

__all__ = ["ROOT_NAME", "Mailbox", "Report", "TapSink", "register", "sink_of"]

#: One report of a tap: ``(tensor_type, dtype, summary)``, ``tensor_type`` ``"Activation"``
#: or ``"Gradient"``, the summary traced (inside a program) or concrete (eager code).
Report = tuple[str, Any, DeviceSummary]


class Mailbox(Protocol):
    """Where a traced tap's reports are written: the one signature of ``post``, which the
    tracker's sink (:class:`TapSink`), the tracker's arena (``_mailbox.Mailboxes``) and a
    tracked program's arena (``_mailbox.ProgramMailboxes``) share."""

    def post(
        self,
        name: str,
        module_type: str,
        reports: Sequence[Report],
        arena: Any = None,
        remat: bool = False,
        merge: bool = False,
    ) -> bool:
        """Write traced ``reports`` of module output ``name`` into a new mailbox; False when
        the arena has no room left (the tap then calls back instead).

        ``arena``: the arena as the traced function received it (passed through a
        ``custom_vjp``), None to close over the current one. ``remat``: the write lies inside
        ``jax.checkpoint`` (written twice per step, as expected). ``merge``: the write lies in
        a loop body and merges into the mailbox (``_summary.merge_jax``, with the merge rules
        of the tracker's custom statistics, which the arena was made with) instead of
        replacing it."""
        ...


class TapSink(Mailbox, Protocol):
    """The tracker as its taps see it.

    Three ways a report reaches the tracker, chosen by the tap (see ``_delivery``):

    - traced, with room in the arena: :meth:`post` writes it into a mailbox of :attr:`arena`
      (program data, read by the tracker after the step);
    - traced, without a mailbox (``shard_map``, a vmapped loop body, a full arena): a host
      callback, announced by :meth:`note_callback` when it is traced and delivered to
      :meth:`receive` when the program runs;
    - concrete (an update that is not jitted): straight to :meth:`receive`.
    """

    @property
    def arena(self) -> Any:
        """The mailbox arena of the current intercepted call (a ``jax.Ref``), None when there
        is none (a tap then reports by callback)."""
        ...

    def receive(
        self, name: str, module_type: str, tensor_type: str, dtype: str, summary: Any
    ) -> None:
        """Take one concrete summary of module output ``name`` (a direct report or a host
        callback's); ``dtype`` is the dtype's name."""
        ...

    def note_callback(self) -> None:
        """A tap of the current step reports by host callback: the tracker must wait for
        JAX's callbacks (``jax.effects_barrier``) before it records the step."""
        ...


_SINKS: weakref.WeakValueDictionary[int, TapSink] = weakref.WeakValueDictionary()


def register(token: int, sink: TapSink) -> None:
    """Route the taps carrying ``token`` to ``sink`` (held weakly: the tracker owns it)."""
    _SINKS[token] = sink


def sink_of(token: int) -> TapSink | None:
    """The sink registered for ``token``; None once its tracker is gone."""
    return _SINKS.get(token)
