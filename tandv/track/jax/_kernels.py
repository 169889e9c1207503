"""The one place the JAX tracker picks a summary kernel for an array.

Three kernels summarize a JAX array (``track/jax/DESIGN.md`` says why each exists): the host
kernel called from inside an XLA:CPU program (:mod:`._ffi`), XLA's own summary operations
(:mod:`._summary`) and the fused Pallas kernel (:mod:`._pallas`). Which one serves depends
on the array (its dtype and size), the summary layout (block formats' columns, custom
statistics), where the program runs (the CPU, a CUDA GPU, one device or several, one process
or several) and the *summary path* (:func:`summary_path`). :class:`SummaryKernels` holds
that choice for one tracker: its taps, its step-time arrays and the outputs of its tracked
programs are all summarized through it, so no other module of the JAX adapter chooses.

The summary path is ``"auto"`` unless the environment variable ``TANDV_JAX_SUMMARY`` (a
user setting, documented in ``docs/jax.md``) or the test hook :func:`summary_path` says
otherwise; it is read when a tracker is made.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from ...stats.blocks import block_formats_of
from ...stats.formats import format_name
from ...stats.summary import N_CORE_VALUES, Layout
from . import _ffi
from ._blocks import with_words
from ._pallas import pallas_blocks, pallas_summaries, pallas_summary
from ._segments import core_layout, segment_count, segmented
from ._summary import (
    CustomStat,
    DeviceSummary,
    summarize_jax,
    summarize_many_jax,
    with_blocks,
    with_custom,
)
from ._transfer import Stacks, shard_plan

__all__ = [
    "FUSED_SIZE",
    "PATHS",
    "SummaryKernels",
    "SummaryPath",
    "current_summary_path",
    "groups",
    "no_blocks",
    "row_spans",
    "summary_path",
]

SummaryPath = Literal["auto", "xla", "pallas"]
#: The summary paths:
#:
#: - ``"auto"``: on the CPU, the host kernel (inside the program for taps and step-time
#:   arrays); elsewhere XLA's summary operations, and on CUDA GPUs the fused Pallas kernel
#:   for arrays of at least :data:`FUSED_SIZE` elements.
#: - ``"xla"``: XLA's summary operations everywhere, all in programs (no host kernel).
#: - ``"pallas"``: the fused Pallas kernel for every array everywhere (interpreted on the
#:   CPU: slow, for tests), all in programs.
PATHS: tuple[SummaryPath, ...] = ("auto", "xla", "pallas")
#: Arrays with at least this many elements go through the fused kernel on CUDA GPUs.
FUSED_SIZE = 1 << 16
#: Arrays with at least this many elements are summarized by a program of their own.
_OWN_PROGRAM_SIZE = 1 << 16
#: The paths of the open :func:`summary_path` blocks, the innermost last.
_hook: list[SummaryPath] = []


@contextmanager
def summary_path(path: SummaryPath) -> Iterator[None]:
    """Test hook: the summary path of the trackers made inside the ``with`` block, whatever
    ``TANDV_JAX_SUMMARY`` says, so that a machine without a GPU runs the accelerators'
    kernels on the CPU (XLA's operations; the Pallas kernel interpreted) on the inputs the
    host kernel sees. A tracker reads it once, when it is made; the log does not depend on
    it (every path gives the same rows)::

        with summary_path("xla"):
            tracker = track(params, out="log")  # summarizes in programs, by XLA's operations

    Raises:
        ValueError: if ``path`` is not one of :data:`PATHS`.
    """
    if path not in PATHS:
        raise ValueError(f"summary_path({path!r}): expected one of {', '.join(map(repr, PATHS))}")
    _hook.append(path)
    try:
        yield
    finally:
        _hook.pop()


def current_summary_path() -> SummaryPath:
    """The summary path a tracker made now takes: the innermost :func:`summary_path` block's,
    else ``TANDV_JAX_SUMMARY``'s, else ``"auto"``.

    Raises:
        ValueError: if ``TANDV_JAX_SUMMARY`` names no path.
    """
    path = _hook[-1] if _hook else os.environ.get("TANDV_JAX_SUMMARY", "auto")
    for known in PATHS:
        if path == known:
            return known
    raise ValueError(
        f"tandv: TANDV_JAX_SUMMARY={path!r}: expected one of {', '.join(map(repr, PATHS))}"
    )


def groups(arrays: Sequence[Any]) -> list[tuple[str, list[int]]]:
    """Indices of ``arrays`` by dtype name, in first-seen order."""
    by_dtype: dict[str, list[int]] = {}
    for i, x in enumerate(arrays):
        by_dtype.setdefault(format_name(x.dtype), []).append(i)
    return list(by_dtype.items())


def row_spans(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``(first row, rows)`` in a stack (:func:`_rows_of`) of each array of ``sizes``
    elements: one row, or one per segment (:func:`._segments.segment_count`)."""
    out, at = [], 0
    for n in sizes:
        k = segment_count(n)
        out.append((at, k))
        at += k
    return out


def _rows_of(parts: Sequence[Any]) -> Any:
    """The summaries' parts ``parts`` (one array's each: a row, or a stack of its segments'
    rows) as one stack of rows."""
    return jnp.concatenate([p if p.ndim == 2 else p[None] for p in parts])


def _uncut(layout: Layout, size: int) -> None:
    """Refuses (:func:`no_blocks`) block formats on an array of ``size`` elements that is
    summarized in segments: the block formats' words are of one whole array."""
    if segment_count(size) > 1:
        no_blocks(layout, f"an array of {size} elements (summarized in segments)")


def no_blocks(layout: Layout, what: str) -> None:
    """Refuses a summary of ``layout`` where the block formats' columns cannot be computed
    (never a row without them): a sharded array's shards would be summarized apart (blocks
    cut where the last dimension is split, NVFP4's tensor scale taken per shard), and the
    taps inside a loop body merge their iterations on the device, which does not merge the
    block formats' words yet.

    Raises:
        NotImplementedError: naming ``what`` and what to do instead.
    """
    if block_formats_of(layout.extras):
        raise NotImplementedError(
            f"track(block_formats=...): the JAX tracker does not compute the block formats' "
            f"columns of {what} yet. Exclude it (track(..., exclude=...)), or leave "
            f"block_formats out"
        )


class SummaryKernels:
    """The summary kernels of one tracker and the choice between them.

    Arguments:
        layout: the tracker's summary layout of an array of a dtype (custom statistics and
            block formats' columns included).
        custom: the custom statistics every summary carries (``{name: array -> scalar}``).
        moments: the central moments the layouts carry (2 or 4).
        multi: whether the run has several processes (the host kernel does not partition
            over them: XLA's operations serve).

    The jitted entry points are made once here, so each is compiled once per shape and
    dtype: :attr:`summarize_xla` and :attr:`summarize_cpu` (a tap's summary off and on the
    CPU), :attr:`summarize_many` (a step's arrays on any devices: stacks per dtype, shard
    rows) and :attr:`summarize_one_device` (a step's arrays on one device, as
    :class:`Stacks`).
    """

    def __init__(
        self,
        layout: Callable[[Any], Layout],
        custom: Mapping[str, CustomStat],
        moments: int,
        multi: bool,
    ) -> None:
        self._layout = layout
        self._custom = custom
        self._moments = moments
        #: the summary path (:func:`summary_path`), read once
        self.path: SummaryPath = current_summary_path()
        #: whether the host kernel serves arrays on the CPU (it does not partition over
        #: processes; where it cannot be built, XLA's operations serve): its handler with
        #: the block formats' words too where the layouts carry block formats
        blocks = bool(block_formats_of(layout(jnp.dtype(jnp.float32)).extras))
        self.host_kernel = self.path == "auto" and not multi and _ffi.available(blocks)
        #: whether the host kernel summarizes step-time arrays on a device (in the program)
        self._exact_on: dict[Any, bool] = {}
        self.summarize_xla = jax.jit(self.summarize, static_argnames="fused")
        self.summarize_cpu = jax.jit(self.summarize_in_program)
        self.summarize_many = jax.jit(self.summaries, static_argnums=(1, 2, 3))
        self.summarize_one_device = jax.jit(self.stacks, static_argnums=1)

    # ------------------------------------------------------------------ choosing

    def in_program_on(self, platforms: set[str]) -> bool:
        """Whether the taps of an update running on ``platforms`` call the host kernel
        inside the program (the CPU alone, the ``auto`` path, one process)."""
        return platforms == {"cpu"} and self.host_kernel

    def tap_summary(self, on_cpu: bool, one_device: bool) -> Callable[[Any], DeviceSummary]:
        """The jitted summary a tap calls: the host kernel's custom call where ``on_cpu``
        (:meth:`in_program_on`), else XLA's operations or the fused kernel (on one device
        only: ``one_device``; see :meth:`summarize`)."""
        if on_cpu:
            return self.summarize_cpu
        return functools.partial(self.summarize_xla, fused=one_device)

    def exact_on(self, device: Any) -> bool:
        """Whether step-time arrays on ``device`` are summarized by the host kernel in the
        program, with its exact float64 words (cached per device)."""
        exact = self._exact_on.get(device)
        if exact is None:
            exact = self._exact_on[device] = self.host_kernel and device.platform == "cpu"
        return exact

    def _kernel_serves(self, x: jax.Array, fused: bool) -> bool:
        """Whether the fused Pallas kernel may summarize ``x`` (else XLA's operations): on
        the ``"pallas"`` path, and on the ``"auto"`` path for large arrays (on CUDA GPUs,
        picked when the program is lowered); never on the ``"xla"`` path."""
        return jnp.dtype(x.dtype) != jnp.float64 and (
            self.path == "pallas" or (self.path == "auto" and x.size >= FUSED_SIZE and fused)
        )

    # ------------------------------------------------------------------ off the host kernel

    def summarize(self, x: jax.Array, fused: bool = True) -> DeviceSummary:
        """Traceable summary of ``x`` off the host kernel: XLA's operations, or the fused
        Pallas kernel (see :data:`PATHS`; float64 always takes XLA's). ``fused``: whether the
        kernel may serve in ``"auto"``, False for programs on several devices (XLA
        partitions its own operations over a sharded array; a kernel would need the whole
        array on each device). An array past :data:`._segments.SEGMENT_ELEMENTS` elements is
        summarized in segments (:func:`._segments.segmented`); the block formats' words
        follow the custom statistics (:meth:`_with_blocks`)."""
        core = functools.partial(self._core, fused=fused)
        summary = DeviceSummary(*segmented(core, x, self._custom))
        return self._with_blocks(summary, x, fused)

    def _with_blocks(self, summary: DeviceSummary, x: jax.Array, fused: bool) -> DeviceSummary:
        """``summary`` of ``x`` (custom statistics in it) with the words of the block formats
        of ``x``'s layout: by the second Pallas kernel where the fused one serves (on CUDA),
        else by XLA's operations; unchanged without block formats. An array summarized in
        segments is refused with block formats (their words are of one whole array)."""
        layout = self._layout(x.dtype)
        if not block_formats_of(layout.extras):
            return summary
        _uncut(layout, x.size)
        if not self._kernel_serves(x, fused):
            return with_blocks(summary, x, layout)
        if self.path == "pallas":
            return pallas_blocks(summary, x, layout)

        def on(kernel: bool) -> Callable[..., tuple[jax.Array, jax.Array]]:
            def blocks(a: jax.Array, c: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
                s = DeviceSummary(c, v)
                got = pallas_blocks(s, a, layout, False) if kernel else with_blocks(s, a, layout)
                return got.counts, got.values

            return blocks

        return DeviceSummary(
            *jax.lax.platform_dependent(
                x, summary.counts, summary.values, cuda=on(True), default=on(False)
            )
        )

    def _core(self, x: jax.Array, fused: bool = True) -> DeviceSummary:
        """:meth:`summarize` of one segment, without custom statistics and block formats."""
        layout = core_layout(self._layout(x.dtype))
        if not self._kernel_serves(x, fused):  # (the "xla" path lowered for CUDA took it)
            return summarize_jax(x, layout)

        def kernel(a: jax.Array, interpret: bool | None = None) -> DeviceSummary:
            return pallas_summary(
                a, layout.format, layout.num_counts, interpret=interpret, moments=layout.moments
            )

        if self.path == "pallas":
            return kernel(x)
        return jax.lax.platform_dependent(
            x, cuda=lambda a: kernel(a, False), default=lambda a: summarize_jax(a, layout)
        )

    # ------------------------------------------------------------------ the host kernel

    def summarize_in_program(self, x: jax.Array) -> DeviceSummary:
        """Traceable summary for XLA:CPU: the host kernel as a custom call (float64 arrays
        take the XLA path); custom statistics are XLA operations appended to its values."""
        if jnp.dtype(x.dtype) == jnp.float64:
            return self.summarize(x)
        summary, _ = self._in_program(x, exact=False)
        return summary

    def _core_in_program(self, x: jax.Array) -> DeviceSummary:
        """:meth:`summarize_in_program` of one segment (not float64), without custom
        statistics."""
        layout = self._layout(x.dtype)
        return _ffi.ffi_summary(x, layout.format, layout.num_counts, layout.moments)

    def _summarize_exact(self, x: jax.Array) -> tuple[jax.Array, ...]:
        """Traceable, on the CPU (not float64): counts, values (custom statistics appended)
        and the exact float64 core values as uint32 words of ``x``'s summary by the host
        kernel in the program (see :func:`._ffi.ffi_summary_exact`)."""
        summary, words = self._in_program(x, exact=True)
        return (summary.counts, summary.values, *words)

    def _in_program(self, x: jax.Array, exact: bool) -> tuple[DeviceSummary, tuple[Any, ...]]:
        """The summary of ``x`` (not float64) by the host kernel's custom call, in segments
        past :data:`._segments.SEGMENT_ELEMENTS` elements, with the block formats' words
        computed in the same call (such an array is not cut: refused), and where ``exact``
        the exact words (a one-part tuple; else empty)."""
        layout = self._layout(x.dtype)
        fmt, counts, moments = layout.format, layout.num_counts, layout.moments
        formats = block_formats_of(layout.extras)
        if not formats:
            if not exact:
                return DeviceSummary(*segmented(self._core_in_program, x, self._custom)), ()

            def exact_core(a: jax.Array) -> tuple[jax.Array, ...]:
                summary, words = _ffi.ffi_summary_exact(a, fmt, counts, moments)
                return (*summary, words)

            c, v, *rest = segmented(exact_core, x, self._custom)
            return DeviceSummary(c, v), tuple(rest)
        _uncut(layout, x.size)
        core, words, (ints, floats) = _ffi.ffi_summary_blocks(
            x, fmt, counts, moments, formats, exact
        )
        s = with_custom(core, x, self._custom)
        summary = DeviceSummary(*with_words(s.counts, s.values, ints, floats, N_CORE_VALUES, True))
        return summary, (() if words is None else (words,))

    def _summarize_anywhere(self, x: jax.Array, fused: bool) -> DeviceSummary:
        """Traceable summary of a step-time array: where the host kernel serves (the
        ``auto`` path, one process), the program picks it when it is lowered for the CPU
        (:meth:`summarize_in_program`), else :meth:`summarize`."""
        if not self.host_kernel:
            return self.summarize(x, fused)
        if jnp.dtype(x.dtype) == jnp.float64:
            return self.summarize(x, fused)
        if block_formats_of(self._layout(x.dtype).extras):  # (in the custom call on the CPU)
            return jax.lax.platform_dependent(
                x, cpu=self.summarize_in_program, default=lambda a: self.summarize(a, fused)
            )

        def core(a: jax.Array) -> DeviceSummary:
            return jax.lax.platform_dependent(
                a, cpu=self._core_in_program, default=lambda b: self._core(b, fused)
            )

        return self._with_blocks(DeviceSummary(*segmented(core, x, self._custom)), x, fused)

    # ------------------------------------------------------------------ a step's arrays

    def summaries(
        self, arrays: list[jax.Array], fused: bool, plans: tuple[Any, ...], exact: bool = False
    ) -> list[tuple[jax.Array, ...]]:
        """Traced: per dtype group, the stacked counts and values of its arrays' summaries
        (stacked so that the host fetches a few arrays, not two per tensor); ``fused``: see
        :meth:`summarize`. Then, for each array with a :func:`._transfer.shard_plan` in
        ``plans``, the stacked summaries of its shards, each computed on the device that
        holds it (no collective: the host merges them).

        ``exact``: the arrays are in CPU memory and the host kernel serves them; it runs in
        the program as a custom call, and the stacks of groups it summarizes have a third
        part, its float64 core values as uint32 words (:func:`._ffi.ffi_summary_exact`),
        so that these rows keep float64 moments without x64."""
        from jax.sharding import PartitionSpec

        out: list[tuple[jax.Array, ...]] = []
        for i, plan in enumerate(plans):
            if plan is not None:
                mesh, spec, _ = plan
                layout = self._layout(arrays[i].dtype)
                no_blocks(layout, "an array split over several devices")

                def local(a: jax.Array, layout: Layout = layout) -> tuple[jax.Array, jax.Array]:
                    core = functools.partial(summarize_jax, layout=core_layout(layout))
                    counts, values = segmented(core, a, self._custom)
                    if counts.ndim == 1:  # one row per shard, else one per segment
                        return counts[None], values[None]
                    return counts, values

                out.append(
                    jax.shard_map(
                        local,
                        mesh=mesh,
                        in_specs=spec,
                        out_specs=PartitionSpec(tuple(mesh.axis_names)),
                        check_vma=False,
                    )(arrays[i])
                )
        plain = [i for i, plan in enumerate(plans) if plan is None]
        for dtype, idx in groups([arrays[i] for i in plain]):
            idx = [plain[i] for i in idx]
            layout = self._layout(dtype)
            # Large arrays run faster through their own program (no copy into a shared
            # block); small ones share one, which keeps compile time down and, on a GPU,
            # the kernels the host launches at each call: one summary's, not one per array
            # (a 2-layer MLP's 24 outputs lowered for CUDA: 595 reductions, scatters,
            # products and concatenations before, 109 shared; benchmarks/jax_gpu_probe.py).
            # The host kernel (on the CPU: ``exact``) takes each array on its own; elsewhere
            # it does not serve, whether or not it is built.
            # An array summarized in segments has a row per segment (see :meth:`stacks`).
            if exact and jnp.dtype(arrays[idx[0]].dtype) != jnp.float64:
                done = [self._summarize_exact(arrays[i]) for i in idx]
                out.append(tuple(_rows_of(part) for part in zip(*done)))
                continue
            if self.path == "pallas":  # small arrays share the kernel's calls
                parts = self._pallas_many([arrays[i] for i in idx], idx, fused)
            else:
                small = [
                    i
                    for i in idx
                    if arrays[i].size < _OWN_PROGRAM_SIZE and segment_count(arrays[i].size) == 1
                ]
                parts = dict(
                    zip(
                        small,
                        summarize_many_jax([arrays[i] for i in small], layout, self._custom),
                    )
                )
            for i in idx:
                if i not in parts:
                    parts[i] = self._summarize_anywhere(arrays[i], fused)
            out.append(
                (
                    _rows_of([parts[i].counts for i in idx]),
                    _rows_of([parts[i].values for i in idx]),
                )
            )
        return out

    def _pallas_many(
        self, arrays: list[jax.Array], idx: list[int], fused: bool
    ) -> dict[int, DeviceSummary]:
        """On the ``"pallas"`` path, :meth:`summarize` of the arrays of one dtype group that
        fit one segment (not float64), by index: their core summaries by
        :func:`._pallas.pallas_summaries`, which gives small arrays of similar sizes one
        kernel call (the same summaries as one call each, in fewer, smaller programs)."""
        whole = [
            k
            for k, a in enumerate(arrays)
            if segment_count(a.size) == 1 and jnp.dtype(a.dtype) != jnp.float64
        ]
        if not whole:
            return {}
        layout = core_layout(self._layout(arrays[whole[0]].dtype))
        cores = pallas_summaries(
            [arrays[k] for k in whole],
            layout.format,
            layout.num_counts,
            moments=layout.moments,
        )
        out = {}
        for k, core in zip(whole, cores):
            summary = with_custom(core, arrays[k], self._custom)
            out[idx[k]] = self._with_blocks(summary, arrays[k], fused)
        return out

    def stacks(self, arrays: list[jax.Array], exact: bool) -> Stacks:
        """Traced: :meth:`summaries` of arrays on one device, with each array's (stack,
        row) and dtype as the result's static data."""
        rows = [(0, 0, 1)] * len(arrays)
        for g, (_, idx) in enumerate(groups(arrays)):
            for (r, span), i in zip(row_spans([arrays[i].size for i in idx]), idx):
                rows[i] = (g, r, span)
        stacks = self.summaries(arrays, True, (None,) * len(arrays), exact)
        return Stacks(stacks, tuple(rows), tuple(np.dtype(a.dtype) for a in arrays))

    def block_rows(self, arrays: list[jax.Array]) -> dict[int, np.ndarray]:
        """With ``block_formats``, the finished vectors of the arrays the host kernel can
        take (one CPU device, a dtype of :data:`HOST_DTYPES`, no custom statistics), by
        index: the host kernel computes the block formats' columns in the pass that reads
        them (float64), waiting for the update that computes them. The others go on to
        :attr:`summarize_many` (the block formats' words by XLA or the Pallas kernel)."""
        if self._custom or not self.host_kernel or not arrays:
            return {}
        if not block_formats_of(self._layout(arrays[0].dtype).extras):
            return {}
        from ...stats.host import HOST_DTYPES, host_higher_moments, host_summaries

        out: dict[int, np.ndarray] = {}
        for dtype, idx in groups(arrays):
            idx = [
                i
                for i in idx
                if np.dtype(arrays[i].dtype) in HOST_DTYPES
                and shard_plan(arrays[i]) is None
                and all(d.platform == "cpu" for d in arrays[i].devices())
            ]
            if idx:
                host = [np.asarray(arrays[i]) for i in idx]
                vectors = host_summaries(host, self._layout(dtype))
                if self._moments == 4:  # m3, m4 after the block formats' columns
                    vectors = np.hstack([vectors, host_higher_moments(host, vectors)])
                out.update(zip(idx, vectors))
        return out
