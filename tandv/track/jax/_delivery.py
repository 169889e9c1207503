"""How a tap's summaries reach its tracker: the :class:`Probe` a tap carries.

A probe summarizes a value and delivers the reports to its tracker's sink
(:class:`._sink.TapSink`) by the best way open where the tap lies:

- concrete summaries (an update that is not jitted) go straight to ``sink.receive``;
- traced ones are written into a mailbox of the arena (``sink.post``, see ``_mailbox``);
- where refs cannot serve, by ``jax.debug.callback``, landing in ``_intercept._deliver``:
  inside ``shard_map``/``pmap`` (no refs there; each device reports its shard), in a loop
  body under ``jax.vmap`` (a merged mailbox cannot take batched writes), and when the arena
  is full. (Callbacks replaced by refs cost much: on XLA:CPU each callback that waits for a
  value computed mid-update stalls the update.)

Under ``jax.vmap`` elsewhere the summary is taken of the whole batched array, below every
vmap, so it is one unbatched summary a mailbox can hold.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from . import _intercept
from ._scope import manual_keep, unbatched
from ._sink import Report, sink_of
from ._summary import DeviceSummary

__all__ = ["Probe", "is_traced"]


@dataclass(frozen=True, eq=False)
class Probe:
    """What a tap reports: to which tracker, under which name, and what to summarize.

    Hashed by identity (it is a static argument of the ``custom_vjp``). ``token``: names the
    tracker's sink (:func:`._sink.sink_of`). ``manual``: the tap lies inside
    ``shard_map``/``pmap`` (see :func:`._scope.manual_keep`)."""

    token: int
    name: str
    module_type: str
    forward: bool
    backward: bool
    summarize: Callable[[jax.Array], DeviceSummary]
    manual: bool = False

    def summary(self, x: Any, whole_batch: bool = True) -> tuple[Any, DeviceSummary, Any]:
        """``(dtype, summary, keep)`` of ``x``: under ``jax.vmap`` the summary of the whole
        batched array (the mapped axes are summarized too, as a per-example loss's
        activations form one tensor), computed below every vmap so that it is one unbatched
        summary; ``keep`` is :func:`._scope.manual_keep` inside ``shard_map`` (else None).
        ``whole_batch=False``: the summary of ``x`` as the current trace sees it (one per
        example under vmap), for host callbacks, which vmap calls once per example. An
        array past 2**31 - 1 elements has a summary of several rows (``_segments``)."""
        with unbatched(x) if whole_batch else contextlib.nullcontext(x) as whole:
            return whole.dtype, self.summarize(whole), manual_keep(whole) if self.manual else None

    def report(self, tensor_type: str, x: Any, arena: Any = None, remat: bool = False) -> None:
        """Summarize ``x`` and send it to the tracker (see :meth:`emit`)."""
        with unbatched(x) as whole:
            self.emit([(tensor_type, whole.dtype, self.summarize(whole))], arena, remat)

    def emit(
        self, reports: Sequence[Report], arena: Any = None, remat: bool = False, merge: bool = False
    ) -> None:
        """Send ``(tensor_type, dtype, summary)`` reports to the tracker: directly when they are
        concrete, else by mailbox (``arena``, ``remat``, ``merge``: see
        :meth:`._sink.TapSink.post`), else (no room left) by host callback."""
        sink = sink_of(self.token)
        if (
            is_traced(reports)
            and sink is not None
            and sink.post(self.name, self.module_type, reports, arena, remat, merge)
        ):
            return
        self.send(reports)

    def send(self, reports: Sequence[Report], keep: Any = None) -> None:
        """Send reports directly when they are concrete, else by one host callback (dropped
        there when the traced bool ``keep`` is False)."""
        dtypes = [(tensor_type, str(dtype)) for tensor_type, dtype, _ in reports]
        summaries = [summary for _, _, summary in reports]
        # _intercept._deliver is looked up when the callback is made, not imported: it is
        # where every callback lands (tests wrap it to count them).
        if not is_traced(reports):
            _intercept._deliver(self.token, self.name, self.module_type, dtypes, summaries)
            return
        sink = sink_of(self.token)
        if sink is not None:
            sink.note_callback()
        deliver = functools.partial(
            _intercept._deliver, self.token, self.name, self.module_type, dtypes
        )
        # A debug callback: its effect is one JAX allows inside jax.checkpoint (an
        # io_callback's is refused there), loops and custom derivatives.
        if keep is None:
            jax.debug.callback(deliver, summaries)
        else:
            jax.debug.callback(lambda s, k: deliver(s) if bool(k) else None, summaries, keep)


def is_traced(reports: Sequence[Report]) -> bool:
    """Whether ``reports`` hold traced summaries (made inside a program)."""
    return any(isinstance(s.counts, jax.core.Tracer) for _, _, s in reports)
