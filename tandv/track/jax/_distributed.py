"""The JAX tracker in a multi-process run (``jax.distributed``): statistics of the global
arrays, one exchange per tracked step, and one log, written by process 0.

In a multi-process run a global ``jax.Array`` is not fully addressable: each process holds
some of its shards (and a replicated array has copies on several processes). Summaries
merge exactly (:func:`tandv.stats.summary.merge`), so the row of a global array is made
from summaries of its shards, never from the array:

- **Arrays given to** ``track``/``step`` (weights, gradients, optimizer state): each
  process summarizes its addressable shards whose ``replica_id`` is 0 (every part of the
  array is held by exactly one such shard in the whole run, so a replicated copy counts
  once) and merges them into one *partial* summary (:class:`LocalParts`); an array one
  process holds entirely (fully addressable) is that process's own part, as a
  data-parallel activation is. Role :data:`LOCAL`: the writer merges every process's.
- **Taps inside the jitted update** (activations and their cotangents of a ``jit`` over
  global arrays): XLA partitions the summary's reductions over the devices (GSPMD), so a
  tap's summary is already that of the global array, replicated on every device; the
  mailbox arena is a global replicated ``jax.Ref``, and each process reads its own copy.
  Role :data:`REPLICATED`: the writer keeps its own, the others send nothing for it. (The
  CPU host kernel, a custom call, is not used for taps here: XLA cannot partition it.)

At each tracked step the processes merge their rows with the shared cross-rank merge
(:class:`tandv.track.common.distributed.RankMerger`, as the PyTorch tracker's ranks do):
process 0 gathers the others' summaries, merges them and alone writes; the others write
and print nothing. The collectives go through the ``jax.distributed`` coordination
service's key-value store (:class:`KeyValueCollectives`), whose blocking read takes a
timeout (the tracker's ``dist_timeout``): a process that died or stopped stepping makes the
others raise after it instead of waiting forever (a collective over the devices has no
timeout); the steps recorded before stay in the log, which ``close`` finishes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from ...stats.summary import Layout
from ..common.distributed import LOCAL, REPLICATED
from ._scope import distributed_client

__all__ = [
    "LocalParts",
    "KeyValueCollectives",
    "multi_process",
    "split_global",
    "join_global",
    "by_devices",
    "flatten",
    "role",
    "local_view",
]

_trackers = itertools.count()


def multi_process() -> bool:
    """Whether this is one process of a multi-process JAX run (``jax.distributed``)."""
    return jax.process_count() > 1


def _is_global(x: Any) -> bool:
    return isinstance(x, jax.Array) and not x.is_fully_addressable


class LocalParts(NamedTuple):
    """This process's part of a global array: the summaries of its addressable shards with
    ``replica_id`` 0 (one handle each, as the tracker's summary computation gave them),
    merged on the host by ``layout`` (the empty summary when it holds none of them)."""

    parts: tuple[Any, ...]
    layout: Layout


def split_global(arrays: Sequence[Any]) -> tuple[list[Any], list[tuple[int, int] | None]]:
    """``(flat, spans)``: the arrays to summarize (a global array replaced by its counted
    addressable shards, single-device arrays) and, for each input, the ``(start, stop)`` of
    its shards in ``flat`` (None for an array kept as it is)."""
    flat: list[Any] = []
    spans: list[tuple[int, int] | None] = []
    for x in arrays:
        if _is_global(x):
            shards = [s.data for s in x.addressable_shards if s.replica_id == 0]
            spans.append((len(flat), len(flat) + len(shards)))
            flat += shards
        else:
            spans.append(None)
            flat.append(x)
    return flat, spans


def join_global(
    handles: Sequence[Any], spans: Sequence[tuple[int, int] | None], layouts: Sequence[Layout]
) -> list[Any]:
    """The inverse of :func:`split_global` on the summaries: one handle per input array, a
    :class:`LocalParts` for a global one."""
    out: list[Any] = []
    at = 0
    for span, layout in zip(spans, layouts):
        if span is None:
            out.append(handles[at])
            at += 1
        else:
            out.append(LocalParts(tuple(handles[span[0] : span[1]]), layout))
            at = span[1]
    return out


def by_devices(arrays: Sequence[Any]) -> list[list[int]]:
    """Indices of ``arrays`` grouped by the devices that hold them (one jitted call cannot
    take arrays committed to different devices), in first-seen order."""
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(arrays):
        where = frozenset(x.devices()) if isinstance(x, jax.Array) else None
        groups.setdefault(where, []).append(i)
    return list(groups.values())


def flatten(summaries: Sequence[Any]) -> list[Any]:
    """``summaries`` with each :class:`LocalParts` replaced by its parts' handles."""
    out: list[Any] = []
    for s in summaries:
        out += flatten(s.parts) if isinstance(s, LocalParts) else [s]
    return out


def role(summary: Any, mail_type: type) -> str:
    """:data:`REPLICATED` for a tap's summary read from a global (replicated) mailbox arena
    (``mail_type``: the tracker's handle of a mailbox report), else :data:`LOCAL`."""
    summary = getattr(summary, "inner", summary)  # (the segments of one: ``_transfer.Segments``)
    mail: Any = summary if isinstance(summary, mail_type) else None
    return REPLICATED if mail is not None and mail.read.replicated else LOCAL


def local_view(x: Any) -> Any:
    """A replicated global array as this process's own copy (a single-device array, which
    can be copied to the host); other arrays as they are."""
    return x.addressable_data(0) if _is_global(x) else x


class KeyValueCollectives:
    """The cross-rank merge's collectives
    (:class:`~tandv.track.common.distributed.Collectives`) over the ``jax.distributed``
    coordination service's key-value store: each process writes its value under a key of
    its own, and the readers wait for the others' keys with a timeout (a collective over
    the devices has none: a dead peer would hang it). Keys carry a per-tracker prefix and a
    call counter (every process makes the same calls in the same order). A reader deletes
    what only it reads; a key every process reads is deleted by its writer after a later
    all-gather has completed (every process has then written that call's key, so it has
    read all the earlier ones)."""

    def __init__(self, timeout: float) -> None:
        client = distributed_client()
        if client is None:
            raise RuntimeError(
                "tandv: this JAX run has several processes but no jax.distributed client; "
                "call jax.distributed.initialize(...) before track()"
            )
        self._client = client
        self.rank, self.world_size = jax.process_index(), jax.process_count()
        self.timeout = timeout
        self._prefix = f"tandv/jax/{next(_trackers)}"
        self._calls = itertools.count()
        self._stale: list[str] = []  # this process's keys every process reads

    def _key(self, call: int, rank: int) -> str:
        return f"{self._prefix}/{call}/{rank}"

    def _put(self, call: int, payload: bytes) -> None:
        self._client.key_value_set_bytes(self._key(call, self.rank), payload)

    def _get(self, call: int, rank: int) -> bytes:
        # the client raises its runtime's error on a timeout; the merge names the failure
        got: bytes = self._client.blocking_key_value_get_bytes(
            self._key(call, rank), int(self.timeout * 1000)
        )
        return got

    def all_gather_ints(self, values: np.ndarray) -> np.ndarray:
        call = next(self._calls)
        mine = np.ascontiguousarray(values, dtype="<i8")
        self._put(call, mine.tobytes())
        got = np.stack(
            [
                mine if r == self.rank else np.frombuffer(self._get(call, r), "<i8")
                for r in range(self.world_size)
            ]
        )
        for key in self._stale:  # every process is past the calls before this one
            self._client.key_value_delete(key)
        self._stale = [self._key(call, self.rank)]
        return got

    def gather(self, vector: np.ndarray, dst: int) -> list[np.ndarray] | None:
        call = next(self._calls)
        mine = np.ascontiguousarray(vector, dtype="<f8")
        if self.rank != dst:
            self._put(call, mine.tobytes())
            return None
        out = []
        for r in range(self.world_size):
            if r == self.rank:
                out.append(mine)
                continue
            out.append(np.frombuffer(self._get(call, r), "<f8"))
            self._client.key_value_delete(self._key(call, r))
        return out

    def broadcast_text(self, text: str | None, src: int) -> str:
        call = next(self._calls)
        if self.rank == src:
            assert text is not None
            self._put(call, text.encode())
            self._stale.append(self._key(call, self.rank))
            return text
        return self._get(call, src).decode()

    def close(self) -> None:
        """Nothing to release: the collectives are keys in the key-value store of
        ``jax.distributed``, whose client the program owns (the keys of the last call stay,
        as another process may still be reading them)."""
