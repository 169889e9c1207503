"""A tracker's device memory for summaries, and the one copy per step that brings them home.

Each device a tracker sees gets a buffer of float64 *rows* (:class:`_Space`). An
observation reserves a row and a kernel writes the summary there: the fused Triton kernel
(:mod:`._fused`) for the tensors it reads, or a copy of the torch-op path's raw vector
for the others (float64, tensor subclasses). Nothing is allocated per tensor; the buffer
grows between or, rarely, within steps (a stream-ordered copy keeps what was written).

At the end of a step, :meth:`Workspace.end_step` starts one non-blocking copy of each
device's used rows into pinned host memory, records an event and zeroes the rows for the
next step (the kernel accumulates exponent counts atomically into zeros). The returned
:class:`Flight` is finished on the host later, when its events have completed: the
device never waits for the host. Two pinned buffers per device alternate, so the caller
must finish a flight before starting the second one after it (the tracker finishes step
``k - 1`` at the end of step ``k``).

All kernels run on the current stream of the tensor's device, as the model's own kernels
do: a model that computes on side streams must join them to the current stream before
the tensors it tracks are summarized (as it must before the optimizer uses them).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ...stats.summary import Layout
from .summary import extras_vector, finish_raw, fused_spec, host_vectors, raw_device

if TYPE_CHECKING:  # the fused kernels import Triton: only when a tensor needs them
    from . import _fused

__all__ = ["Slot", "Flight", "Workspace", "to_host"]

_F64 = torch.float64
#: Initial rows buffer per device (float64 values; grows by doubling).
_INITIAL = 1 << 16


@dataclass(frozen=True, eq=False)
class Slot:
    """Where one observation's summary lies in a step's device rows.

    ``spec`` is the fused kernel's dtype spec, or ``None`` for a raw vector of the
    torch-op path (:func:`tandv.track.torch.summary.finish_raw`)."""

    device: torch.device
    offset: int
    size: int
    layout: Layout
    spec: _fused.Spec | None


class _Space:
    """One device's row buffer and the scratch rows of tensors split among programs."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows = torch.zeros(_INITIAL, dtype=_F64, device=device)
        self.used = 0
        self.scratch = torch.empty(0, dtype=_F64, device=device)
        if device.type == "cuda":
            # enough programs per tensor to fill the device a few times over
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            self.max_parts = min(4 * sms, 1024)
        else:
            self.max_parts = 16  # Triton's interpreter: one program at a time
        self.pinned: list[torch.Tensor | None] = [None, None]
        self.lock = threading.RLock()  # held from a reservation through its launch

    def reserve(self, size: int) -> int:
        """The offset of ``size`` fresh (zero) row values (hooks may run on several
        threads: autograd's device threads, ``nn.DataParallel``'s replicas)."""
        with self.lock:
            off = self.used
            need = off + size
            if need > self.rows.numel():
                bigger = torch.zeros(
                    max(2 * self.rows.numel(), need), dtype=_F64, device=self.device
                )
                bigger[:off].copy_(
                    self.rows[:off]
                )  # after the kernels already queued: stream order
                self.rows = bigger
            self.used = need
            return off

    def scratch_for(self, parts: int) -> torch.Tensor:
        """Scratch for ``parts`` partial rows (memory reuse is stream-ordered: replacing a
        buffer that queued kernels still use is safe)."""
        need = parts * 16  # _fused.PART float64 values per partial row
        if self.scratch.numel() < need:
            self.scratch = torch.empty(
                max(need, 2 * self.scratch.numel()), dtype=_F64, device=self.device
            )
        return self.scratch


class Flight:
    """A step's rows on their way to the host: per device, a host buffer, the number of
    values and the event that marks the copy done (``None`` on the CPU)."""

    def __init__(self, copies: list[tuple[torch.device, torch.Tensor, int, Any]]) -> None:
        self._copies = copies

    def ready(self) -> bool:
        """Whether every copy has landed (never waits)."""
        return all(ev is None or ev.query() for _, _, _, ev in self._copies)

    def wait(self) -> dict[torch.device, np.ndarray]:
        """Each device's rows on the host (waits for copies still under way)."""
        out = {}
        for device, host, used, ev in self._copies:
            if ev is not None:
                ev.synchronize()
            out[device] = host[:used].numpy().copy()
        return out


class Workspace:
    """Device summaries of one tracker, one row buffer per device (see the module notes)."""

    def __init__(self) -> None:
        self._spaces: dict[torch.device, _Space] = {}
        self._flights = 0

    def _space(self, device: torch.device) -> _Space:
        space = self._spaces.get(device)
        if space is None:
            space = self._spaces[device] = _Space(device)
        return space

    def summaries(
        self, tensors: Sequence[torch.Tensor], layout: Layout, extras: Sequence[Mapping[str, Any]]
    ) -> list[np.ndarray | Slot]:
        """The summaries of distinct tensors sharing ``layout``, each by its path: finished
        vectors of the host path (CPU tensors), :class:`Slot` s of the fused kernel (one
        launch per device and dtype) and of the torch-op path."""
        fusable = not layout.num_higher  # the fused kernel has no m3/m4 yet: torch ops do
        if len(tensors) == 1 and fusable:  # a hook's tensor: kept short
            spec = fused_spec(tensors[0])
            if spec is not None:
                return self.fused(tensors, spec, layout, extras)  # type: ignore[return-value]
        out: list[Any] = host_vectors(list(tensors), layout, list(extras))
        groups: dict[tuple[torch.device, Any], list[int]] = {}
        for i, t in enumerate(tensors):
            if out[i] is None:
                spec = fused_spec(t) if fusable else None
                if spec is None:
                    out[i] = self.raw(raw_device(t, layout, extras[i]), layout)
                else:
                    groups.setdefault((t.device, spec), []).append(i)
        for (_, spec), idx in groups.items():
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
            slots = [Slot(device, space.reserve(size), size, layout, spec) for _ in tensors]
            live = [(t, s.offset) for t, s in zip(tensors, slots) if t.numel()]
            names = [name for name, _ in layout.extras]
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
                    a = s.offset + spec.row_size
                    space.rows[a : a + len(names)].copy_(extras_vector(ex, names, device))
        return slots

    def raw(self, vector: torch.Tensor, layout: Layout) -> Slot:
        """Keep a raw vector of the torch-op path (on its device) with this step's rows."""
        space = self._space(vector.device)
        with space.lock:
            off = space.reserve(vector.numel())
            space.rows[off : off + vector.numel()].copy_(vector)
        return Slot(vector.device, off, vector.numel(), layout, None)

    def end_step(self) -> Flight | None:
        """Start the copy of this step's rows to the host (see the module notes)."""
        copies: list[tuple[torch.device, torch.Tensor, int, torch.cuda.Event | None]] = []
        parity = self._flights % 2
        for device, space in self._spaces.items():
            used = space.used
            if not used:
                continue
            space.used = 0
            rows = space.rows[:used]
            if device.type == "cpu":
                copies.append((device, rows.clone(), used, None))
            else:
                pinned = space.pinned[parity]
                if pinned is None or pinned.numel() < used:
                    pinned = space.pinned[parity] = torch.empty(
                        space.rows.numel(), dtype=_F64, pin_memory=True
                    )
                with _on(device):
                    pinned[:used].copy_(rows, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record()
                copies.append((device, pinned, used, ev))
            rows.zero_()
        if not copies:
            return None
        self._flights += 1
        return Flight(copies)


def to_host(summaries: Sequence[np.ndarray | Slot], flight: Flight | None) -> list[np.ndarray]:
    """A step's summaries as finished layout vectors on the host: the host path's as they
    are, the :class:`Slot` s from their devices' rows (``flight``, waited for if needed);
    rows of one dtype and layout are finished together."""
    host = flight.wait() if flight is not None else {}
    out: list[Any] = list(summaries)
    groups: dict[tuple, list[tuple[int, Slot]]] = {}
    for i, s in enumerate(summaries):
        if isinstance(s, Slot):
            groups.setdefault((s.spec, s.layout, s.size), []).append((i, s))
    for (spec, layout, size), members in groups.items():
        idx = [i for i, _ in members]
        rows = np.stack([host[s.device][s.offset : s.offset + size] for _, s in members])
        if spec is None:
            done = finish_raw(rows, np)
        else:
            from . import _fused

            done = _fused.finish_rows(rows, spec, layout)
        for i, v in zip(idx, done):
            out[i] = v
    return out


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


def _on(device: torch.device) -> Any:
    """A context that makes ``device`` current while launching (Triton launches on the
    current device), or does nothing when it already is."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return nullcontext()
