"""How a tracked step's summaries leave the devices: one packed, non-blocking transfer.

The tracker's observations of a step are handles to summaries that are still on devices:
rows of a stack of summaries computed at step time (:class:`StackRow`; of a sharded
array's shards, :class:`ShardRows`), reports in a mailbox the jitted update wrote
(:class:`Mail`: a tracked program's words, or the arena read after a Python-path update),
or this process's shards of a global array in a multi-process run
(:class:`._distributed.LocalParts`). :func:`send` starts one copy of
all the device summaries to the host when the step ends; :func:`to_host` turns the handles
into summary vectors once the copy is needed (a later step, or closing): the device never
waits for the host.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ...stats.summary import N_CORE_VALUES, Layout, merge_all
from . import _distributed
from ._ffi import exact_values
from ._mailbox import MailRead
from ._segments import merge_segments
from ._summary import DeviceSummary, to_vector

__all__ = [
    "StackRow",
    "ShardRows",
    "Segments",
    "Mail",
    "Batch",
    "Stacks",
    "Transfer",
    "Sent",
    "shard_plan",
    "send",
    "to_host",
]


class StackRow(NamedTuple):
    """Row ``row`` of a stacked device summary ``(counts, values)`` of several tensors
    (``(counts, values, words)`` where the host kernel summarized them in the program: the
    float64 core values as uint32 words, see :func:`._ffi.ffi_summary_exact`); a slice of
    rows: an array's segments (inside :class:`Segments`)."""

    stack: tuple[Any, ...]
    row: int | slice


class Segments(NamedTuple):
    """The summary of an array summarized in segments (:mod:`._segments`): ``inner``, a
    handle whose host vectors are the segments' rows, merged on the host by ``layout``."""

    inner: Any
    layout: Layout


class ShardRows(NamedTuple):
    """The summary of a sharded array: the rows ``rows`` of the stack of its shards'
    summaries (one shard of each replicated group), merged on the host by ``layout``;
    ``segments`` rows per shard where its shards are summarized in segments."""

    stack: tuple[Any, Any]
    rows: tuple[int, ...]
    layout: Layout
    segments: int = 1


def shard_plan(x: Any) -> tuple[Any, Any, tuple[int, ...]] | None:
    """For an array split over several devices of a mesh (evenly, all addressable):
    ``(mesh, spec, rows)``, ``rows`` the devices (in mesh order) whose shard is counted: those
    at index 0 along every mesh axis the array is not split over (the others hold copies).
    None for other arrays."""
    from jax.sharding import NamedSharding

    sharding = getattr(x, "sharding", None)
    if (
        not isinstance(sharding, NamedSharding)
        or len(sharding.device_set) < 2
        or not sharding.is_fully_addressable
    ):
        return None
    mesh, spec = sharding.mesh, sharding.spec
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    used: set[str] = set()
    for dim, axes in enumerate(spec):
        axes = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
        used.update(axes)
        if x.shape[dim] % int(np.prod([sizes[a] for a in axes], dtype=np.int64)):
            return None  # uneven shards
    if not used:
        return None  # replicated: one device's summary is the array's
    rows = tuple(
        j
        for j, at in enumerate(np.ndindex(*mesh.devices.shape))
        if all(at[k] == 0 for k, name in enumerate(mesh.axis_names) if name not in used)
    )
    return mesh, spec, rows


class Mail(NamedTuple):
    """Report ``report`` of mailbox ``box`` in a :class:`MailRead` (a tap's summary)."""

    read: MailRead
    box: int
    report: int

    def summary(self) -> DeviceSummary | None:
        return self.read.summary(self.box, self.report)


@jax.tree_util.register_pytree_node_class
class Stacks:
    """What a jitted call returns for a list of arrays on one device: the stacked summaries
    of each dtype group (``stacks``, device arrays) and, as static data of the pytree (set
    when the call is traced, returned by each call without any work on the arrays), each
    array's ``(stack, row, rows)`` in them (``rows`` > 1: its segments') and its dtype."""

    def __init__(
        self,
        stacks: list[tuple[Any, ...]],
        rows: tuple[tuple[int, int, int], ...],
        dtypes: tuple[Any, ...],
        leaves: tuple[int, ...] = (),
    ) -> None:
        self.stacks = stacks
        self.rows = rows
        self.dtypes = dtypes
        #: of the summaries of a tracked program's outputs: the index of each summarized
        #: array among the outputs' leaves
        self.leaves = leaves

    def tree_flatten(self) -> tuple[tuple[Any], tuple[Any, Any, Any]]:
        return (self.stacks,), (self.rows, self.dtypes, self.leaves)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, Any, Any], children: tuple[Any]) -> Stacks:
        return cls(children[0], *aux)

    def select(self, at: Sequence[int]) -> Stacks:
        """The same stacks, as the summaries of the arrays ``at`` of those summarized."""
        rows, dtypes = self.rows, self.dtypes
        return Stacks(self.stacks, tuple([rows[i] for i in at]), tuple([dtypes[i] for i in at]))


class Batch(NamedTuple):
    """The observations of a step's arrays, added as one: the rows' keys and layouts, in
    order, and either their summary handles or the :class:`Stacks` they are rows of. The
    tracker expands it into one observation per array (:meth:`expand`) when the step is
    recorded, on the writer thread: a step costs one observation, not one per array, and
    :func:`send` need not look at each handle."""

    keys: Sequence[Any]
    layouts: Sequence[Any]
    handles: Sequence[Any] | None
    stacks: Stacks | None

    def expand(self) -> list[tuple[Any, Any, Any]]:
        """One ``(key, layout, handle)`` per array."""
        handles = self.handles
        if handles is None:
            assert self.stacks is not None
            stacks = self.stacks.stacks
            handles = [
                StackRow(stacks[g], r)
                if span == 1
                else Segments(StackRow(stacks[g], slice(r, r + span)), layout)
                for (g, r, span), layout in zip(self.stacks.rows, self.layouts)
            ]
        return list(zip(self.keys, self.layouts, handles))


def _pack_words(arrays: list[Any]) -> Any:
    """The bits of ``arrays`` (4- or 8-byte elements) as one flat int32 vector."""
    return jnp.concatenate([jax.lax.bitcast_convert_type(a, jnp.int32).reshape(-1) for a in arrays])


_pack = jax.jit(_pack_words)


class Transfer:
    """A step's summaries still on devices (step-time stacks, mailbox words), packed by one
    jitted call into one int32 array whose copy to the host starts at once, without waiting:
    one transfer per tracked step. Read on the first :meth:`get` (at the next tracked step).
    Arrays on different sets of devices (which one program cannot take) are copied apart."""

    def __init__(self, arrays: list[Any]) -> None:
        self._likes = [(a.shape, np.dtype(a.dtype)) for a in arrays]
        # one array (on the CPU: the mailbox words alone) needs no packing call
        self._one = len(arrays) > 1 and len({frozenset(a.sharding.device_set) for a in arrays}) == 1
        self._device: list[Any] | None = [_pack(arrays)] if self._one else list(arrays)
        for part in self._device:
            part.copy_to_host_async()
        self._host: list[np.ndarray] | None = None

    def ready(self) -> bool:
        """Whether the arrays are computed (their copies to the host started with them)."""
        device = self._device  # (set to None by get(), perhaps on the writer thread)
        return device is None or all(part.is_ready() for part in device)

    def get(self, i: int) -> np.ndarray:
        """The host copy of array ``i`` (waits for the copy the first time)."""
        if self._host is None:
            assert self._device is not None
            if self._one:
                flat, at, self._host = np.asarray(self._device[0]), 0, []
                for shape, dtype in self._likes:
                    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize // 4
                    self._host.append(flat[at : at + n].view(dtype).reshape(shape))
                    at += n
            else:
                self._host = [np.asarray(part) for part in self._device]
            self._device = None
        return self._host[i]


class Sent(NamedTuple):
    """A step's transfer (None: nothing to copy) and where each step-time stack's counts lie
    in it (by the stack's ``id``)."""

    transfer: Transfer | None
    stacks: dict[int, tuple[Transfer, int]]

    def arrived(self) -> bool:
        """Whether the summaries have been computed (reading them waits for no program)."""
        return self.transfer is None or self.transfer.ready()


def send(summaries: Sequence[Any]) -> Sent:
    """Start the one transfer of a step's device summaries: each step-time stack's parts and
    each mailbox read go into it (those of :class:`Batch` observations too)."""
    arrays: list[Any] = []
    stacks: dict[int, tuple[Any, int]] = {}
    reads: dict[int, tuple[MailRead, int]] = {}
    loose: list[Any] = []
    for s in summaries:
        if isinstance(s, Batch):
            if s.stacks is None:
                loose += s.handles or ()
            else:
                for stack in s.stacks.stacks:
                    if id(stack) not in stacks:
                        stacks[id(stack)] = (stack, len(arrays))
                        arrays += list(stack)
        else:
            loose.append(s)
    for s in _distributed.flatten(loose):
        s = s.inner if isinstance(s, Segments) else s
        if isinstance(s, (StackRow, ShardRows)) and id(s.stack) not in stacks:
            stacks[id(s.stack)] = (s.stack, len(arrays))
            arrays += list(s.stack)
        elif isinstance(s, Mail) and id(s.read) not in reads:
            reads[id(s.read)] = (s.read, len(arrays))
            arrays.append(_distributed.local_view(s.read.words))
    if not arrays:
        return Sent(None, {})
    transfer = Transfer(arrays)
    for read, i in reads.values():
        read.fetch_from(functools.partial(transfer.get, i))
    return Sent(transfer, {key: (transfer, i) for key, (_, i) in stacks.items()})


def to_host(summaries: list[Any], stacks: dict[int, tuple[Transfer, int]]) -> list[np.ndarray]:
    """Summary vectors of one step's observations, from the step's transfer (see
    :func:`send`): step-time stacks (:class:`StackRow`, :class:`ShardRows`; ``stacks``:
    where each lies, :attr:`Sent.stacks`, converted once per stack), tap summaries from
    mailboxes (:class:`Mail`) or delivered directly, and vectors the host finished already
    (the block formats' rows: ``SummaryKernels.block_rows``)."""
    matrices: dict[int, np.ndarray] = {}

    def matrix(stack: tuple[Any, ...]) -> np.ndarray:
        if id(stack) not in matrices:
            transfer, i = stacks[id(stack)]
            values = transfer.get(i + 1)
            if len(stack) == 3:  # the host kernel's float64 core values, as uint32 words
                values = values.astype(np.float64)
                values[:, :N_CORE_VALUES] = exact_values(transfer.get(i + 2))
            matrices[id(stack)] = to_vector(DeviceSummary(transfer.get(i), values))
        return matrices[id(stack)]

    out = []
    for s in summaries:
        if isinstance(s, _distributed.LocalParts):  # this process's shards of a global array
            out.append(merge_all(to_host(list(s.parts), stacks), s.layout))
        elif isinstance(s, Segments):
            out.append(merge_segments(to_host([s.inner], stacks)[0], s.layout))
        elif isinstance(s, ShardRows):
            rows, k = matrix(s.stack), s.segments
            shards = [
                rows[r] if k == 1 else merge_segments(rows[r * k : (r + 1) * k], s.layout)
                for r in s.rows
            ]
            out.append(merge_all(shards, s.layout))
        elif isinstance(s, StackRow):
            out.append(matrix(s.stack)[s.row])
        elif isinstance(s, np.ndarray):  # a vector finished on the host already
            out.append(s)
        elif isinstance(s, Mail):
            box, summary = s.read.boxes[s.box], s.summary()
            assert summary is not None  # the tracker drops mailboxes the update did not write
            what = f"the {box.reports[s.report][0]} row of module {box.name!r}"
            out.append(to_vector(summary, what))
        else:
            out.append(to_vector(s))
    return out
