"""The behaviour both trackers share through ``tandv.track.common``: the options and their
checks (:class:`TrackOptions`), the lifecycle (when the log opens, what ``close`` returns,
errors while closing) and the step counter. Each test runs the same scenario with the
PyTorch and the JAX tracker."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import numpy as np
import pytest

from tandv import read_log
from tandv.stats.summary import summarize
from tandv.track.common import TrackerCore
from tandv.track.common import recorder as recorder_module
from tandv.track.common.options import ROOT_NAME, TrackKwargs, TrackOptions

FRAMEWORKS = ["torch", "jax"]


class Run:
    """One framework's tracker on a one-layer model: ``make(**options)`` builds a tracker,
    ``train(tracker, steps)`` runs tracked steps."""

    def __init__(self, framework: str) -> None:
        self.framework = framework
        if framework == "torch":
            torch = pytest.importorskip("torch")
            from tandv.track.torch import track

            torch.manual_seed(0)
            self.model = torch.nn.Linear(3, 2)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
            self.track = track
        else:
            jax = pytest.importorskip("jax")
            from tandv.track.jax import track

            self.params = {"w": jax.numpy.arange(6.0).reshape(2, 3) / 10}
            self.track = track

    def make(self, **options):
        if self.framework == "torch":
            return self.track(self.model, self.opt, **options)
        return self.track(self.params, track_gradients=False, **options)

    def train(self, tracker, steps: int) -> None:
        for _ in range(steps):
            if self.framework == "torch":
                import torch

                self.opt.zero_grad()
                self.model(torch.ones(4, 3)).square().sum().backward()
                self.opt.step()
                tracker.step()
            else:
                self.params = tracker.intercept(
                    lambda p: {"w": p["w"] * 0.5}, self.params
                )  # an update with no Flax module: Weight rows only
                tracker.step(self.params)


@pytest.fixture(params=FRAMEWORKS)
def run(request) -> Run:
    return Run(request.param)


def test_no_folder_and_no_message_before_the_log_opens(run, capfd):
    """Making a tracker creates nothing and prints nothing; the ``with`` block opens the log
    (creates the default folder, prints its path once)."""
    tracker = run.make()
    assert tracker.out_path is None and tracker.recorder is None
    assert not Path("tandv_logs").exists()
    assert "tandv_logs" not in capfd.readouterr().err
    with tracker:
        assert tracker.out_path is not None and tracker.out_path.is_dir()
        assert tracker.out_path.parent == Path("tandv_logs")
        run.train(tracker, 2)
    assert capfd.readouterr().err.count(str(tracker.out_path)) == 1
    assert sorted(set(read_log(tracker.out_path)[("metadata", "step")])) == [0, 1]


def test_close_returns_the_path_and_is_idempotent(run):
    with run.make(out="log", verbose=False) as tracker:
        run.train(tracker, 1)
    assert tracker.closed
    assert tracker.close() == tracker.out_path == Path("log")
    assert tracker.close() == Path("log")  # again: the same, nothing rewritten
    never = run.make(out="never", verbose=False)
    assert never.close() is None  # never started: no log
    assert not Path("never").exists()


def test_a_tracker_starts_once(run):
    tracker = run.make(out="log", verbose=False)
    with tracker:
        pass
    with pytest.raises(RuntimeError, match="already started"):
        tracker.__enter__()
    with pytest.raises(RuntimeError, match=r"tracker\.\w+\(\) called outside .* closed"):
        run.train(tracker, 1)


def test_step_index_counts_every_step(run):
    with run.make(out="log", verbose=False, every=2) as tracker:
        assert tracker.step_index == 0
        run.train(tracker, 3)
        assert tracker.step_index == 3
    assert sorted(set(read_log("log")[("metadata", "step")])) == [0, 2]


def test_jax_tracker_without_with_opens_at_its_first_use(capfd):
    """A JAX tracker used without ``with`` opens its log at the first ``intercept``/``step``
    (not when it is made) and is finished by ``close``, which returns the path."""
    run = Run("jax")
    tracker = run.make()
    assert not Path("tandv_logs").exists() and tracker.out_path is None
    run.train(tracker, 2)
    assert tracker.out_path is not None and tracker.out_path.parent == Path("tandv_logs")
    path = tracker.close()
    assert path == tracker.out_path
    assert capfd.readouterr().err.count(str(path)) == 1
    assert sorted(set(read_log(path)[("metadata", "step")])) == [0, 1]


def test_torch_tracker_without_with_refuses_to_step():
    """PyTorch's hooks must be in place before a step's forward pass: a step outside the
    ``with`` block is an error (nothing would have been observed), and opens nothing."""
    run = Run("torch")
    tracker = run.make(out="log")
    with pytest.raises(RuntimeError, match="outside the `with track"):
        run.train(tracker, 1)
    assert not Path("log").exists()


@pytest.fixture
def failing_close(monkeypatch):
    """``StepRecorder.close`` finishes the log, then fails (as a full disk would)."""
    close = recorder_module.StepRecorder.close

    def fail(self):
        close(self)
        raise OSError("disk full")

    monkeypatch.setattr(recorder_module.StepRecorder, "close", fail)


def test_exit_after_an_error_reports_a_failing_close_and_reraises_the_error(
    run, failing_close, capfd
):
    boom = ValueError("boom in the training loop")
    with pytest.raises(ValueError) as info:
        with run.make(out="log", verbose=False) as tracker:
            run.train(tracker, 1)
            raise boom
    assert info.value is boom
    err = capfd.readouterr().err
    assert "could not finish the log after an error" in err and "disk full" in err
    assert tracker.closed
    assert sorted(set(read_log("log")[("metadata", "step")])) == [0]  # step 0 was ended


def test_exit_without_an_error_raises_a_failing_close(run, failing_close):
    with pytest.raises(OSError, match="disk full"):
        with run.make(out="log", verbose=False) as tracker:
            run.train(tracker, 1)


BAD_OPTIONS = [
    ({"track_activations": "yes"}, TypeError, r"track\(track_activations='yes'\): expected True"),
    ({"track_updates": 1}, TypeError, r"track\(track_updates=1\): expected True or False"),
    ({"verbose": None}, TypeError, r"track\(verbose=None\)"),
    ({"every": 0}, ValueError, r"every=0: expected an int >= 1"),
    ({"schedule": 2.5}, TypeError, r"schedule=2.5"),
    ({"start": 3, "end": 1}, ValueError, r"end=1: expected None or an int >= start"),
    ({"include": "("}, ValueError, r"include: '\(' is not a valid regular expression"),
    ({"stats_merge": {"x": "median"}}, ValueError, r"stats_merge\['x'\]='median'"),
    ({"percentiles": (50, 101)}, ValueError, r"percentiles: 101 is not a percentage"),
    ({"number_format": "float7"}, ValueError, r"unknown number format 'float7'"),
    ({"out": 3}, TypeError, r"track\(out=3\): expected a path"),
    ({"out_format": "csv"}, ValueError, r"out_format='csv': expected one of"),
    ({"run_name": ""}, ValueError, r"track\(run_name=''\): expected a non-empty string"),
    ({"flush_every": 0}, ValueError, r"flush_every=0: expected an int >= 1"),
    ({"sinks": [42]}, TypeError, r"sinks: expected callables .* got int"),
    ({"distributed": "auto"}, ValueError, r"track\(distributed='auto'\): expected None"),
    ({"rank_logs": 1}, TypeError, r"track\(rank_logs=1\): expected True or False"),
    ({"dist_timeout": 0}, ValueError, r"track\(dist_timeout=0\): expected a number of seconds"),
    ({"evry": 2}, TypeError, r"track\(\): unknown option 'evry'"),
]


@pytest.mark.parametrize("options, error, message", BAD_OPTIONS)
def test_option_errors_name_the_argument(options, error, message):
    with pytest.raises(error, match=message):
        TrackOptions.of(options)


@pytest.mark.parametrize("options, error, message", BAD_OPTIONS)
def test_both_trackers_check_options_before_anything_is_created(run, options, error, message):
    with pytest.raises(error, match=message):
        run.make(**{"out": "log", **options})
    assert not Path("log").exists() and not Path("tandv_logs").exists()


def test_options_hold_what_they_mean():
    """The checks also work the options out: the schedule, the selection, the statistics."""
    opts = TrackOptions(
        every=3, start=3, end=10, include=["fc"], exclude="bias", stats_merge={"m": "max"}
    )
    assert [s for s in range(12) if opts.scheduled(s)] == [3, 6, 9]
    assert opts.selector("fc.weight") and not opts.selector("fc.bias")
    assert not opts.selector("head.weight")
    assert opts.merge_rules == {"m": "max"} and opts.stat_fns == ()
    assert TrackOptions(percentiles=(1, 99.9)).percentile_columns == (
        ("pct1", 1.0),
        ("pct99.9", 99.9),
    )
    assert TrackOptions(number_format=np.float16).format == "float16"
    assert TrackOptions().given()["every"] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.every = 2  # type: ignore[misc]


def _own_options() -> list[str]:
    return [f.name for f in dataclasses.fields(TrackOptions) if f.init]


def test_every_shared_option_is_documented_once_on_the_dataclass():
    doc = inspect.getdoc(TrackOptions)
    section = doc[doc.index("Options:") :]
    entries = re.findall(r"^ {4}([a-z_]+(?:, [a-z_]+)*):", section, re.M)
    named = [n for entry in entries for n in entry.split(", ")]
    assert sorted(named) == sorted(_own_options())


def test_the_typed_keywords_are_the_dataclass_options():
    """``TrackKwargs`` (what type checkers see in ``track(**options)``) names the same options
    with the same types as ``TrackOptions``."""
    kwargs = {
        name: getattr(t, "__forward_arg__", t)  # TypedDict wraps the text in a ForwardRef
        for name, t in TrackKwargs.__annotations__.items()
    }
    fields = {f.name: f.type for f in dataclasses.fields(TrackOptions) if f.init}
    assert kwargs == fields


@pytest.mark.parametrize("module", ["tandv.track.torch", "tandv.track.jax"])
def test_track_shows_the_shared_options_with_their_defaults(module):
    pytest.importorskip(module.rsplit(".", 1)[1])
    track = importlib.import_module(module).track
    params = inspect.signature(track).parameters
    for f in dataclasses.fields(TrackOptions):
        if f.init:
            assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
            assert params[f.name].default == f.default
    shared = TrackOptions.documentation()
    assert shared.startswith("Options:\n    track_activations: ")  # entries indented under it
    assert inspect.getdoc(track).endswith(shared.rstrip())


def test_both_frameworks_name_the_root_module_alike():
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    from tandv.track.jax import _intercept
    from tandv.track.torch import track

    assert _intercept.ROOT_NAME == ROOT_NAME == "root"
    assert inspect.signature(track).parameters["root_name"].default == ROOT_NAME


def test_distributed_true_outside_a_multi_process_run_is_refused(run):
    """``distributed=True`` asks for a run over several processes; in one process both
    trackers say how to start one, when the log would open, and write nothing."""
    tracker = run.make(out="log", distributed=True)
    with pytest.raises(
        RuntimeError, match=r"track\(distributed=True\).*(torchrun|jax\.distributed)"
    ):
        tracker.__enter__()
    assert not Path("log").exists()


def test_a_jax_tracker_wraps_nnx_calls_only_while_its_log_is_open(tmp_path):
    """nnx module classes are wrapped from the log's opening to its closing: a JAX tracker
    made but never started leaves every ``__call__`` as it was."""
    import jax
    from flax import nnx

    from tandv.track.jax import track as jax_track

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    original = nnx.Linear.__call__
    tracker = jax_track(
        nnx.state(model, nnx.Param), out=tmp_path / "log", verbose=False, track_gradients=False
    )
    assert nnx.Linear.__call__ is original  # made, not started
    with tracker:
        assert nnx.Linear.__call__ is not original
        tracker.intercept(lambda m, x: m(x), model, jax.numpy.ones((1, 2)))
        tracker.step(nnx.state(model, nnx.Param))
    assert nnx.Linear.__call__ is original
    never = jax_track(nnx.state(model, nnx.Param), out=tmp_path / "never", verbose=False)
    with jax_track(out=tmp_path / "other", verbose=False):
        never.close()  # closing a tracker that never started unwraps nothing of another's
        assert nnx.Linear.__call__ is not original
    assert nnx.Linear.__call__ is original


class FakeTransfer:
    """What :class:`FakeAdapter` sends for a step: copies of its summaries, "on their way"
    until the test lets them arrive."""

    def __init__(self, vectors: list[np.ndarray]) -> None:
        self.vectors = vectors
        self.landed = False


class FakeAdapter:
    """A framework adapter written here, against the :class:`Adapter` protocol alone: its
    "device" summaries are numpy vectors, its transfer copies them, and it notes each call
    the core makes."""

    framework = "fake"
    opens_lazily = False
    defers_rows = False  # rows built at commit, on this thread: the calls' order is seen
    in_flight_steps = 0

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.instant = False  # whether a step's transfer has arrived as soon as it is sent

    def run_options(self) -> dict:
        self.calls.append("run_options")
        return {"fake_option": 7}

    def rank_merger(self):
        self.calls.append("rank_merger")
        return None

    def start(self) -> None:
        self.calls.append("start")

    def stop(self) -> None:
        self.calls.append("stop")

    def send(self, pending):
        self.calls.append("send")
        sent = FakeTransfer([np.array(s, copy=True) for _, _, s in pending])
        sent.landed = self.instant
        return sent

    def arrived(self, transfer: FakeTransfer) -> bool:
        return transfer.landed

    def observed(self, pending):
        return pending

    def to_host(self, summaries, transfer: FakeTransfer):
        self.calls.append("to_host")
        assert len(summaries) == len(transfer.vectors)
        return transfer.vectors

    def scalar_capture(self):
        return None


class FakeTracker(TrackerCore):
    """A tracker of the fake framework: the core, the adapter, and a ``step`` that observes
    named numpy arrays (summarized by the numpy reference) and ends the step."""

    def step(self, **arrays: np.ndarray) -> None:
        recorder = self._check_open("step")
        recorded = self._scheduled(self.step_index)
        if recorded:
            for name, x in arrays.items():
                layout = self._layout(x.dtype)
                vector, made = summarize(x, layout.format, moments=layout.moments)
                assert made == layout
                recorder.add(self._key(name, "Activation", "Fake", x.dtype), layout, vector)
        self._end_step(recorded)


def test_a_fake_adapter_drives_the_core_from_open_to_close(tmp_path):
    """The core calls only the adapter's protocol: a minimal adapter written in the test
    runs open -> recorded and skipped steps -> close; a step lands when its transfer has
    arrived, else at the next step's end or at close; and the rows in the log hold the
    statistics of the arrays observed (against numpy), at their steps."""
    adapter = FakeAdapter()
    rng = np.random.default_rng(3)
    data = [rng.normal(s, 1.0 + s, size=(4, 5)).astype(np.float32) for s in range(5)]
    options = TrackOptions(out=tmp_path / "log", every=2, verbose=False)
    tracker = FakeTracker(options, "Fake", "fake", adapter)
    assert adapter.calls == []  # made: nothing started, no log
    with tracker:
        assert adapter.calls == ["rank_merger", "run_options", "start"]
        tracker.step(h=data[0])  # recorded and sent, not arrived: it stays in flight
        assert adapter.calls[-1] == "send"
        tracker.step(h=data[1])  # not scheduled (every=2): dropped; step 0 lands now
        assert adapter.calls[-2:] == ["send", "to_host"]
        adapter.instant = True
        tracker.step(h=data[2])  # arrived at once: lands at its own step's end
        assert adapter.calls[-2:] == ["send", "to_host"] and adapter.calls.count("to_host") == 2
        adapter.instant = False
        tracker.step(h=data[3])
        tracker.step(h=data[4])  # in flight until close
        assert adapter.calls.count("to_host") == 2
    assert adapter.calls[-3:] == ["send", "stop", "to_host"]
    assert adapter.calls.count("start") == adapter.calls.count("stop") == 1
    df = read_log(tmp_path / "log")
    assert sorted(df[("metadata", "step")]) == [0, 2, 4]
    assert set(df[("metadata", "name")]) == {"h"}
    assert set(df[("metadata", "type")]) == {"Fake"}
    assert set(df[("metadata", "tensor_type")]) == {"Activation"}
    record = df.attrs["tandv"]
    assert record["framework"] == "fake" and record["options"]["fake_option"] == 7
    for _, row in df.iterrows():
        x = data[int(row[("metadata", "step")])].astype(np.float64)
        stats = row["scalar_stats"]
        np.testing.assert_allclose(stats["mean"], x.mean(), rtol=1e-6)
        np.testing.assert_allclose(stats["std"], x.std(), rtol=1e-5)
        assert stats["max"] == x.max() and stats["min"] == x.min()


def test_the_core_reads_its_adapter_through_the_protocol_alone():
    """``core.py`` reads of its adapter only what the ``Adapter`` protocol declares, and calls
    no method of its own object that it does not define itself (no hook for a subclass to
    override: a framework's part goes through the adapter). Read from the source, so a new
    call of an undeclared member fails here before any framework runs it."""
    import ast

    from tandv.track.common import Adapter, TrackerCore, core

    declared = {name for name in vars(Adapter) if not name.startswith("_")}
    assert {"start", "stop", "send", "arrived", "to_host", "observed"} <= declared
    own = {name for klass in TrackerCore.__mro__ for name in vars(klass)}
    read, called = set(), set()
    for node in ast.walk(ast.parse(inspect.getsource(core))):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id == "adapter":
            read.add(node.attr)
        elif isinstance(value, ast.Attribute) and value.attr == "_adapter":
            read.add(node.attr)
    for node in ast.walk(ast.parse(inspect.getsource(core))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"
        ):
            called.add(node.func.attr)
    assert read and read <= declared, f"undeclared adapter members read: {read - declared}"
    assert called <= own, f"methods the core calls but does not define: {called - own}"
