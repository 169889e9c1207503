"""A tracker's device memory for summaries, and the one copy per step that brings them home.

Each device a tracker sees gets a buffer of float64 *rows* (:class:`_Space`). An
observation reserves a row and a kernel writes the summary there: the fused Triton kernel
(:mod:`._fused`) for the tensors it reads, or a copy of the torch-op path's raw vector
for the others (float64, tensor subclasses). Nothing is allocated per tensor; the buffer
grows between or, rarely, within steps (a stream-ordered copy keeps what was written).

At the end of a step, :meth:`Workspace.end_step` starts one non-blocking copy of each
device's used rows into pinned host memory, records an event and zeroes the rows for the
next step (the kernel accumulates exponent counts atomically into zeros). The returned
:class:`Flight` owns its host buffer (from torch's caching pinned allocator, returned to
it when the flight is dropped) and is finished later, on any thread (the log's writer
thread), once its events have completed: neither the device nor the training thread
waits.

Streams. Every kernel runs on the current stream of the tensor's device when it is
summarized: the stream that produced the tensor (autograd runs a backward node, and so
the hooks of its gradients, on the stream of the forward operation; a forward hook runs
inside the module's call). The rows of a step may so be written from several streams;
each space remembers the streams that wrote it this step, and whatever next reads or
replaces the rows (growing them, the end of the step) first makes its stream wait for
those. A buffer that a stream other than its allocation stream reads (rows, scratch) is
marked with ``record_stream`` for it, so that replacing it never hands its memory to
new work while that stream may still read it.

CUDA graphs. A summary captured into a graph would be replayed into the rows of the step
captured, not those of the step replayed, and the step's copy would never see it; the
tracker refuses tracking inside a capture (a launch onto a CUDA space, and the end of a
step, first ask ``torch.cuda.is_current_stream_capturing()``).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from functools import cache
from operator import attrgetter, itemgetter, methodcaller
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ...stats.summary import Layout
from . import summary as _summary
from .summary import (
    custom_names,
    extras_vector,
    finish_raw,
    fused_programs,
    fused_spec,
    host_vectors,
    raw_device,
)

if TYPE_CHECKING:  # the fused kernels import Triton: only when a tensor needs them
    from . import _fused

__all__ = [
    "Slot",
    "RowKind",
    "HookLaunch",
    "BatchLaunch",
    "Flight",
    "Workspace",
    "tensor_guard",
    "to_host",
]

_F64 = torch.float64
#: Initial rows buffer per device (float64 values; grows by doubling).
_INITIAL = 1 << 16
#: float64 values of one partial row in the scratch (``_fused.PART``; ``_fused`` imports
#: Triton, which this module imports only when a tensor needs it)
_PART = 16


class RowKind:
    """What the rows of some slots hold: their device, row length, layout and the fused
    kernel's dtype spec (``None``: a raw vector of the torch-op path,
    :func:`tandv.track.torch.summary.finish_raw`). One per kind and device space, shared
    by the slots of every step. ``group``: the kinds whose rows are finished together
    (one device, and the same spec, layout and row length, by identity: hashing them costs
    more than the rest)."""

    __slots__ = ("device", "size", "layout", "spec", "group")

    def __init__(
        self, device: torch.device, size: int, layout: Layout, spec: _fused.Spec | None
    ) -> None:
        self.device = device
        self.size = size
        self.layout = layout
        self.spec = spec
        self.group = (device, id(spec), id(layout), size)


class Slot(tuple):
    """Where one observation's summary lies in a step's device rows: ``(offset, kind)``,
    the offset of its row in its device's buffer and its :class:`RowKind`.

    A tuple: one is made per observation, in the hooks, which build it with
    ``tuple.__new__(Slot, (offset, kind))`` and a kind of their own (no Python call, no
    attribute writes)."""

    __slots__ = ()

    def __new__(
        cls,
        device: torch.device,
        offset: int,
        size: int,
        layout: Layout,
        spec: _fused.Spec | None,
    ) -> Slot:
        return tuple.__new__(cls, (offset, RowKind(device, size, layout, spec)))

    @property
    def offset(self) -> int:
        return self[0]

    @property
    def kind(self) -> RowKind:
        return self[1]

    @property
    def device(self) -> torch.device:
        return self[1].device

    @property
    def size(self) -> int:
        return self[1].size

    @property
    def layout(self) -> Layout:
        return self[1].layout

    @property
    def spec(self) -> _fused.Spec | None:
        return self[1].spec


_new_tuple = tuple.__new__


class _Space:
    """One device's row buffer and the scratch rows of tensors split among programs."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.rows = torch.zeros(_INITIAL, dtype=_F64, device=device)
        self.capacity = _INITIAL  # rows.numel()
        self.used = 0
        self.scratch = torch.empty(0, dtype=_F64, device=device)
        self.scratch_size = 0  # scratch.numel()
        self.max_parts = fused_programs(device)
        # the current device's index and stream's raw handle (``cudaStream_t``, what Triton
        # launches on), asked through torch's C functions: a hook asks both, and
        # ``torch.cuda.current_stream``'s Python path and Stream object took about 5 of a
        # hook's microseconds on an H200's host (cProfile of the 4-layer model's step)
        self.index = -1
        if self.cuda:
            # the stream the buffers were allocated on, and the others that wrote the rows
            # this step (see the module notes)
            self.home: Any = torch.cuda.current_stream(device)
            self.index = self.home.device_index
            self.current_device: Callable[[], int] = torch._C._cuda_getDevice
            self.raw_stream: Callable[[int], int] = torch._C._cuda_getCurrentRawStream
        else:
            self.home = None
        self.writers: list[Any] = []
        # the raw handles of the home stream and of the writers: the streams already ordered
        self.ordered: set[int] = set() if self.home is None else {self.home.cuda_stream}
        self.lock = threading.RLock()  # held from a reservation through its launch
        # zeroed buffers handed back by finished flights (CPU: see Workspace.end_step)
        self.spares: list[torch.Tensor] = []

    def take_spare(self) -> torch.Tensor:
        """A zeroed rows buffer of the current capacity (CPU), a spare if one is left."""
        while self.spares:
            spare = self.spares.pop()
            if spare.numel() == self.capacity:
                return spare
        return torch.zeros(self.capacity, dtype=_F64, device=self.device)

    def stream(self) -> int:
        """The raw handle of the current stream, which the next launch uses, made ready to
        write the rows: ordered after the rows' zeroing and growth (on the home stream) the
        first time it writes them this step, and marked as a reader of the buffers (0, and
        nothing done, on the CPU)."""
        if not self.cuda:
            return 0
        raw = self.raw_stream(self.index)
        if raw not in self.ordered:
            s = torch.cuda.current_stream(self.device)
            s.wait_stream(self.home)
            self.rows.record_stream(s)
            self.scratch.record_stream(s)
            self.writers.append(s)
            self.ordered.add(raw)
        return raw

    def join(self) -> None:
        """Make the current stream wait for every stream that wrote the rows this step,
        and take it as the home stream of what follows (growth, the end of the step)."""
        if not self.cuda:
            return
        s = torch.cuda.current_stream(self.device)
        for w in self.writers:
            if w != s:
                s.wait_stream(w)
        if s != self.home:
            s.wait_stream(self.home)
            self.rows.record_stream(s)
            self.scratch.record_stream(s)
        self.home = s
        self.writers = []
        self.ordered = {s.cuda_stream}

    def reserve(self, size: int) -> int:
        """The offset of ``size`` fresh (zero) row values (hooks may run on several
        threads: autograd's device threads, ``nn.DataParallel``'s replicas)."""
        with self.lock:
            off = self.used
            need = off + size
            if need > self.rows.numel():
                self.join()  # the copy follows every kernel already queued on the rows
                bigger = torch.zeros(
                    max(2 * self.rows.numel(), need), dtype=_F64, device=self.device
                )
                bigger[:off].copy_(self.rows[:off])
                self.rows = bigger
                self.capacity = bigger.numel()
            self.used = need
            return off

    def scratch_for(self, parts: int) -> torch.Tensor:
        """Scratch for ``parts`` partial rows (the buffer replaced is kept for the streams
        that read it: see :meth:`stream`)."""
        need = parts * _PART
        if self.scratch.numel() < need:
            self.scratch = torch.empty(
                max(need, 2 * self.scratch.numel()), dtype=_F64, device=self.device
            )
            self.scratch_size = self.scratch.numel()
            if self.cuda:
                s = torch.cuda.current_stream(self.device)
                for w in (self.home, *self.writers):
                    if w != s:
                        self.scratch.record_stream(w)
        return self.scratch


class HookLaunch:
    """The fused summaries of one hook's tensors: one module's output or output gradient,
    of one dtype, on one device, read densely (contiguous, not a lazily negated view).

    Made at the first such tensor (:meth:`Workspace.hook_launch`) with everything that
    does not depend on the tensor: its row kind and length, the kernel variant and its
    arguments, and what depends on the element count only (kept for the last count seen);
    after the first launch of each pointer alignment, the compiled kernel itself. A later
    tensor then costs a few questions to the tensor, a row reservation and the launch
    (Triton's launcher, called directly): no torch operation, no Python object besides
    its slot."""

    __slots__ = (
        "space",
        "kind",
        "size",
        "device",
        "block",
        "lut",
        "fmax",
        "consts",
        "tail",
        "options",
        "fused",
        "stream",
        "n",
        "programs",
        "tiles",
        "scratch_parts",
        "call",
        "compiled",
        "codes",
        "runtime",
    )

    def __init__(self, space: _Space, spec: _fused.Spec, layout: Layout) -> None:
        fused = self.fused = _fused_module()
        self.space = space
        self.size = fused.row_size(spec, layout)
        self.kind = RowKind(space.device, self.size, layout, spec)
        # what Tensor.get_device() says of the tensors: -1 on the CPU
        self.device = space.device.index if space.cuda else -1
        if _fused_module().block_columns_at(spec, layout) != spec.row_size:
            # block formats: their kernel is launched by launch_one, not here; no tensor's
            # get_device() is -2, so summarize() declines every tensor (the hook's slow path)
            self.device = -2
        self.block = spec.block
        # the value table of an 8-bit format (None: the kernel reads none; the rows stand in)
        self.lut = fused._lut(spec, space.device, space.rows) if spec.lut is not None else None
        self.codes = spec.mode == 3  # an 8-bit format: the kernel reads the bytes
        self.consts, self.fmax = fused.plan_one(spec, layout, 0, False)
        self.tail = self.consts.tail  # the compile-time arguments' values, in order
        # the launch options (what follows the compile-time arguments in consts.kwargs)
        self.options = dict(list(self.consts.kwargs.items())[len(self.tail) :])
        # the raw current stream of a device, as Triton's launcher takes it
        self.stream: Any = None if fused.INTERPRETED else fused.driver.active.get_current_stream
        self.runtime: Any = None if fused.INTERPRETED else fused.knobs.runtime  # (launch hooks)
        self.n = -1  # the element count the next five fields are for
        self.programs = self.tiles = self.scratch_parts = 0
        self.call: Any = None  # (interpreter) the kernel with its grid
        # (compiled kernels) the compiled kernel for unaligned and 16-byte aligned tensors
        self.compiled: list[Any] = [None, None]

    def _resize(self, n: int) -> None:
        """Prepare the launch of tensors of ``n`` (> 0) elements."""
        fused = self.fused
        parts, per = fused._parts(n, self.space.max_parts, self.block)
        self.programs, self.tiles = parts, -(-per // self.block)
        self.scratch_parts = parts if parts > 1 else 0
        self.call = fused._summarize_one[(parts,)] if fused.INTERPRETED else None
        self.n = n

    def summarize(self, x: torch.Tensor) -> Slot | None:
        """Queue the summary of ``x`` (a plain tensor of the launch's dtype) into a fresh
        row and return its slot; ``None`` (nothing done) when ``x`` is not one this launch
        reads: on another device, not dense, lazily negated or empty.

        Every hook's path: one Python frame besides the launch itself (the scratch check
        and the compiled kernel's call are written out here), and no tuple of arguments
        built twice. On a cold cache each frame and object touched costs a few
        microseconds (see ``benchmarks/host_cost.py``)."""
        n = x.numel()
        if n != self.n:
            if not n:
                return None
            self._resize(n)
        if x.get_device() != self.device or not x.is_contiguous() or x.is_neg():
            return None
        if self.codes:
            x = x.view(torch.uint8)
        space, size = self.space, self.size
        with space.lock:  # the rows buffer may not be replaced before the launch
            if space.cuda:
                if space.current_device() != self.device:
                    return None  # (Triton launches on the current device)
                space.stream()
            off = space.used
            if off + size <= space.capacity:
                space.used = off + size
            else:
                off = space.reserve(size)
            rows = space.rows
            scratch = space.scratch
            if self.scratch_parts and space.scratch_size < self.scratch_parts * _PART:
                scratch = space.scratch_for(self.scratch_parts)
            lut = rows if self.lut is None else self.lut
            # (the kernel's arguments: a dense view of weight 1, no statistic copied in)
            call = self.call
            if call is not None:  # Triton's interpreter
                call(
                    x, n, self.tiles, rows, off, scratch, lut, self.fmax, 1.0, rows, 0, 1, 1, 0,
                    0, 0, *self.tail, **self.options
                )  # fmt: skip
            else:
                compiled = self.compiled[x.data_ptr() % 16 == 0]
                runtime = self.runtime
                if compiled is None or self.fused.launch_hooked(
                    runtime.launch_enter_hook, runtime.launch_exit_hook
                ):  # the first launch of this alignment, or a profiler's hooks to call
                    self._launch(x, rows, off, scratch, lut)
                else:  # the prebuilt launcher, called directly
                    compiled.run(
                        self.programs, 1, 1, self.stream(self.device), compiled.function,
                        compiled.packed_metadata, None, None, None,
                        x, n, self.tiles, rows, off, scratch, lut, self.fmax, 1.0, rows, 0, 1,
                        1, 0, 0, 0, *self.tail,
                    )  # fmt: skip
        return _new_tuple(Slot, (off, self.kind))

    def _launch(
        self, x: torch.Tensor, rows: torch.Tensor, off: int, scratch: Any, lut: Any
    ) -> None:
        """Launch the compiled kernel by :func:`._fused._launch` (the first time for this
        pointer alignment, and while a profiler's launch hooks are set), and keep the
        compiled kernel for the direct calls of :meth:`summarize` (the other buffers are
        whole allocations, 16-byte aligned)."""
        fused = self.fused
        args: tuple[Any, ...] = (x, x.numel(), self.tiles, rows, off, scratch, lut, self.fmax)
        args += (1.0, rows, 0, 1, 1, 0, 0, 0)
        ptrs = (x, rows, scratch, lut, rows)
        got = fused._launch(fused._summarize_one, self.programs, args, self.consts, ptrs)
        if got is not None:
            self.compiled[x.data_ptr() % 16 == 0] = got


_T = torch.Tensor


class BatchLaunch:
    """The fused summaries of tensors summarized together at every step (a step's weights,
    the gradients of one optimizer's parameters, the optimizer state): plain tensors of one
    dtype on one device, each dense, not lazily negated and not empty, in one layout with
    no custom statistic and no block format.

    Made at the first such batch (:meth:`Workspace.batch_launch`), it keeps what its last
    launch found: the tensors' addresses and sizes, the row offset of the first, the
    program table and the slots of the rows. A step whose tensors lie where the last
    step's lay, with their sizes (weights and state; gradients that an allocator hands
    back at the same addresses) then costs a pass over the tensors that runs in C (their
    addresses, after the caller's :func:`tensor_guard`), a row reservation and the launch:
    no table, no slot, no Python loop per tensor."""

    __slots__ = (
        "fused",
        "space",
        "spec",
        "layout",
        "size",
        "device",
        "lut",
        "fmax",
        "kind",
        "ptrs",
        "ns",
        "at",
        "table",
        "template",
        "slots",
        "variants",
        "stream",
        "runtime",
    )

    def __init__(self, space: _Space, spec: _fused.Spec, layout: Layout) -> None:
        fused = self.fused = _fused_module()
        self.space, self.spec, self.layout = space, spec, layout
        self.size = fused.row_size(spec, layout)
        self.kind = RowKind(space.device, self.size, layout, spec)
        self.device = space.device.index if space.cuda else -1  # (Tensor.get_device())
        self.lut = fused._lut(spec, space.device, space.rows) if spec.lut is not None else None
        self.fmax = fused._fmax(layout)
        # the last launch's tensors' addresses and sizes; where its rows began and on which
        # stream: (first row offset, stream id)
        self.ptrs: tuple[int, ...] = ()
        self.ns: tuple[int, ...] = ()
        self.at: tuple[int, int] = (-1, -1)
        # (table and addresses on the device, programs, scratch rows, kernel variant)
        self.table: tuple[torch.Tensor, torch.Tensor, int, int, list[Any]] | None = None
        # for the last sizes and rows: the table on the device, the tensors' addresses (an
        # array written at each move) and that array as a tensor, the programs, the scratch
        # rows
        self.template: (
            tuple[torch.Tensor, ctypes.Array[ctypes.c_int64], torch.Tensor, int, int] | None
        ) = None
        self.slots: list[Slot] = []
        # the kernel variants by the tensors' 16-byte alignment: [compile-time arguments,
        # compiled kernel once launched (compiled kernels: later launches call Triton's
        # launcher directly, as a hook's do)]. The other pointer arguments are whole
        # allocations (the table and the addresses on the device, the rows, the scratch,
        # the value table), so the tensors' alignment is the only one that varies
        self.variants: dict[bool, list[Any]] = {}
        # the raw current stream of a device, as Triton's launcher takes it; launch hooks
        self.stream: Any = None if fused.INTERPRETED else fused.driver.active.get_current_stream
        self.runtime: Any = None if fused.INTERPRETED else fused.knobs.runtime

    def summarize(
        self, tensors: Sequence[torch.Tensor], sizes: tuple[int, ...] | None = None
    ) -> list[Slot] | None:
        """Queue the summaries of ``tensors`` (plain tensors of the launch's dtype, two or
        more) into fresh rows, in order, and return their slots; ``None`` (nothing done)
        when they are not all tensors this launch reads (see the class notes): the caller
        takes the general path.

        ``sizes``: the tensors' element counts, from a caller whose :func:`tensor_guard`
        of tensors this launch took has just passed for them (their types, dtypes,
        devices, lazy negation, sizes and strides are those tensors'): then only their
        addresses are read. Else every tensor is asked its address, size, contiguity,
        negation bit and device (a parameter may become a transposed or negated view of
        itself at the same address, ``p.data = p.data.t()``)."""
        ptrs = tuple(map(_T.data_ptr, tensors))
        if self.device < 0 and _summary._cpu_path != "fused":
            return None  # (a test switched the CPU path: the caller's path decides)
        if sizes is not None:
            ns = sizes
        else:
            ns = tuple(map(_T.numel, tensors))
            if (
                not all(map(_T.is_contiguous, tensors))
                or any(map(_T.is_neg, tensors))
                or set(map(_T.get_device, tensors)) != {self.device}
                or not all(ns)
            ):
                return None
        same = ptrs == self.ptrs
        sized = ns == self.ns
        space = self.space
        need = self.size * len(tensors)
        with space.lock:  # the rows buffer may not be replaced before the launch
            if space.cuda:
                if space.current_device() != self.device:
                    return None  # (Triton launches on the current device)
                stream = space.stream()
            else:
                stream = 0  # (space.stream() on the CPU)
            first = space.used  # (the reservation written out: see HookLaunch.summarize)
            if first + need <= space.capacity:
                space.used = first + need
            else:
                space.reserve(need)
            at = (first, stream)
            if not sized or at != self.at:  # other sizes or rows: the table made anew
                self.table = self._table(ptrs, ns, first, True)
                self.ptrs, self.ns, self.at = ptrs, ns, at
            elif not same:  # the tensors moved: their addresses written into the table
                self.table = self._table(ptrs, ns, first, False)
                self.ptrs = ptrs
            dev_table, dev_addrs, programs, parts, variant = self.table  # type: ignore[misc]
            rows = space.rows
            scratch = space.scratch
            if space.scratch_size < parts * _PART:
                scratch = space.scratch_for(parts)
            lut = rows if self.lut is None else self.lut
            fused = self.fused
            consts, compiled = variant
            runtime = self.runtime
            if compiled is None or fused.launch_hooked(
                runtime.launch_enter_hook, runtime.launch_exit_hook
            ):  # the interpreter, a variant's first launch, or a profiler's hooks to call
                variant[1] = fused._launch(
                    fused._summarize_many,
                    programs,
                    (dev_table, dev_addrs, rows, scratch, lut, self.fmax),
                    consts,
                    (dev_table, dev_addrs, rows, scratch, lut),
                )
            else:  # the compiled kernel, called directly (see _fused._launch)
                compiled.run(
                    programs, 1, 1, self.stream(self.device), compiled.function,
                    compiled.packed_metadata, None, None, None,
                    dev_table, dev_addrs, rows, scratch, lut, self.fmax, *consts.tail,
                )  # fmt: skip
        return self.slots

    def _table(
        self, ptrs: tuple[int, ...], ns: tuple[int, ...], first: int, moved: bool
    ) -> tuple[torch.Tensor, torch.Tensor, int, int, list[Any]]:
        """The launch's program table for tensors at ``ptrs`` of ``ns`` elements into rows
        from ``first``, the array of their addresses the kernel reads with it, its program
        count, scratch rows and kernel variant (see ``variants``). The table depends on
        the sizes and rows alone: made (and on a GPU copied there) when they change
        (``moved``), with the slots. The addresses are written again whenever the
        tensors move (gradients may come back at new addresses every step): one array of a
        word per tensor, where writing them into the table would touch each of its
        programs' rows (hundreds of cache lines, each a miss on the cold caches between a
        step's model operations)."""
        fused, space, count = self.fused, self.space, len(ptrs)
        if moved or self.template is None:
            offsets = tuple(range(first, first + self.size * count, self.size))
            layout, _, parts = fused._table_layout(ns, offsets, self.spec.block, space.max_parts)
            table = fused._to_device(torch.from_numpy(layout), space.device)  # (never written)
            # (a ctypes array: its slice assignment from the tuple costs about a third of
            # numpy's on the cold caches of a step's end, ~10 of ~27 us on the 2-core CPU)
            addrs = (ctypes.c_int64 * count)()
            host = torch.frombuffer(addrs, dtype=torch.int64)
            self.template = (table, addrs, host, len(layout), parts)
            self.slots = [_new_tuple(Slot, (off, self.kind)) for off in offsets]
        table, addrs, host, programs, parts = self.template
        # (on the CPU the kernel reads the array before the next move; a GPU its copy. A
        # tuple is as good as the list that typeshed's stub names: no list is made)
        addrs[:] = ptrs  # type: ignore[call-overload]
        if space.cuda:  # (not asked of the device: its first use in a step costs ~10 us)
            host = fused._to_device(host, space.device)
        aligned = fused._aligned(ptrs)
        variant = self.variants.get(aligned)
        if variant is None:
            consts = fused._consts(
                self.spec,
                fused._over(self.spec, self.layout),
                aligned=aligned,
                hoff=fused._hoff(self.spec, self.layout),
            )
            variant = self.variants[aligned] = [consts, None]
        return table, host, programs, parts, variant


class Flight:
    """A step's rows on their way to the host: per device, a host buffer of its own, the
    number of values and the event that marks the copy done (``None`` on the CPU)."""

    def __init__(
        self, copies: list[tuple[torch.device, torch.Tensor, int, Any]], events: Sequence[Any] = ()
    ) -> None:
        self._copies = copies
        # the copies' CUDA events (on the CPU the last item is the space to hand the rows
        # back to), kept apart so that ready() asks them without a Python loop; given by
        # the maker, which knows them (none on the CPU)
        self._events = events

    def ready(self) -> bool:
        """Whether every copy has landed (never waits)."""
        return all(map(_query, self._events))

    def wait(self) -> dict[torch.device, np.ndarray]:
        """Each device's rows on the host (waits for copies still under way)."""
        out = {}
        for device, host, used, ev in self._copies:
            if isinstance(ev, torch.cuda.Event):
                ev.synchronize()
            out[device] = host[:used].numpy()
        return out

    def release(self) -> None:
        """Done with the rows: a CPU space's buffer, taken by the flight, is zeroed and
        handed back to its space as a spare. (Zeroed by numpy, one thread: torch's
        ``zero_`` would take torch's thread pool, which the training thread's operations
        use, from the writer thread.)"""
        for _, host, used, space in self._copies:
            if isinstance(space, _Space):
                host[:used].numpy().fill(0.0)
                space.spares.append(host)
        self._copies = []


class Workspace:
    """Device summaries of one tracker, one row buffer per device (see the module notes)."""

    def __init__(self) -> None:
        self._spaces: dict[torch.device, _Space] = {}
        # row size by (id(spec), id(layout)), with the two
        self._sizes: dict[tuple[int, int], tuple[Any, Layout, int]] = {}
        # the slots of rows reserved together (see _slots), with the layout and spec
        self._slot_lists: dict[tuple[Any, ...], tuple[Layout, Any, list[Slot]]] = {}

    def _space(self, device: torch.device) -> _Space:
        space = self._spaces.get(device)
        if space is None:
            space = self._spaces[device] = _Space(device)
        return space

    def prepare(self, device: torch.device) -> None:
        """Make ready what the first summary on ``device`` needs, outside any hook: its row
        buffer, the value tables of the 8-bit formats on the device (their copy from the
        host waits for the device, which a hook must not do), and, for a device whose rows
        take the fused kernel, the compiled finishing of its rows on the host (loading it
        holds the interpreter for about a third of a second, once per process: at the
        tracker's start rather than in the writer thread's first batch, mid-training)."""
        if fused_spec(torch.empty(0, device=device)) is None:
            return
        from . import _finish

        _finish.warm()
        if device.type != "cuda":
            return
        self._space(device)
        from . import _fused

        with _on(device):
            for dtype in _fused_8bit_dtypes():
                spec = _fused.spec_for(dtype)
                if spec is not None and spec.lut is not None:
                    _fused._lut(spec, device, self._spaces[device].rows)

    def hook_launch(self, spec: _fused.Spec, layout: Layout, device: torch.device) -> HookLaunch:
        """A :class:`HookLaunch` of ``spec``'s tensors in ``layout`` on ``device``."""
        return HookLaunch(self._spaces.get(device) or self._space(device), spec, layout)

    def batch_launch(self, tensor: torch.Tensor, layout: Layout) -> BatchLaunch | None:
        """A :class:`BatchLaunch` of tensors like ``tensor`` (plain, of its dtype, on its
        device) in ``layout``; ``None`` where such tensors do not take it: not the fused
        path, or ``layout`` has custom statistics or block formats."""
        if layout.extras:
            return None
        spec = fused_spec(tensor, layout)
        if spec is None:
            return None
        device = tensor.device
        return BatchLaunch(self._spaces.get(device) or self._space(device), spec, layout)

    def summary(
        self,
        tensor: torch.Tensor,
        layout: Layout,
        extras: Mapping[str, Any],
        spec: Any = None,
    ) -> np.ndarray | Slot:
        """The summary of one tensor (a hook's): :meth:`summaries` of one, kept short.
        ``spec``: ``fused_spec(tensor, layout)`` when the caller knows it already (else
        ``None``)."""
        if spec is None:
            spec = fused_spec(tensor, layout)
        if spec is None:
            return self.summaries([tensor], layout, [extras])[0]
        device = tensor.device
        space = self._spaces.get(device) or self._space(device)
        # the row size by identity (hashing a Spec and a Layout costs more than the rest)
        sized = self._sizes.get((id(spec), id(layout)))
        if sized is None or sized[0] is not spec or sized[1] is not layout:
            sized = self._sizes[(id(spec), id(layout))] = (
                spec,
                layout,
                _fused_module().row_size(spec, layout),
            )
        size = sized[2]
        with space.lock:  # the rows buffer may not be replaced before the launch
            off = space.used
            if off + size <= space.capacity:
                space.used = off + size
            else:
                off = space.reserve(size)
            if space.cuda:
                with _on(device):
                    space.stream()
                    _write_one(space, tensor, spec, layout, off, extras)
            else:
                _write_one(space, tensor, spec, layout, off, extras)
        return Slot(device, off, size, layout, spec)

    def summaries(
        self, tensors: Sequence[torch.Tensor], layout: Layout, extras: Sequence[Mapping[str, Any]]
    ) -> list[np.ndarray | Slot]:
        """The summaries of distinct tensors sharing ``layout``, each by its path: finished
        vectors of the host path (CPU tensors), :class:`Slot` s of the fused kernel (one
        launch per device and dtype) and of the torch-op path."""
        if len(tensors) == 1:  # a hook's tensor: kept short
            spec = fused_spec(tensors[0], layout)
            if spec is not None:
                return self.fused(tensors, spec, layout, extras)  # type: ignore[return-value]
        elif tensors and _uniform(tensors):  # a step's parameters, gradients or state
            first = tensors[0]
            if not (first.is_cpu and _summary.current_cpu_path() == "host"):
                spec = fused_spec(first, layout)
                if spec is not None:
                    return self.fused(tensors, spec, layout, extras)  # type: ignore[return-value]
        out: list[Any] = [None] * len(tensors)
        cpu = [i for i, t in enumerate(tensors) if t.is_cpu]
        if cpu:  # the host path first (when it is on)
            got = host_vectors([tensors[i] for i in cpu], layout, [extras[i] for i in cpu])
            for i, v in zip(cpu, got):
                out[i] = v
        # by device and dtype; the path of a plain tensor depends on nothing else, so it is
        # decided once per group
        groups: dict[tuple[int, torch.dtype], list[int]] = {}
        for i, t in enumerate(tensors):
            if out[i] is None:
                if type(t) in _PLAIN:
                    groups.setdefault((t.get_device(), t.dtype), []).append(i)
                else:  # a tensor subclass: the torch-op path
                    out[i] = self.raw(raw_device(t, layout, extras[i]), layout)
        for idx in groups.values():
            spec = fused_spec(tensors[idx[0]], layout)
            if spec is None:
                for i in idx:
                    out[i] = self.raw(raw_device(tensors[i], layout, extras[i]), layout)
                continue
            slots = self.fused([tensors[i] for i in idx], spec, layout, [extras[i] for i in idx])
            for i, s in zip(idx, slots):
                out[i] = s
        return out

    def fused(
        self,
        tensors: Sequence[torch.Tensor],
        spec: _fused.Spec,
        layout: Layout,
        extras: Sequence[Mapping[str, Any]],
    ) -> list[Slot]:
        """Summarize tensors of ``spec.dtype`` on one device with the fused kernel: one
        launch for all of them (one per tensor for a single tensor)."""
        from . import _fused

        device = tensors[0].device
        space = self._spaces.get(device) or self._space(device)
        size = _fused.row_size(spec, layout)
        with space.lock, _on(device):  # the rows buffer may not be replaced before the launch
            first = space.reserve(size * len(tensors))
            slots = self._slots(device, first, size, len(tensors), layout, spec)
            space.stream()
            names = custom_names(layout)
            if len(tensors) > 1 and all(map(torch.Tensor.numel, tensors)):
                # a step's parameters, gradients or state: all written, rows in order
                _fused.launch_many(
                    tensors,
                    spec,
                    layout,
                    space.rows,
                    range(first, first + size * len(tensors), size),
                    space.scratch_for,
                    space.max_parts,
                )
                if names:
                    for s, ex in zip(slots, extras):
                        a = s.offset + _fused.block_columns_at(spec, layout)
                        space.rows[a : a + len(names)].copy_(extras_vector(ex, names, device))
                return slots
            live = [(t, s.offset) for t, s in zip(tensors, slots) if t.numel()]
            # a hook's only statistic, a 1-element device tensor (a GradScaler's scale):
            # written by the kernel, not copied by one more operation
            extra = _scalar_on(extras[0], names, device) if len(slots) == len(live) == 1 else None
            if len(live) == 1:
                t, off = live[0]
                _fused.launch_one(
                    t,
                    spec,
                    layout,
                    space.rows,
                    off,
                    space.scratch_for(_fused.scratch_rows(t.numel(), space.max_parts, spec)),
                    space.max_parts,
                    extra=extra,
                )
            elif live:
                _fused.launch_many(
                    [t for t, _ in live],
                    spec,
                    layout,
                    space.rows,
                    [off for _, off in live],
                    space.scratch_for,
                    space.max_parts,
                )
            for s, ex in zip(slots, extras):
                if names and extra is None:
                    a = s.offset + _fused.block_columns_at(spec, layout)
                    space.rows[a : a + len(names)].copy_(extras_vector(ex, names, device))
        return slots

    def _slots(
        self, device: torch.device, first: int, size: int, count: int, layout: Layout, spec: Any
    ) -> list[Slot]:
        """The slots of ``count`` rows of ``size`` values from ``first``: the same list as
        the last time these rows were reserved (a step's parameters, gradients and state
        take the same rows every step, and a slot is never changed once made)."""
        if count == 1:
            return [Slot(device, first, size, layout, spec)]
        key = (device, first, size, count, id(layout), id(spec))
        got = self._slot_lists.get(key)
        if got is None or got[0] is not layout or got[1] is not spec:
            if len(self._slot_lists) >= 64:  # (rows that keep moving: made afresh)
                self._slot_lists.clear()
            slots = [Slot(device, first + i * size, size, layout, spec) for i in range(count)]
            got = self._slot_lists[key] = (layout, spec, slots)
        return got[2]

    def raw(self, vector: torch.Tensor, layout: Layout) -> Slot:
        """Keep a raw vector of the torch-op path (on its device) with this step's rows."""
        space = self._space(vector.device)
        with space.lock, _on(vector.device):
            off = space.reserve(vector.numel())
            space.stream()
            space.rows[off : off + vector.numel()].copy_(vector)
        return Slot(vector.device, off, vector.numel(), layout, None)

    def end_step(self) -> Flight | None:
        """Start the copy of this step's rows to the host (see the module notes)."""
        # (device, host rows, values used, the copy's event or the CPU space to hand back to)
        copies: list[tuple[torch.device, torch.Tensor, int, Any]] = []
        events: list[Any] = []  # (the CUDA copies')
        for device, space in self._spaces.items():
            with space.lock:
                used = space.used
                if not used:
                    continue
                if space.cuda and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(
                        "tandv: tracker.step() was called inside a CUDA graph capture; end "
                        "the step outside the captured region (tracked steps cannot be "
                        "captured: see track's `module` argument)"
                    )
                space.used = 0
                if not space.cuda:
                    # no device to copy and zero them in the background: the flight takes
                    # the rows themselves, the space a spare buffer of zeros, and whoever
                    # finishes the flight (the writer thread) zeroes these and returns them
                    copies.append((device, space.rows, used, space))
                    space.rows = space.take_spare()
                    continue
                else:
                    rows = space.rows[:used]
                    with _on(device):
                        space.join()  # after every stream that wrote the rows
                        # a buffer of its own (torch's caching pinned allocator reuses it
                        # once the flight is dropped and its copy is done)
                        host = torch.empty(used, dtype=_F64, pin_memory=True)
                        host.copy_(rows, non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record()
                    copies.append((device, host, used, ev))
                    events.append(ev)
                rows.zero_()
        if not copies:
            return None
        return Flight(copies, events)


def _write_one(
    space: _Space,
    tensor: torch.Tensor,
    spec: _fused.Spec,
    layout: Layout,
    off: int,
    extras: Mapping[str, Any],
) -> None:
    """Queue the fused kernel of one tensor, and the copy of its custom statistics, into
    the row at ``off`` of ``space``."""
    fused = _fused_module()
    n = tensor.numel()
    names = custom_names(layout) if extras else []
    # a hook's only statistic, a 1-element device tensor (a GradScaler's scale): written
    # by the kernel, not copied by one more operation
    extra = _scalar_on(extras, names, space.device) if n and names else None
    if n:
        fused.launch_one(
            tensor,
            spec,
            layout,
            space.rows,
            off,
            space.scratch_for(fused.scratch_rows(n, space.max_parts, spec)),
            space.max_parts,
            extra=extra,
        )
    if names and extra is None:
        a = off + fused.block_columns_at(spec, layout)
        space.rows[a : a + len(names)].copy_(extras_vector(extras, names, space.device))


def to_host(
    summaries: Sequence[np.ndarray | Slot], flight: Flight | None
) -> list[np.ndarray] | np.ndarray:
    """A step's summaries as finished layout vectors on the host: the host path's as they
    are, the :class:`Slot` s from their devices' rows (``flight``, waited for if needed);
    rows of one device, dtype and layout are finished together. (The tracker calls it on
    the log's writer thread, where its time is taken from the training thread's share of
    the interpreter: a row costs a few builtin passes, the Python loop is over row kinds.)

    Where every summary is a slot and all are finished together (a step of one dtype and
    layout, the common case), the result is the float64 array of the finished rows, one
    row per summary in order: a sequence of vectors as the list is, without a Python
    object per row until a reader asks for one."""
    host = flight.wait() if flight is not None else {}
    if summaries and set(map(type, summaries)) == _SLOT_ONLY:
        distinct = set(map(_kind_of, summaries))
        if len({k.group for k in distinct}) == 1:
            kind = next(iter(distinct))
            offsets = np.fromiter(map(_offset_of, summaries), np.int64, len(summaries))
            rows = _finished(host[kind.device], offsets, kind)
            if flight is not None:
                flight.release()
            return rows
    out: list[Any] = list(summaries)
    positions = np.flatnonzero([type(s) is Slot for s in summaries])
    if positions.size:
        slots = [summaries[i] for i in positions.tolist()]
        kinds = list(map(_kind_of, slots))
        offsets = np.fromiter(map(_offset_of, slots), np.int64, len(slots))
        # each group's number and first kind, by the few distinct kinds (a kind serves
        # every step; kinds of one group share device, spec, layout and row length)
        groups: dict[tuple, tuple[int, RowKind]] = {}
        number = {k: groups.setdefault(k.group, (len(groups), k))[0] for k in dict.fromkeys(kinds)}
        gids = np.fromiter(map(number.__getitem__, kinds), np.intp, len(kinds))
        for g, kind in groups.values():
            members = np.flatnonzero(gids == g)
            done = _finished(host[kind.device], offsets[members], kind)
            for i, v in zip(positions[members].tolist(), done):
                out[i] = v
    if flight is not None:
        flight.release()
    return out


def _finished(values: np.ndarray, offsets: np.ndarray, kind: RowKind) -> np.ndarray:
    """The layout vectors (float64, one row each) of the rows of ``kind`` at ``offsets`` of
    ``values`` (a device's rows on the host): the fused kernel's rows in one compiled call
    where :func:`~tandv.track.torch._finish.takes` them, the others gathered, then
    finished with numpy."""
    if kind.spec is None:
        return finish_raw(_gather(values, offsets, kind.size), np)
    from . import _finish, _fused

    if _finish.takes(kind.layout):
        return _finish.finish_at(values, offsets, kind.spec, kind.layout)
    return _fused.finish_rows(_gather(values, offsets, kind.size), kind.spec, kind.layout)


def _gather(values: np.ndarray, offsets: np.ndarray, size: int) -> np.ndarray:
    """The rows of ``size`` values at ``offsets`` of the 1-D ``values``, as one array (one
    contiguous copy per row, through a view that sees a row at every offset)."""
    step = values.strides[0]
    starts = np.lib.stride_tricks.as_strided(
        values, shape=(len(values) - size + 1, size), strides=(step, step), writeable=False
    )
    return starts[offsets]


def _scalar_on(
    extras: Mapping[str, Any], names: list[str], device: torch.device
) -> tuple[int, torch.Tensor] | None:
    """``(0, value)`` when ``extras`` is one floating-point 1-element tensor on ``device``
    (the fused kernel then writes it), else ``None``."""
    if len(names) != 1:
        return None
    v = extras[names[0]]
    if (
        isinstance(v, torch.Tensor)
        and v.numel() == 1
        and v.is_floating_point()
        and v.device == device
    ):
        return 0, v
    return None


_fused_state: list[Any] = []
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor types fused_spec may take
_PLAIN_TYPES = frozenset(_PLAIN)
_device_of = attrgetter("device")
_offset_of = itemgetter(0)  # of a Slot
_SLOT_ONLY = {Slot}
_kind_of = itemgetter(1)
_group_of = attrgetter("group")  # of a RowKind
_dtype_of = attrgetter("dtype")
_query = methodcaller("query")  # (of a CUDA event)


def _uniform(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` are plain tensors (no subclass) of one dtype on one device,
    told without a Python loop per tensor: then one path summarizes them all."""
    return (
        set(map(type, tensors)) <= _PLAIN_TYPES
        and len(set(map(_dtype_of, tensors))) == 1
        and len(set(map(_device_of, tensors))) == 1
    )


def tensor_guard(tensors: Sequence[torch.Tensor]) -> Callable[..., bool] | None:
    """A check that tensors passed to it (as arguments, in order) are distinct objects of
    the exact Python types, dtypes, devices, dispatch keys (lazy negation and conjugation
    among them), sizes, strides and ``requires_grad`` of ``tensors`` now: the guard
    TorchDynamo puts on compiled code's tensor inputs, which reads them all in one call of
    C++ (about as long as one Python question per tensor, where a batch launch would ask
    five). ``None`` where this torch has no such guard that passes :func:`_guard_type`'s
    test (the caller asks the tensors itself)."""
    guards = _guard_type()
    if guards is None:
        return None
    try:
        check: Callable[..., bool] = guards(
            *tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None
        ).check
    except (TypeError, RuntimeError):  # (a tensor it does not take: asked one by one)
        return None
    return check


_guard_found: list[Any] = []  # (_guard_type's answer, once it has one)


def _guard_type() -> Any:
    """TorchDynamo's ``TensorGuards`` (``dynamic_dims_*=None``: every size and stride is
    checked), where it tells apart every change :func:`tensor_guard` promises to tell
    (tried on small CPU tensors, once); else ``None``. It is torch's private API: a torch
    that lacks it, or whose guard takes other arguments or checks less, is not used. A try
    that raises for another reason (a context the step runs in, such as a dispatch mode
    that refuses these operations) is not taken as the answer: the next batch tries again."""
    if _guard_found:
        return _guard_found[0]
    try:
        from torch._C._dynamo.guards import TensorGuards as guards
    except ImportError:
        _guard_found.append(None)
        return None
    TensorGuards: Any = guards  # (its stub declares no tensor arguments)
    try:
        a, b, p = torch.zeros(2, 3), torch.zeros(2, 3), torch.nn.Parameter(torch.zeros(3))
        changed = (
            (a.t().contiguous().t(), b, p),  # strides
            (a[:1], b, p),  # sizes
            (a.double(), b, p),  # dtype
            (torch._neg_view(a), b, p),  # lazy negation
            (a, b, p.detach()),  # type
            (a, b, torch.nn.Parameter(torch.zeros(3), requires_grad=False)),  # requires_grad
            (a, a, p),  # one object twice
        )
    except Exception:  # (the context, not the guard: tried again later)
        return None
    try:
        check = TensorGuards(a, b, p, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
        works = check(a, b, p) is True and not any(check(*args) for args in changed)
    except (TypeError, AttributeError, RuntimeError):  # (another signature)
        works = False
    _guard_found.append(TensorGuards if works else None)
    return _guard_found[0]


def _fused_module() -> Any:
    """:mod:`._fused`, imported at its first use (it imports Triton)."""
    if not _fused_state:
        from . import _fused

        _fused_state.append(_fused)
    return _fused_state[0]


@cache
def _fused_8bit_dtypes() -> tuple[torch.dtype, ...]:
    """The 8-bit torch dtypes (each read through a value table by the fused kernel)."""
    return tuple(
        getattr(torch, name)
        for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, name)
    )


def _on(device: torch.device) -> Any:
    """A context that makes ``device`` current while launching (Triton launches on the
    current device), or does nothing when it already is."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return nullcontext()
