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

At each tracked step every process merges its rows per tensor, and the non-writers send
them, with the rows' identities, to process 0 through the coordination service's key-value
store (:class:`KeyValueGather`): one message per process per tracked step, none on
unscheduled steps, and only process 0 waits. It merges the parts of each tensor and
records the step; the other processes record nothing, write nothing and print nothing.
The store's blocking read takes a timeout (:data:`GATHER_TIMEOUT_S`): a process that died
or stopped stepping makes process 0 raise :class:`ProcessFailure` after it, instead of
waiting forever; the steps recorded before stay in the log, which ``close`` finishes.

Shaped like the torch adapter's ``tandv/track/common/distributed.py`` (roles ``LOCAL`` and
``REPLICATED``, a framework-supplied gather, the merge on the writer), so that both can
share one merge once it is in the common core.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from ...stats.summary import Layout, merge_all
from ..common import StepRecorder, TensorKey

__all__ = [
    "GATHER_TIMEOUT_S",
    "LOCAL",
    "REPLICATED",
    "LocalParts",
    "ProcessFailure",
    "KeyValueGather",
    "ProcessMerger",
    "SilentRecorder",
    "multi_process",
    "split_global",
    "join_global",
    "by_devices",
    "flatten",
    "role",
    "local_view",
]

#: How long process 0 waits for another process's summaries of a step (seconds); also
#: from the environment variable ``TANDV_JAX_GATHER_TIMEOUT``.
GATHER_TIMEOUT_S = float(os.environ.get("TANDV_JAX_GATHER_TIMEOUT", "300"))

#: The row's summary is one process's part of the tensor: the writer merges them all.
LOCAL = "local"
#: Every process holds the same summary (of the global array): the writer keeps its own.
REPLICATED = "replicated"

_trackers = itertools.count()


class ProcessFailure(RuntimeError):
    """Another process of the run did not send its summaries in time (it died, raised, or
    stopped calling ``tracker.step()``)."""


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
    mail: Any = summary if isinstance(summary, mail_type) else None
    return REPLICATED if mail is not None and mail.read.replicated else LOCAL


def local_view(x: Any) -> Any:
    """A replicated global array as this process's own copy (a single-device array, which
    can be copied to the host); other arrays as they are."""
    return x.addressable_data(0) if _is_global(x) else x


class KeyValueGather:
    """Gathers byte strings on process 0 through the ``jax.distributed`` coordination
    service's key-value store, whose blocking read has a timeout (a collective over the
    devices has none: a dead peer would hang it). Keys are deleted once read."""

    def __init__(self, timeout: float = GATHER_TIMEOUT_S) -> None:
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise RuntimeError(
                "tandv: this JAX run has several processes but no jax.distributed client; "
                "call jax.distributed.initialize(...) before track()"
            )
        self._client = client
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.timeout = timeout
        self._prefix = f"tandv/jax/{next(_trackers)}"

    def _get(self, key: str, what: str) -> bytes:
        try:
            got: bytes = self._client.blocking_key_value_get_bytes(key, int(self.timeout * 1000))
        except Exception as e:  # the client raises its runtime's error on a timeout
            raise ProcessFailure(
                f"tandv: {what} did not arrive within {self.timeout:g} s (did that process "
                f"die, raise, or stop calling tracker.step()? Every process must open the "
                f"tracker and call step() as often as the others); the steps recorded before "
                f"are in the log. Set TANDV_JAX_GATHER_TIMEOUT to wait longer"
            ) from e
        self._client.key_value_delete(key)
        return got

    def gather(self, tag: str, payload: bytes) -> list[bytes] | None:
        """Every process's ``payload`` for ``tag`` (in process order) on process 0; None on
        the others, which only send (they do not wait)."""
        if self.process != 0:
            self._client.key_value_set_bytes(f"{self._prefix}/{tag}/{self.process}", payload)
            return None
        return [payload] + [
            self._get(f"{self._prefix}/{tag}/{p}", f"process {p}'s summaries of {tag}")
            for p in range(1, self.processes)
        ]

    def share_path(self, path: Path | None) -> Path:
        """Process 0's log path, on every process (process 0 passes it, the others None)."""
        key = f"{self._prefix}/path"
        if self.process == 0:
            assert path is not None
            self._client.key_value_set_bytes(key, str(path).encode())
            return path
        return Path(self._get(key, "process 0's log path").decode())


def _encode(rows: Sequence[tuple[TensorKey, np.ndarray]]) -> bytes:
    header = json.dumps(
        [[k.name, k.tensor_type, k.module_type, k.dtype, int(v.size)] for k, v in rows]
    ).encode()
    body = np.concatenate([v for _, v in rows]) if rows else np.zeros(0)
    return len(header).to_bytes(8, "little") + header + np.asarray(body, "<f8").tobytes()


def _decode(payload: bytes) -> list[tuple[TensorKey, np.ndarray]]:
    n = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + n])
    body = np.frombuffer(payload[8 + n :], "<f8")
    out, at = [], 0
    for name, tensor_type, module_type, dtype, size in header:
        out.append((TensorKey(name, tensor_type, module_type, dtype), body[at : at + size]))
        at += size
    return out


class ProcessMerger:
    """Merges each tracked step's rows over the processes of the run, on process 0 (see the
    module notes). ``layout_of(dtype)``: the layout of a tensor of that dtype name, for
    rows that only other processes observed."""

    def __init__(
        self,
        layout_of: Callable[[str], Layout],
        timeout: float = GATHER_TIMEOUT_S,
        comm: Any = None,
    ) -> None:
        #: The gather: a :class:`KeyValueGather` unless ``comm`` is given (an object with
        #: its ``process``, ``gather(tag, payload)`` and ``share_path(path)``).
        self._comm = KeyValueGather(timeout) if comm is None else comm
        self._layout_of = layout_of
        self.writer = self._comm.process == 0
        self.failed = False
        #: Seconds spent in the exchange (sending; on process 0 also waiting for and
        #: receiving the others' rows) and steps exchanged, to measure its cost.
        self.seconds = 0.0
        self.steps = 0

    def share_path(self, path: Path | None) -> Path:
        """See :meth:`KeyValueGather.share_path`."""
        return self._comm.share_path(path)

    def commit(
        self,
        recorder: StepRecorder,
        step: int,
        pending: list[tuple[TensorKey, Layout, Any]],
        to_host: Callable[[list[Any]], Sequence[np.ndarray]],
        roles: Sequence[str],
    ) -> None:
        """Record step ``step``'s observations ``pending`` (with ``roles``: :data:`LOCAL` or
        :data:`REPLICATED`) merged over the processes, on process 0; the other processes
        send theirs. After a failed exchange, later steps are dropped (not waited for)."""
        if self.failed:
            return
        host = to_host([s for _, _, s in pending])
        local: dict[TensorKey, tuple[Layout, list[np.ndarray]]] = {}
        own: dict[TensorKey, tuple[Layout, list[np.ndarray]]] = {}
        for (key, layout, _), v, role in zip(pending, host, roles):
            into = own if role == REPLICATED else local
            into.setdefault(key, (layout, []))[1].append(np.asarray(v, np.float64))
        mine = [(k, merge_all(vs, layout)) for k, (layout, vs) in local.items()]
        start = time.perf_counter()
        try:
            got = self._comm.gather(f"step{step}", _encode(mine))
        except ProcessFailure:
            self.failed = True
            raise
        finally:
            self.seconds += time.perf_counter() - start
            self.steps += 1
        if got is None:
            return
        merged: dict[TensorKey, list[np.ndarray]] = {}
        for payload in got:
            for key, v in _decode(payload):
                merged.setdefault(key, []).append(v)
        rows = [(k, layout, merge_all(vs, layout)) for k, (layout, vs) in own.items()]
        for key, vs in merged.items():
            layout = local[key][0] if key in local else self._layout_of(key.dtype)
            rows.append((key, layout, merge_all(vs, layout)))
        recorder.commit(step, rows, lambda summaries: summaries)


class SilentRecorder(StepRecorder):
    """The recorder of a process other than 0: it takes observations like a
    :class:`StepRecorder` (the tracker hands them to :class:`ProcessMerger`), but opens,
    writes and prints nothing; ``path`` is process 0's log."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sinks = ()
        self.warn_pending_bytes, self.max_pending_bytes = 256 * 2**20, 2**30
        self._pending_bytes = 0
        self._warned_pending = False
        self._pending = []
        self.steps_recorded = 0
        self.closed = False
        self.scalars = None

    def log_scalars(self, step: Any, values: Any, current: int, capture: Any = None) -> None:
        """Dropped: process 0 logs the scalars (of the global loss, where it is one)."""
        if self.closed:
            raise RuntimeError(
                "tracker.log_scalars(): the tracker is closed (its `with` block has ended)"
            )

    def commit(self, step: int, pending: Any, to_host: Any) -> int:
        return 0

    def flush(self) -> None:
        pass

    def close(self) -> Path:
        self.closed = True
        self._pending = []
        return self.path
