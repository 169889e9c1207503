"""The JAX/Flax tracker: ``track(...)`` context manager, ``intercept`` and ``step``."""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from ...schema.columns import GRADIENT, OPTIMISER_STATE, WEIGHT
from ...stats.summary import Layout
from ..common import TensorKey
from ..common.core import TrackerCore
from ..common.custom import StatFn
from ..common.factory import signature_of
from ..common.options import TrackKwargs, TrackOptions
from . import _distributed, _misuse
from ._adapter import JaxAdapter
from ._delivery import Probe
from ._intercept import TrackedProgram, interception, jitted_core
from ._kernels import SummaryKernels, groups, no_blocks, row_spans
from ._mailbox import Mailboxes, MailRead, ProgramMailboxes
from ._nnx import tag_nnx_paths
from ._sink import ROOT_NAME, Mailbox, Report, register
from ._state import Parts, gradients_of, is_nnx_module, is_nnx_optimizer, parts_of
from ._summary import CustomStat
from ._taps import tap
from ._transfer import (
    Batch,
    Mail,
    Segments,
    Sent,
    ShardRows,
    StackRow,
    Stacks,
    shard_plan,
)
from .trees import (
    Leaf,
    collection_leaves,
    is_float_array,
    key_name,
    optimizer_state_leaves,
    param_leaves,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["JaxTracker", "track"]

T = TypeVar("T")
_tokens = itertools.count(1)
#: Numbers the traces of tracked programs (word 0 of their mailbox words names the layout).
_serials = itertools.count(1)
#: Tracked programs a tracker keeps (more: the update is made anew at each call).
_MAX_PROGRAMS = 64


#: What JAX says when a batched value is written to an unbatched ref (a tap's mailbox under vmap).
_VMAP_REFUSAL = "vmapped value on an unbatched array reference"


def _devices_of(tree: Any) -> list[Any]:
    """The devices holding the JAX arrays of ``tree`` (those the update will run on), in id
    order."""
    devices = {
        d for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array) for d in x.devices()
    }
    return sorted(devices, key=lambda d: d.id)


def _replicated(devices: list[Any]) -> Any:
    """A sharding that replicates over ``devices`` (None for at most one device: the default)."""
    if len(devices) < 2:
        return None
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    return NamedSharding(Mesh(np.array(devices), ("tandv",)), PartitionSpec())


def _custom_stats(fns: Sequence[StatFn]) -> dict[str, CustomStat]:
    """Custom statistics (functions returning ``{name: scalar}``) as ``{name: array ->
    scalar}``: each function is traced once on a small abstract array (``jax.eval_shape``,
    no computation) to learn its names."""
    custom: dict[str, CustomStat] = {}
    for fn in fns:
        try:
            shape = jax.eval_shape(fn, jax.ShapeDtypeStruct((2,), jnp.float32))
        except Exception as e:
            raise ValueError(f"stats: calling {fn!r} on a float32 array failed: {e}") from e
        if not isinstance(shape, Mapping):
            raise TypeError(
                f"stats: {fn!r} must return a mapping {{name: scalar}}; got {type(shape).__name__}"
            )
        for name in shape:
            if name in custom:
                raise ValueError(f"stats: custom statistic {name!r} is returned by two functions")

            def pick(x: Any, _f: Callable[..., Any] = fn, _k: str = name) -> Any:
                return _f(x)[_k]

            custom[name] = pick
    return custom


def _check_states(
    model_state: Any, optimizer_state: Any, device_axis: Any, track_updates: bool
) -> None:
    """Refuses arguments of :func:`track` that do not fit together, saying what to pass."""
    if optimizer_state is not None and model_state is None:
        raise ValueError(
            "track(): optimizer_state was given without model_state; optimizer-state leaves "
            "are named after the parameters they mirror, so pass model_state too"
        )
    if model_state is not None and not param_leaves(parts_of(model_state).params)[0]:
        raise ValueError(
            f"track(): model_state has no floating-point leaves to track (got "
            f"{type(model_state).__name__}); pass the parameters, e.g. the dict from "
            f"model.init(...) or an nnx module"
        )
    if device_axis is not None and not isinstance(device_axis, bool):
        raise TypeError(f"track(device_axis={device_axis!r}): expected True, False or None")
    if (
        model_state is not None
        and optimizer_state is not None
        and parts_of(model_state).opt_state is not None
    ):
        raise ValueError(
            f"track(): model_state ({type(model_state).__name__}) holds the optimizer state "
            f"already (its opt_state); leave optimizer_state out"
        )
    if track_updates and model_state is None:
        raise ValueError(
            "track(track_updates=True): updates are differences of the parameters given to "
            "track() and step(); pass model_state"
        )


class _TapSink:
    """The tracker as its taps see it (implements :class:`._sink.TapSink`): the mailbox
    arena, the merge rules of the tracker's custom statistics, whether a tap of the current
    step calls back, and where concrete reports land.

    It holds the tracker's ``receive`` weakly: the tracker owns its sink, so the sink (held
    by the registry of sinks, weakly too) never keeps its tracker alive."""

    def __init__(
        self, receive: Callable[[str, str, str, str, Any], None], merge_rules: Sequence[str]
    ) -> None:
        #: The arena and its mailboxes (the tracker prepares and reads them).
        self.mailboxes = Mailboxes(merge_rules)
        #: The mailboxes of the tracked program being traced (None: the arena's, above).
        self.program: ProgramMailboxes | None = None
        #: The mailbox layout of each trace of a tracked program, by its serial.
        self.layouts: dict[int, list[Any]] = {}
        #: Whether a tap of the current step reports by host callback (the tracker resets it).
        self.callbacks_used = False
        #: Whether any tap was ever traced to report by host callback (a compiled function
        #: is traced once: its later calls say nothing).
        self.callbacks_seen = False
        #: The merge rules of the tracker's custom statistics (a loop body's mailbox merges).
        self.merge_rules = list(merge_rules)
        #: A layout with block formats' columns, where the tracker's layouts have them
        #: (their words are not merged over a loop's iterations: :func:`._kernels.no_blocks`).
        self.block_layout: Layout | None = None
        self._receive = weakref.WeakMethod(receive)  # a bound method of the tracker

    @property
    def arena(self) -> Any:
        return self.mailboxes.arena if self.program is None else self.program.arena

    def post(
        self,
        name: str,
        module_type: str,
        reports: Sequence[Report],
        arena: Any = None,
        remat: bool = False,
        merge: bool = False,
    ) -> bool:
        if merge and self.block_layout is not None:
            no_blocks(self.block_layout, f"module {name!r}'s output inside a loop body (scan)")
        boxes: Mailbox = self.mailboxes if self.program is None else self.program
        return boxes.post(name, module_type, reports, arena, remat, merge)

    def receive(
        self, name: str, module_type: str, tensor_type: str, dtype: str, summary: Any
    ) -> None:
        receive = self._receive()
        if receive is not None:
            receive(name, module_type, tensor_type, dtype, summary)

    def note_callback(self) -> None:
        self.callbacks_used = self.callbacks_seen = True


class JaxTracker(TrackerCore[Sent]):
    """Tracks one JAX/Flax training run; create it with :func:`track`.

    Use it as a context manager (the log opens when the block starts); a tracker used
    without one opens its log at its first :meth:`intercept`, :meth:`step` or
    :meth:`log_scalars`, and is finished by :meth:`close`.

    Attributes:
        out_path: where the log is written (a parquet directory or a .pkl file), once open.
        step_index: the index of the current step (the number of :meth:`step` calls so far).
    """

    #: the JAX adapter the core calls (made by :meth:`__init__`)
    _adapter: JaxAdapter

    def __init__(
        self,
        model_state: Any = None,
        optimizer_state: Any = None,
        *,
        device_axis: bool | None = None,
        **options: Unpack[TrackKwargs],
    ) -> None:
        opts = TrackOptions.of(options)
        super().__init__(opts, type(model_state).__name__, "jax")
        _check_states(model_state, optimizer_state, device_axis, opts.track_updates)
        fns = opts.stat_fns
        if opts.percentile_columns:
            from ._percentiles import percentile_stat

            fns += (percentile_stat(opts.percentile_columns),)
        self._custom = _custom_stats(fns)
        self._extra_names = tuple(self._custom)
        #: the custom statistics' (name, merge rule), as the taps' mailboxes merge them
        self._extras = tuple((name, self._merge_rules.get(name, "mean")) for name in self._custom)
        self._track_activations = opts.track_activations
        self._track_gradients = opts.track_gradients
        self._has_model = model_state is not None
        self._has_optimizer = optimizer_state is not None  # given apart from model_state
        self._track_updates = opts.track_updates
        # the parameters of the current step (names, arrays), kept when its update is tracked
        self._before: tuple[list[Leaf], list[Any]] | None = None
        self._subtract = jax.jit(lambda new, old: [a - b for a, b in zip(new, old)])
        self._device_axis = device_axis
        self._module_types: dict[str, type] = {}
        self._names_cache: dict[Any, list[Leaf]] = {}  # the selected leaves of a tree shape
        #: of each list of the names cache (by id), what takes its arrays from the leaves
        self._pickers: dict[int, tuple[list[Leaf], Callable[[list[Any]], list[Any]]]] = {}
        #: the row keys and layouts of a list of leaves of the names cache, by (its id,
        #: tensor type, the arrays' dtypes, module types known): see :meth:`_keys_of`
        self._keys_cache: dict[Any, tuple[list[Leaf], list[TensorKey], list[Layout]]] = {}
        self._sink = _TapSink(self._receive, [rule for _, rule in self._extras])
        if self.options.block_extras:
            self._sink.block_layout = self._layout("float32")
        self._token = next(_tokens)
        #: the tracked program of each jitted update seen (None: not one jitted function)
        self._programs: dict[Any, TrackedProgram | None] = {}
        self._call_args: Any = None  # the arguments of the tracked program being called
        #: the outputs of this step's tracked program and the summaries it made of them
        #: (:class:`Stacks`), or None; and, once looked up, the position of each summarized
        #: output by its id (with the outputs)
        self._made: tuple[Any, Stacks] | None = None
        self._made_at: tuple[dict[int, int], list[Any]] | None = None
        # a tracked program's mailbox words stand in the step's observations under this key
        # until they arrive and are decoded into rows (:meth:`_observed`)
        self._mail_key = self._key(ROOT_NAME, "Activation", "", "float32")
        self._mail_layout = self._layout("float32")
        # a step's arrays stand under these keys until recorded (:class:`Batch`); Gradient
        # where they hold gradients (the log's check for steps without module rows sees them)
        self._batch_keys = {
            kind: self._key(ROOT_NAME, kind, "", "float32") for kind in (WEIGHT, GRADIENT)
        }
        self._on_cpu = False
        self._one_device = True  # whether the intercepted update runs on one device
        self._intercepted = False  # whether intercept() ran in the current step
        #: the module outputs of this step's intercepted calls (training calls and others)
        self._step_applications = _misuse.StepApplications()
        #: the summaries of the weights the next step's update uses (:meth:`_prepare_weights`:
        #: what :meth:`_add_batch` takes), None when the next step is not recorded
        self._next_weights: tuple[Any, ...] | None = None
        #: the ``.update`` leaves of each list of parameter leaves (see :meth:`_updates`)
        self._update_leaves: dict[int, tuple[list[Leaf], list[Leaf]]] = {}
        # one process of several (jax.distributed): global arrays are summarized by their
        # shards here, and the steps merged over the processes (see ``_distributed``)
        self._multi = _distributed.multi_process()
        self._adapter = JaxAdapter(opts, self._key, self._layout, self._multi, device_axis)
        #: the summary kernels and the choice between them (the summary path is read now).
        #: Taps call a jitted summary of it: compiled once per shape and dtype when the
        #: update runs eagerly, and traced once per shape (then inlined) when it is jitted.
        self._kernels = SummaryKernels(self._layout, self._custom, opts.moments, self._multi)
        register(self._token, self._sink)
        self._trees = _misuse.StepTrees.given(model_state, optimizer_state)
        self._applications = _misuse.Applications(self._track_activations)
        if model_state is not None:
            self._learn_nnx_types(model_state)
            self._prepare_weights(parts_of(model_state), 0)
            self._keep_before(parts_of(model_state), 0)

    # ------------------------------------------------------------------ summaries

    def _summarize_arrays(self, arrays: list[jax.Array]) -> list[Any]:
        """Summaries of ``arrays``: one handle per array (see ``_transfer``).

        All are summarized by one jitted call, dispatched without waiting (queued after the
        update that computes them, so a later donating update cannot take them first): on
        the CPU by the host kernel inside the program (see :class:`._kernels.SummaryKernels`),
        elsewhere by XLA's operations or the fused kernel. Stack rows (:class:`StackRow`,
        :class:`ShardRows`) that :func:`_to_host` fetches when the step is recorded."""
        if self._multi:  # global arrays: this process's shards
            flat, spans = _distributed.split_global(arrays)
            if any(span is not None for span in spans):
                handles: list[Any] = [None] * len(flat)
                for group in _distributed.by_devices(flat):  # one program per device set
                    for i, h in zip(group, self._summarize_arrays([flat[i] for i in group])):
                        handles[i] = h
                layouts = [self._layout(x.dtype) for x in arrays]
                return _distributed.join_global(handles, spans, layouts)
        if not arrays:
            return []
        rows: list[Any] = [None] * len(arrays)
        for i, vector in self._kernels.block_rows(arrays).items():
            rows[i] = vector
        rest = [i for i, r in enumerate(rows) if r is None]
        if not rest:
            return rows
        device = [arrays[i] for i in rest]
        plans = tuple(shard_plan(x) for x in device)
        devices = _devices_of(device)
        exact = self._kernels.host_kernel and {d.platform for d in devices} == {"cpu"}
        stacks = iter(self._kernels.summarize_many(device, len(devices) <= 1, plans, exact))
        for i, plan in zip(rest, plans):
            if plan is not None:
                stack = next(stacks)
                rows[i] = ShardRows(
                    stack,
                    plan[2],
                    self._layout(arrays[i].dtype),
                    stack[0].shape[0] // plan[0].devices.size,  # segments per shard
                )
        plain = [i for i, plan in zip(rest, plans) if plan is None]
        for (_, idx), stack in zip(groups([arrays[i] for i in plain]), stacks):
            for (r, span), i in zip(row_spans([arrays[plain[i]].size for i in idx]), idx):
                rows[plain[i]] = self._stack_row(stack, r, span, arrays[plain[i]].dtype)
        return rows

    def _stack_row(self, stack: tuple[Any, ...], r: int, span: int, dtype: Any) -> Any:
        """The handle of an array's summary in rows ``r`` to ``r + span`` of ``stack`` (its
        segments' when ``span > 1``, merged on the host)."""
        if span == 1:
            return StackRow(stack, r)
        return Segments(StackRow(stack, slice(r, r + span)), self._layout(dtype))

    def _summarize_batch(self, arrays: list[Any]) -> tuple[list[Any] | None, Stacks | None]:
        """Summaries of a step's ``arrays`` (refused first where they are ``jax.pmap``
        replicas without ``device_axis``): arrays on one device by one call that returns
        :class:`Stacks` (``(None, stacks)``), others one handle per array (``(handles,
        None)``, see :meth:`_summarize_arrays`)."""
        if not arrays:
            return [], None
        if self._made is not None:  # the arrays a tracked program returned: summarized there
            out, made = self._made
            if self._made_at is None:  # (found by identity; made once a step)
                leaves = jax.tree_util.tree_leaves(out)
                outputs = [leaves[i] for i in made.leaves]  # (held: an id names no other)
                self._made_at = {id(a): j for j, a in enumerate(outputs)}, outputs
            position = self._made_at[0]
            at = [position.get(id(a), -1) for a in arrays]
            if -1 not in at:
                return None, made.select(at)
        # All on one device (the common case: no replicas to refuse, no shard to plan) is
        # told from the arrays' slots, as cheaply as can be per array; None where they lack
        # them (numpy arrays, another sharding, or another JAX version: the general path)
        devices = {getattr(getattr(a, "_sharding", None), "_device", None) for a in arrays}
        if (
            len(devices) == 1
            and None not in devices
            and not self._multi
            and not self.options.block_extras  # (the host reads such arrays itself)
        ):
            device: Any = next(iter(devices))
            exact = self._kernels.exact_on(device)
            return None, self._kernels.summarize_one_device(arrays, exact)
        self._check_not_stacked(arrays)
        return self._summarize_arrays(arrays), None

    def _owner_of(self, name: str) -> type | None:
        """The class of the module owning parameter ``name`` (``None`` while unknown)."""
        return self._module_types.get(name.rpartition(".")[0] if "." in name else ROOT_NAME)

    def _leaf_key(self, leaf: Leaf, tensor_type: str, dtype: Any) -> TensorKey:
        owner = self._owner_of(leaf.param)
        return self._key(leaf.name, tensor_type, "" if owner is None else owner.__name__, dtype)

    # ------------------------------------------------------------------ activations

    def intercept(self, f: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``f(*args, **kwargs)`` and return exactly what it returns, summarizing every Flax
        module output (``Activation``) and its cotangent (``Gradient``) on tracked steps.

        ``f`` may be plain Python, ``jax.jit``/``nnx.jit``-compiled, or call jitted code; it is
        traced twice (with and without tracking; once more if its taps outgrow the first
        mailbox arena), not once per step. A jitted ``f`` runs as a tracked program of its
        own (:class:`._intercept.TrackedProgram`: the user's jit options carried over, the
        summaries returned as an extra output), whose calls keep JAX's C++ dispatch path;
        other updates take the Python path (:meth:`_intercept_python`). Exceptions from
        ``f`` propagate unchanged, except
        JAX's refusal to write a batched summary (module outputs under ``jax.vmap``), which
        becomes a ``ValueError`` that says what to do. Several calls in one step (gradient
        accumulation) are all observed.
        """
        self._check_open("intercept")
        if not callable(f):
            raise TypeError(f"tracker.intercept(f, ...): f must be the update function; got {f!r}")
        if not (self._track_activations or self._track_gradients) or not self._scheduled(
            self.step_index
        ):
            return f(*args, **kwargs)
        try:
            program = self._programs.get(f)
        except TypeError:  # an unhashable callable: not a jitted function
            program = None
        if program is None or program.stale:
            program = self._program_of(f, program)
        try:
            if program is None:
                return self._intercept_python(f, args, kwargs)
            if program.nnx is None:
                self._call_args = (args, kwargs)
                out, words, made = program.call(*args, **kwargs)
                self._add_words(program, words, out, made)
                return out
            f.jitted_fn = functools.partial(self._call_program, program)  # type: ignore[attr-defined]
            try:
                return f(*args, **kwargs)
            finally:
                f.jitted_fn = program.inner  # type: ignore[attr-defined]
        except Exception as e:
            if _VMAP_REFUSAL not in str(e):
                raise
            raise ValueError(
                "tandv: a module output's summary came out batched (a vmap tandv did not "
                "see through); exclude that module (track(..., exclude=[...])) or track with "
                "track_activations=False, track_gradients=False to keep the other rows"
            ) from e
        finally:
            self._call_args = None

    def _program_of(self, f: Any, old: TrackedProgram | None) -> TrackedProgram | None:
        """The tracked program of the jitted update ``f`` (made on its first call, and again
        when ``old``'s arena was outgrown); None where ``f`` is not one jitted function (or
        runs over several processes): then :meth:`_intercept_python` serves."""
        inner = None if self._multi else jitted_core(f)
        if inner is None:
            return None
        if len(self._programs) >= _MAX_PROGRAMS:  # updates made anew at every call
            self._programs.clear()
        program = TrackedProgram(inner, None if inner is f else f, self._trace_program)
        if old is not None:
            program.capacity = old.capacity
        self._programs[f] = program
        return program

    def _call_program(self, program: TrackedProgram, *args: Any, **kwargs: Any) -> Any:
        """Stands for an ``nnx.jit`` function's inner jitted function during a tracked call."""
        self._call_args = (args, kwargs)
        out, words, made = program.call(*args, **kwargs)
        self._add_words(program, words, out, made)
        return out

    def _add_words(self, program: TrackedProgram, words: Any, out: Any, made: Any) -> None:
        """Observe the mailbox words a tracked program returned (decoded once they arrive,
        by :meth:`_observed`), and keep the summaries of its outputs ``made`` (None where
        it computed none) for :meth:`step`, by the outputs' identity."""
        self._step_applications.add(self.step_index, *program.applied)
        if program.callbacks:
            self._sink.callbacks_used = True
        read = MailRead(None, words, self._sink.mailboxes.warned, self._sink.layouts)
        self.recorder.add(self._mail_key, self._mail_layout, Mail(read, -1, -1))  # type: ignore[union-attr]
        self._made, self._made_at = None if made is None else (out, made), None

    def _output_summaries(self, out: Any) -> Stacks | None:
        """Traced, at the end of a tracked program: the summaries of its float outputs
        (those that ``step()`` is given, usually: parameters, optimizer state, gradients),
        computed in the program so that ``step()`` makes no call of its own for them. None
        on several devices or processes (their arrays' shards are summarized apart, at
        ``step()``) and with block formats (read on the host)."""
        if not self._one_device or self._multi or self.options.block_extras:
            return None
        leaves = jax.tree_util.tree_leaves(out)
        at = tuple(i for i, x in enumerate(leaves) if is_float_array(x) and hasattr(x, "shape"))
        if not at:
            return None
        made = self._kernels.stacks([leaves[i] for i in at], self._on_cpu)
        made.leaves = at
        return made

    def _trace_program(
        self, program: TrackedProgram, args: tuple, kwargs: dict
    ) -> tuple[Any, Any, Any]:
        """The body of ``program``, run while JAX traces it: the user's jitted function
        traced with taps that write into an arena made inside the program; returns its
        outputs, the written words and the summaries of its float outputs
        (:meth:`_output_summaries`)."""
        self._where(self._call_args)  # the arrays of the call being traced
        mail = ProgramMailboxes(next(_serials), program.capacity, self._sink.merge_rules)
        self._sink.program, callbacks = mail, self._sink.callbacks_used
        self._sink.callbacks_used = False
        self._applications = applications = _misuse.Applications(self._track_activations)
        try:
            with interception(
                (self._token, self._on_cpu, self._one_device, "program", mail.serial),
                self._on_output,
            ):
                out = program.fun(*args, **kwargs)
        finally:
            self._sink.program = None
            program.callbacks = self._sink.callbacks_used
            self._sink.callbacks_used |= callbacks
        program.applied = (frozenset(applications.names), applications.trained)
        self._sink.layouts[mail.serial] = mail.boxes
        if mail.overflowed:  # the rest went by callback; the next call gets room for all
            program.capacity, program.stale = 2 * mail.wanted, True
        return out, mail.words(), self._output_summaries(out)

    def _where(self, call: Any) -> list[Any]:
        """Set where the update of the arrays in ``call`` runs (the CPU's in-program host
        kernel or not; one device or several); returns its devices."""
        devices = _devices_of(call)
        # The update runs where its arrays are (JAX's default backend when it is given none).
        platforms = {d.platform for d in devices} or {jax.default_backend()}
        self._on_cpu = self._kernels.in_program_on(platforms)
        self._one_device = len(devices) <= 1
        return devices

    def _intercept_python(self, f: Callable[..., T], args: tuple, kwargs: dict) -> T:
        """Run an update that is not one jitted function (plain Python, possibly around
        several jitted functions) with taps writing into the tracker's arena, a ``jax.Ref``
        that each jitted function closes over (their calls take JAX's Python dispatch)."""
        devices = self._where((args, kwargs))
        if self._intercepted:  # a second call in this step (e.g. gradient accumulation): the
            self._collect_mailboxes()  # first one's mailboxes are read before they are reused
        self._sink.mailboxes.prepare(_replicated(devices))
        self._intercepted = True
        self._applications = applications = _misuse.Applications(self._track_activations)
        try:
            with interception(
                (self._token, self._on_cpu, self._one_device, self._sink.mailboxes.generation),
                self._on_output,
            ):
                out = f(*args, **kwargs)
            names = frozenset(applications.names)
            self._step_applications.add(self.step_index, names, applications.trained)
            return out
        finally:
            # a jitted function traced with callbacks earlier calls back now too: step()
            # waits for them (callbacks deliver into the step being built)
            self._sink.callbacks_used |= self._sink.callbacks_seen

    def _collect_mailboxes(self) -> None:
        """Read the mailboxes (their copy to the host starts now; they are decoded when the
        step is recorded) and add each report as an observation of the current step."""
        read = self._sink.mailboxes.read()
        if read is not None:
            for box, report, name, module_type, tensor_type, dtype in read.reports():
                self._receive(name, module_type, tensor_type, dtype, Mail(read, box, report))

    def _on_output(self, name: str, cls: type, out: Any) -> Any:
        """Wrap the float leaves of one module output in taps (called while tracing)."""
        self._module_types.setdefault(name, cls)
        self._applications.note(name, cls, out)
        flat, treedef = jax.tree_util.tree_flatten_with_path(out)
        wrapped = []
        for path, leaf in flat:
            if is_float_array(leaf):
                # elements of structured outputs as name[0], name[key] (as in PyTorch)
                leaf_name = name + "".join(f"[{key_name(k)}]" for k in path)
                if self._selected(leaf_name, cls):
                    probe = Probe(
                        self._token,
                        leaf_name,
                        cls.__name__,
                        self._track_activations,
                        self._track_gradients,
                        self._kernels.tap_summary(self._on_cpu, self._one_device),
                    )
                    leaf = tap(probe, leaf)
            wrapped.append(leaf)
        return jax.tree_util.tree_unflatten(treedef, wrapped)

    def _receive(
        self, name: str, module_type: str, tensor_type: str, dtype: str, summary: Any
    ) -> None:
        """A tap's summary arriving from the device (directly, from a mailbox or from the tap's
        host callback, through :class:`_TapSink`)."""
        if self.recorder is not None and not self._closed:
            self.recorder.add(
                self._key(name, tensor_type, module_type, dtype), self._layout(dtype), summary
            )

    # ------------------------------------------------------------------ step

    @staticmethod
    def _nnx_grads(gradients: Any) -> Any:
        return parts_of(gradients).params if is_nnx_module(gradients) else gradients

    @staticmethod
    def _opt_of(optimizer_state: Any) -> Any:
        return optimizer_state.opt_state if is_nnx_optimizer(optimizer_state) else optimizer_state

    def _learn_nnx_types(self, model_state: Any) -> None:
        if is_nnx_module(model_state):
            from flax import nnx

            self._adapter.nnx_tagged = tag_nnx_paths(model_state)
            for path, node in nnx.iter_graph(model_state):
                if isinstance(node, nnx.Module):
                    self._module_types.setdefault(".".join(map(str, path)) or ROOT_NAME, type(node))

    def _named(self, kind: str, tree: Any, params: Any = None) -> tuple[list[Leaf], list[Any]]:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        cache_key = (
            kind,
            treedef,
            None if params is None else jax.tree_util.tree_structure(params),
            len(self._module_types),  # include/exclude by class: the classes learned so far
        )
        chosen = self._names_cache.get(cache_key)
        if chosen is None:
            if kind == OPTIMISER_STATE:
                named = optimizer_state_leaves(tree, params)
            elif kind == "collections":
                named = collection_leaves(tree)
            elif kind == "slow":
                named = [
                    Leaf(leaf.index, f"{leaf.name}.slow", leaf.param)
                    for _, leaf in param_leaves(tree)[0]
                ]
            else:
                named = [leaf for _, leaf in param_leaves(tree)[0]]
            chosen = [n for n in named if self._selected(n.name, self._owner_of(n.param))]
            self._names_cache[cache_key] = chosen
        pick = self._pickers.get(id(chosen))
        if pick is None or pick[0] is not chosen:
            pick = self._pickers[id(chosen)] = (chosen, _picker([n.index for n in chosen]))
        arrays = pick[1](leaves)
        if self._device_axis:
            arrays = [self._logical(x) for x in arrays]
        return chosen, arrays

    def _logical(self, x: Any) -> Any:
        """With ``device_axis``, one replica of a per-device stacked array (``jax.pmap``)."""
        return x[0] if self._device_axis and getattr(x, "ndim", 0) > 0 else x

    def _prepare_weights(self, parts: Parts, step: int) -> None:
        """Start summarizing the weights (and model state outside the parameters) that step
        ``step``'s forward pass will use (now, so a later buffer donation cannot delete them)."""
        self._next_weights = None
        if not self._scheduled(step):
            return
        named, arrays = self._named(WEIGHT, parts.params)
        segments = [(named, WEIGHT)]
        if parts.collections is not None:
            more, extra = self._named("collections", parts.collections)
            segments.append((more, WEIGHT))
            arrays = arrays + extra
        # the keys are made in step(): module types may be known by then
        self._next_weights = (segments, arrays, *self._summarize_batch(arrays))

    def _keys_of(
        self, leaves: list[Leaf], tensor_type: str, dtypes: tuple[Any, ...]
    ) -> tuple[list[TensorKey], list[Layout]]:
        """The row keys and summary layouts of ``leaves`` (a list of :meth:`_named`'s
        cache, or one kept by :meth:`_updates`) of ``tensor_type``, their arrays of
        ``dtypes``: made once per list (and module types known), not at every step."""
        ck = (id(leaves), tensor_type, dtypes, len(self._module_types))
        hit = self._keys_cache.get(ck)
        if hit is None or hit[0] is not leaves:
            keys = [self._leaf_key(n, tensor_type, d) for n, d in zip(leaves, dtypes)]
            hit = self._keys_cache[ck] = (leaves, keys, [self._layout(d) for d in dtypes])
        return hit[1], hit[2]

    def _add_batch(
        self,
        segments: Sequence[tuple[list[Leaf], str]],
        arrays: list[Any],
        handles: list[Any] | None,
        stacks: Stacks | None,
    ) -> None:
        """Observe the summaries of a step's ``arrays`` (those of the leaves of
        ``segments``, each with its tensor type, in order: :meth:`_summarize_batch`'s
        ``handles`` or ``stacks``) as one :class:`Batch`."""
        if not arrays:
            return
        dtypes = stacks.dtypes if stacks is not None else tuple([a.dtype for a in arrays])
        keys: list[TensorKey] = []
        layouts: list[Layout] = []
        at = 0
        for leaves, tensor_type in segments:
            k, lay = self._keys_of(leaves, tensor_type, dtypes[at : at + len(leaves)])
            keys += k
            layouts += lay
            at += len(leaves)
        kind = GRADIENT if any(t == GRADIENT for _, t in segments) else WEIGHT
        self.recorder.add(  # type: ignore[union-attr]
            self._batch_keys[kind], self._mail_layout, Batch(keys, layouts, handles, stacks)
        )

    def _check_step_args(self, model_state: Any, optimizer_state: Any, gradients: Any) -> None:
        for arg, given, told in (
            ("model_state", model_state is not None, self._has_model),
            ("optimizer_state", optimizer_state is not None, self._has_optimizer),
        ):
            if given and not told:
                raise ValueError(
                    f"tracker.step(): got {arg}, but track() was not given {arg}; pass {arg}= to "
                    f"track() to track it, or leave it out of step()"
                )
            if told and not given:
                raise ValueError(
                    f"tracker.step(): {arg} is missing; track() was given {arg}, so pass the "
                    f"updated one after each update: tracker.step({arg}=...)"
                )
        if gradients is not None and not self._track_gradients:
            raise ValueError(
                "tracker.step(): got gradients, but track(track_gradients=False); leave "
                "gradients out or enable track_gradients"
            )
        if gradients is None and self._track_gradients and self._has_model:
            raise ValueError(
                "tracker.step(): gradients is missing; with model_state and "
                "track_gradients=True, pass the step's parameter gradients: "
                "tracker.step(model_state, optimizer_state, gradients) "
                "(or track(track_gradients=False))"
            )

    def _check_not_stacked(self, arrays: Sequence[Any]) -> None:
        _misuse.check_replicas(arrays, self._device_axis)

    def step(
        self, model_state: Any = None, optimizer_state: Any = None, gradients: Any = None
    ) -> None:
        """Close the current step, after the update.

        Arguments:
            model_state: the *updated* parameters (or nnx module), when ``track`` was given
                ``model_state``. The Weight rows of step k hold the weights that step k's
                forward pass used, so these become the Weight rows of the next step.
            optimizer_state: the optimizer state after this update (or ``nnx.Optimizer``), when
                ``track`` was given ``optimizer_state``. When it was not, a second positional
                argument is the gradients: ``step(params, grads)``, ``step(train_state, grads)``.
            gradients: this step's parameter gradients (same tree as the parameters), required
                when ``track`` was given ``model_state`` and ``track_gradients`` is on.

        Raises:
            ValueError: naming an argument that is missing, that ``track`` was not told about,
                or whose tree is not the one ``track`` saw (swapped arguments; a second
                positional argument taken as the gradients whose leaves name no parameter).
        """
        self._check_open("step")
        positional = False
        if (
            optimizer_state is not None
            and gradients is None
            and not self._has_optimizer
            and self._has_model
            and self._track_gradients
        ):
            # step(params, grads): no optimizer state was announced, so the second
            # positional argument can only be the gradients (checked as such below)
            optimizer_state, gradients, positional = None, optimizer_state, True
        self._check_step_args(model_state, optimizer_state, gradients)
        k = self.step_index
        parts = None if model_state is None else parts_of(model_state)
        params = None if parts is None else parts.params
        recorded = self._scheduled(k)
        if recorded:
            known = len(self._names_cache)  # trees named before were checked then
            segments: list[tuple[list[Leaf], list[Any], str]] = []
            grads = None if gradients is None else gradients_of(self._nnx_grads(gradients))
            if grads is not None:
                segments.append((*self._named(GRADIENT, grads), GRADIENT))
            opt_state = (
                parts.opt_state
                if parts is not None and parts.opt_state is not None
                else (None if optimizer_state is None else self._opt_of(optimizer_state))
            )
            if opt_state is not None:
                segments.append((*self._named(OPTIMISER_STATE, opt_state, params), OPTIMISER_STATE))
            self._trees.check_new(self._names_cache, known, params, opt_state, grads, positional)
            if parts is not None and parts.slow is not None:
                segments.append((*self._named("slow", parts.slow), OPTIMISER_STATE))
            if parts is not None and self._before is not None:
                segments.append((*self._updates(parts), WEIGHT))
            arrays = [a for _, seg, _ in segments for a in seg]
            summaries = self._summarize_batch(arrays)
            self._collect_mailboxes()
            if self._sink.callbacks_used:
                jax.effects_barrier()  # every tap callback of this step has run
            if self._next_weights is not None:  # keys now: module types may be known
                self._add_batch(*self._next_weights)
            self._add_batch([(leaves, tt) for leaves, _, tt in segments], arrays, *summaries)
        self._end_step(recorded)
        self._sink.callbacks_used = False
        self._intercepted = False
        if parts is not None:
            self._prepare_weights(parts, k + 1)
            self._keep_before(parts, k + 1)
        self._made = self._made_at = None  # (the next step's outputs are another call's)

    def _keep_before(self, parts: Parts, step: int) -> None:
        """With ``track_updates``, keep the parameters step ``step`` starts from (references:
        JAX arrays are immutable, so this holds no copy unless a later update donates them)."""
        self._before = (
            self._named(WEIGHT, parts.params)
            if self._track_updates and self._scheduled(step)
            else None
        )

    def _updates(self, parts: Parts) -> tuple[list[Leaf], list[Any]]:
        """``<param>.update`` leaves (Weight rows) and their arrays: the parameters given now
        minus those kept by :meth:`_keep_before`."""
        (old_leaves, old), self._before = self._before, None  # type: ignore[misc]
        new_leaves, new = self._named(WEIGHT, parts.params)
        if [n.name for n in new_leaves] != [n.name for n in old_leaves]:
            raise ValueError(
                "tracker.step(): the parameters' structure changed since the last step; "
                "track_updates=True needs the same tree at every step"
            )
        gone = [
            n.name for n, a in zip(old_leaves, old) if getattr(a, "is_deleted", lambda: False)()
        ]
        if gone:
            raise ValueError(
                f"tracker.step(): track_updates=True needs the previous parameters, but the "
                f"update deleted them (buffer donation, e.g. jax.jit(update, "
                f"donate_argnums=...)): {gone[:3]}; do not donate the parameters, or track "
                f"without track_updates"
            )
        leaves = self._update_leaves.get(id(new_leaves))
        if leaves is None or leaves[0] is not new_leaves:
            named = [Leaf(n.index, n.name + ".update", n.param) for n in new_leaves]
            leaves = self._update_leaves[id(new_leaves)] = (new_leaves, named)
        return leaves[1], self._subtract(new, old)


def _picker(indices: list[int]) -> Callable[[list[Any]], list[Any]]:
    """A function that takes the items at ``indices`` of a list, in C (no Python loop)."""
    if len(indices) > 1:
        get = operator.itemgetter(*indices)
        return lambda items: list(get(items))
    return lambda items: [items[i] for i in indices]


@signature_of(JaxTracker)
def track(*args: Any, **options: Any) -> JaxTracker:
    """Track a JAX/Flax training run; use as a context manager around the training loop.

    Returns:
        A :class:`JaxTracker`: run each update through ``tracker.intercept(update, ...)`` and
        call ``tracker.step(...)`` after it. ``tracker.out_path`` is the log's path once the
        ``with`` block has started (or, without one, after the first use).

    Arguments:
        model_state: the parameters (linen variables dict / params pytree, an nnx module, or an
            ``nnx.State``); their leaves give Weight rows and name gradients and optimizer state.
            A ``flax.training.train_state.TrainState`` gives its ``params`` (Weight), its
            ``opt_state`` (Optimiser_State; then leave ``optimizer_state`` out) and, where it
            has one, its ``batch_stats`` (Weight rows ``batch_stats.<path>``).
            ``optax.LookaheadParams`` give the fast parameters as Weight rows and the slow
            ones as Optimiser_State rows ``<param>.slow``. Needed by ``track_updates``.
        optimizer_state: the optax state (or an ``nnx.Optimizer``); leaves that mirror a
            parameter give Optimiser_State rows ``<param>.<field>``.
        device_axis: the arrays given to ``track`` and ``step`` carry a leading per-device
            axis (``jax.pmap`` replicas); rows are of one replica, the logical array.
    """
    return JaxTracker(*args, **options)
