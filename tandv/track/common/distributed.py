"""Merging a step's summaries across the ranks of a distributed run (framework-neutral).

Each rank of a data- or model-parallel run sees its own part of the tensors: its part of
the batch (activations and their gradients under data parallelism), its shard of a
sharded weight (FSDP, tensor parallelism), or a copy of a tensor every rank holds alike
(DDP's weights, all-reduced gradients and optimizer state). Summaries merge exactly
(:func:`tandv.stats.summary.merge`), so the statistics of the global tensors come from
the per-rank summaries, never from the tensors: at each tracked step every rank sends its
step's summaries, concatenated into one float64 vector, to the writer rank in one gather.

How a row's summaries combine is its *role*, given by the framework adapter:

``LOCAL``
    each rank holds a different part of the tensor (a batch-split activation): the
    writer merges every rank's summary.
``Shard(id)``
    this rank holds one shard of a sharded tensor, named by ``id`` (an integer below
    2**52): ranks holding the same shard (replicas over part of a device mesh, or over
    data-parallel groups) give the same id, and the writer merges one summary per distinct
    id (the lowest rank's), so every shard counts once.
``REPLICATED``
    every rank holds the same tensor: the writer's own summary is the row, and the other
    ranks send nothing for it.

Before the data, the ranks exchange a four-number header (step, row count, value count
and a hash of the rows' identities and roles) so that every rank, not only the writer,
finds out at once when they disagree on the rows of a step and raises
:class:`RankMismatchError` instead of merging unrelated summaries. Collectives carry a
timeout (:class:`Collectives`): a rank that died or raised makes the others raise
:class:`RankFailure` after it instead of waiting forever.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ...stats.summary import Layout, merge_groups
from .rows import TensorKey

__all__ = [
    "LOCAL",
    "REPLICATED",
    "Shard",
    "Role",
    "Collectives",
    "RankMerger",
    "RankFailure",
    "RankMismatchError",
    "merge_ranks",
    "rows_signature",
]

LOCAL = "local"
REPLICATED = "replicated"
#: Largest shard id + 1: ids travel in the float64 vector, which holds them exactly.
SHARD_ID_LIMIT = 2**52


@dataclass(frozen=True)
class Shard:
    """The role of a row holding one shard of a sharded tensor (see the module notes)."""

    id: int

    def __post_init__(self) -> None:
        if not (isinstance(self.id, int) and 0 <= self.id < SHARD_ID_LIMIT):
            raise ValueError(f"Shard(id={self.id!r}): expected an int in [0, 2**52)")


#: How a row's summaries combine over the ranks: ``LOCAL``, ``REPLICATED`` or a ``Shard``.
Role = str | Shard

#: One rank's row of a step: identity, layout, host summary, role.
Row = tuple[TensorKey, Layout, np.ndarray, Role]
Entry = tuple[TensorKey, Layout, np.ndarray]


class Collectives(Protocol):
    """The three collectives the merge needs, over all ranks of the run, each raising
    (instead of waiting forever) once ``timeout`` seconds pass without the other ranks.
    The framework adapter supplies them (``torch.distributed``: a gloo group)."""

    rank: int
    world_size: int
    timeout: float

    def all_gather_ints(self, values: np.ndarray) -> np.ndarray:
        """Every rank's int64 vector (same length on all ranks), stacked: ``(world, k)``."""
        ...

    def gather(self, vector: np.ndarray, dst: int) -> list[np.ndarray] | None:
        """Every rank's float64 vector (same length on all ranks) on rank ``dst``, in rank
        order; ``None`` on the other ranks."""
        ...

    def broadcast_text(self, text: str | None, src: int) -> str:
        """Rank ``src``'s ``text`` on every rank."""
        ...

    def close(self) -> None:
        """Release what the collectives hold (idempotent); called once the tracker's log
        is finished, after the last merge."""
        ...


class RankMismatchError(RuntimeError):
    """The ranks disagree on the rows of a step (raised on every rank)."""


class RankFailure(RuntimeError):
    """A collective of the merge failed or timed out: another rank died, raised, or does
    not track this step."""


def _role_group(role: Role) -> str:
    # shards of one tensor differ in their ids: the signature says "shard"
    return "shard" if isinstance(role, Shard) else role


def rows_signature(rows: Sequence[Row]) -> int:
    """A hash of the rows' identities, layouts and roles, in order, that is the same in
    every process (not Python's ``hash``, which is salted per process): 63 bits, so that
    it fits an int64 collective."""
    h = hashlib.blake2b(digest_size=8)
    for key, layout, _, role in rows:
        h.update(
            f"{key.name}\t{key.tensor_type}\t{key.module_type}\t{key.dtype}\t"
            f"{layout.format.name}\t{layout.extras}\t{_role_group(role)}\n".encode()
        )
    return int.from_bytes(h.digest(), "little") >> 1


def _check_roles(rows: Sequence[Row]) -> None:
    for key, _, _, role in rows:
        if not isinstance(role, Shard) and role not in (LOCAL, REPLICATED):
            raise ValueError(
                f"row {key.name!r} ({key.tensor_type}): role {role!r} is not LOCAL, "
                f"REPLICATED or a Shard"
            )


def _failure(comm: Collectives, what: str, step: int | None, e: BaseException) -> RankFailure:
    at = f" of step {step}" if step is not None else ""
    return RankFailure(
        f"tandv: rank {comm.rank} of {comm.world_size}: {what}{at} failed or timed out "
        f"(dist_timeout={comm.timeout:g}s): another rank raised, died, or does not call "
        f"tracker.step() on the same steps (every rank must track the same steps). The steps "
        f"before it are in the log. Cause: {type(e).__name__}: {e}"
    )


def merge_ranks(step: int, rows: Sequence[Row], comm: Collectives, writer: int = 0) -> list[Entry]:
    """The rows of step ``step`` merged over all ranks, on rank ``writer``; ``[]`` elsewhere.

    Two collectives: an all-gather of a four-number header (the same on every rank, or
    every rank raises :class:`RankMismatchError`), then one gather of one float64 vector
    per rank: the ids of its ``Shard`` rows, then the summaries of its ``LOCAL`` and
    ``Shard`` rows, concatenated (the same length on every rank). ``LOCAL`` rows merge
    every rank's summary, ``Shard`` rows one summary per distinct id (the lowest rank's),
    in rank order; ``REPLICATED`` rows are the writer's own (the others send nothing).

    Raises:
        RankMismatchError: if the ranks disagree on the step, the rows or their roles.
        RankFailure: if a collective fails or times out.
        ValueError: for a role that is not ``LOCAL``, ``REPLICATED`` or a ``Shard``.
    """
    _check_roles(rows)
    sent = [(lay, v) for _, lay, v, role in rows if role != REPLICATED]
    ids = [float(role.id) for _, _, _, role in rows if isinstance(role, Shard)]
    n_values = len(ids) + sum(lay.size for lay, _ in sent)
    header = np.array([step, len(rows), n_values, rows_signature(rows)], dtype=np.int64)
    try:
        headers = comm.all_gather_ints(header)
    except Exception as e:
        raise _failure(comm, "the exchange of the row headers", step, e) from e
    if not (headers == header[None, :]).all():
        per_rank = "; ".join(
            f"rank {r}: step {h[0]}, {h[1]} rows, {h[2]} values, signature {h[3]:x}"
            for r, h in enumerate(headers.tolist())
        )
        raise RankMismatchError(
            f"tandv: the ranks tracked different rows at step {step} ({per_rank}); their "
            f"summaries cannot be merged. Every rank must track the same tensors on the same "
            f"steps: the same model and options (include/exclude, schedule, dtypes), every "
            f"module run on every rank, and tracker.step() called once per step on all ranks"
        )
    vector = np.concatenate([np.asarray(ids), *(np.asarray(v, np.float64) for _, v in sent)])
    try:
        got = comm.gather(vector, writer)
    except Exception as e:
        raise _failure(comm, "the gather of the summaries", step, e) from e
    if got is None:
        return []
    # each merged row: its layout, its values in every rank's vector, and which ranks count
    # (all for LOCAL; the first holder of each distinct shard id for a Shard)
    stacked = np.stack(got)
    groups: dict[tuple[Layout, tuple[int, ...]], list[tuple[int, int]]] = {}
    shard = 0  # index of the next Shard row among the ids
    off = len(ids)
    everyone = tuple(range(len(got)))
    for r, (_, lay, _, role) in enumerate(rows):
        if role == REPLICATED:
            continue
        ranks = everyone
        if isinstance(role, Shard):
            _, first = np.unique(stacked[:, shard], return_index=True)
            ranks = tuple(sorted(first.tolist()))
            shard += 1
        groups.setdefault((lay, ranks), []).append((r, off))
        off += lay.size
    values = {r: v for r, (_, _, v, role) in enumerate(rows) if role == REPLICATED}
    for (lay, ranks), members in groups.items():
        cols = np.concatenate([np.arange(o, o + lay.size) for _, o in members])
        parts = np.concatenate([stacked[k, cols].reshape(len(members), lay.size) for k in ranks])
        which = np.tile(np.arange(len(members)), len(ranks))  # row j of every rank: group j
        for (r, _), v in zip(members, merge_groups(parts, which, lay, len(members))):
            values[r] = v
    return [(key, lay, values[r]) for r, (key, lay, _, _) in enumerate(rows)]


class RankMerger:
    """What the recorder of a distributed run is given (its ``merger``): which rank writes
    and the shared log path (for its :class:`~tandv.track.common.stream.LogStream`), and the
    merge of each committed step's rows (for its
    :class:`~tandv.track.common.buffer.StepBuffer`: :func:`merge_ranks`).

    Arguments:
        comm: the framework's collectives (with their timeout).
        role_of: the role of a row on this rank, from its key (the adapter notes each
            tensor's role when it summarizes it).
        writer: the rank that writes the merged log.
        rank_logs: also let every rank write its own unmerged log (see :meth:`rank_path`).

    After a failed collective every later merge raises at once: the other ranks are gone
    or out of step, and waiting another timeout for them would only delay the error.
    """

    def __init__(
        self,
        comm: Collectives,
        role_of: Callable[[TensorKey], Role],
        *,
        writer: int = 0,
        rank_logs: bool = False,
    ) -> None:
        if not 0 <= writer < comm.world_size:
            raise ValueError(f"writer={writer!r}: expected a rank in [0, {comm.world_size})")
        self.comm = comm
        self.role_of = role_of
        self.writer = writer
        self.rank_logs = bool(rank_logs)
        self._failed: BaseException | None = None

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes the merged log."""
        return self.comm.rank == self.writer

    def shared_path(self, open_log: Callable[[], Path]) -> Path:
        """The log path of the run, the same on every rank: the writer calls ``open_log``
        (which resolves the default path, with its timestamp, and opens the log) and sends
        the path to the others; if it fails there, every rank raises."""
        text: str | None = None
        error: BaseException | None = None
        if self.is_writer:
            try:
                text = "ok:" + str(open_log())
            except Exception as e:
                error = e
                text = f"error:{type(e).__name__}: {e}"
        try:
            got = self.comm.broadcast_text(text, self.writer)
        except Exception as e:
            raise _failure(self.comm, "the broadcast of the log path", None, e) from e
        if error is not None:
            raise error
        status, _, value = got.partition(":")
        if status != "ok":
            raise RuntimeError(f"tandv: rank {self.writer} could not open the log: {value}")
        return Path(value)

    def rank_path(self, path: Path, out_format: str) -> Path:
        """Where this rank's own log goes with ``rank_logs``: ``<out>/rank<k>`` for a
        parquet log (a folder inside the merged log's folder, which readers of the merged
        log skip), ``<out stem>.rank<k>.pkl`` beside a pickle log."""
        if out_format == "pickle":
            return path.with_name(f"{path.stem}.rank{self.rank}.pkl")
        return path / f"rank{self.rank}"

    def merge(self, step: int, entries: Sequence[Entry]) -> list[Entry]:
        """This rank's merged rows of ``step`` (see :func:`merge_ranks`): all of them on the
        writer, ``[]`` elsewhere."""
        if self._failed is not None:
            raise RankFailure(
                f"tandv: rank {self.rank}: step {step} is not merged: an earlier collective "
                f"failed ({self._failed})"
            )
        rows = [(k, lay, v, self.role_of(k)) for k, lay, v in entries]
        try:
            return merge_ranks(step, rows, self.comm, self.writer)
        except (RankFailure, RankMismatchError) as e:
            self._failed = e
            raise

    def close(self) -> None:
        """Release the collectives (idempotent): the tracker calls it when its log is
        finished, after the last merge."""
        self.comm.close()
