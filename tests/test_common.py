"""Tracker core: schedules, selection, the step recorder and its streaming writers."""

import os
import re
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from tandv.schema import read_parquet, read_pickle
from tandv.stats import finalize, summarize
from tandv.track.common import Selector, StepRecorder, TensorKey, linear, make_schedule
from tandv.track.common.custom import parse_custom_stats

# ------------------------------------------------------------------ schedules


def steps(schedule, n=30):
    return [s for s in range(n) if schedule(s)]


def test_linear_0_fires_every_step_from_its_offset_for_trackers_and_taiyi():
    """One parser reads ``"linear(interval, offset)"`` for both (issue 31): interval 0, the
    form of Taiyi's documented default ``"linear(0, 0)"``, is every step from the offset on
    (the trackers' parser used to reject it while Taiyi's accepted it)."""
    from tandv.taiyi import parse_schedule

    assert steps(make_schedule(schedule="linear(0, 3)"), 8) == [3, 4, 5, 6, 7]
    assert steps(parse_schedule("linear(0, 3)"), 8) == [3, 4, 5, 6, 7]
    assert steps(make_schedule(schedule="linear(0, 0)"), 8) == list(range(8))
    with pytest.raises(ValueError, match="interval must be an int >= 1"):
        linear(0, 1)  # the function keeps asking for an interval, as documented


def test_every_and_linear_and_ranges():
    assert steps(make_schedule()) == list(range(30))
    assert steps(make_schedule(every=10)) == [0, 10, 20]
    assert steps(make_schedule(schedule="linear(5, 2)")) == [2, 7, 12, 17, 22, 27]
    assert steps(make_schedule(schedule="linear(4)")) == [0, 4, 8, 12, 16, 20, 24, 28]
    assert steps(make_schedule(every=3, start=5, end=15)) == [6, 9, 12]
    assert steps(make_schedule(schedule=lambda s: s in (1, 29))) == [1, 29]
    assert steps(make_schedule(schedule=[3, 4, 100])) == [3, 4]
    assert steps(linear(7, 1)) == [1, 8, 15, 22, 29]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"every": 0}, "every=0: expected an int >= 1"),
        ({"schedule": "cosine(3)"}, "expected 'linear(interval, offset)'"),
        ({"schedule": "linear(-1, 1)"}, "expected 'linear(interval, offset)'"),
        ({"start": -1}, "start=-1"),
        ({"start": 5, "end": 2}, "end=2: expected None or an int >= start"),
        ({"schedule": 3.5}, "expected a callable"),
    ],
)
def test_schedule_errors_name_the_argument(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        make_schedule(**kwargs)


# ------------------------------------------------------------------ selection


class Linear:  # stand-ins for module classes
    pass


class LoRALinear(Linear):
    pass


def test_selector_regex_class_and_class_name():
    mro = LoRALinear.__mro__
    assert Selector.build()("anything")
    assert Selector.build(include="attn")("layers.0.attn.wq")
    assert not Selector.build(include="attn")("layers.0.mlp")
    assert Selector.build(include=Linear)("x", mro)  # isinstance semantics
    assert Selector.build(include="Linear")("x", mro)  # class name of a base
    assert not Selector.build(include="Linear")("x", (object,))
    assert not Selector.build(include=r"layers\.\d", exclude=["bias$"])("layers.1.bias")
    assert Selector.build(include=[re.compile("^emb"), "head"])("embed.weight")


def test_selector_bad_arguments():
    with pytest.raises(ValueError, match=r"include: '\(' is not a valid regular expression"):
        Selector.build(include="(")
    with pytest.raises(TypeError, match="exclude: expected regex strings"):
        Selector.build(exclude=[3])


# ------------------------------------------------------------------ recorder


def key(name, tt="Activation", dtype="float32"):
    return TensorKey(name, tt, "Linear", dtype)


def test_recorder_merges_observations_of_one_step(tmp_path):
    rng = np.random.default_rng(0)
    micro = [rng.standard_normal(50).astype(np.float32) for _ in range(3)]
    rec = StepRecorder(tmp_path / "log", verbose=False)
    for m in micro:  # e.g. three micro-batches through one module
        v, layout = summarize(m)
        rec.add(key("fc"), layout, v)
    transfers = []
    rec.commit(0, rec.take(), lambda xs: transfers.append(len(xs)) or xs)
    rec.close()
    assert transfers == [3]  # one host transfer for the step
    df = read_parquet(tmp_path / "log")
    assert len(df) == 1
    whole = np.concatenate(micro)
    ref, layout = summarize(whole)
    s, c = finalize(ref, layout)
    for k, v in s.items():
        assert df[("scalar_stats", k)].iloc[0] == pytest.approx(v, rel=1e-12)


def test_recorder_streams_parts_and_pickle_once(tmp_path):
    x = np.arange(1, 9, dtype=np.float32)
    v, layout = summarize(x)
    rec = StepRecorder(tmp_path / "log", verbose=False, flush_every=2)
    for step in range(5):
        rec.add(key("a"), layout, v)
        rec.commit(step, rec.take(), lambda xs: xs)
        # parts appear while the run goes, written by the writer thread: after steps 1 and 3
        deadline = time.monotonic() + 10
        while len(list((tmp_path / "log").glob("*.parquet"))) < (step + 1) // 2 < 3:
            assert time.monotonic() < deadline, f"no part file after step {step}"
            time.sleep(0.01)
        assert len(list((tmp_path / "log").glob("*.parquet"))) == (step + 1) // 2
    rec.close()
    assert len(list((tmp_path / "log").glob("*.parquet"))) == 3
    assert list(read_parquet(tmp_path / "log")[("metadata", "step")]) == [0, 1, 2, 3, 4]

    rec = StepRecorder(tmp_path / "log.pkl", "pickle", verbose=False)
    rec.add(key("a"), layout, v)
    rec.commit(0, rec.take(), lambda xs: xs)
    assert not (tmp_path / "log.pkl").exists()
    rec.close()
    assert list(read_pickle(tmp_path / "log.pkl")[("metadata", "name")]) == ["a"]


def test_recorder_write_failure_reaches_the_training_thread(tmp_path):
    """A part the writer thread cannot write fails the next step (and close) with the
    cause attached; the parts written before stay readable."""
    v, layout = summarize(np.arange(1, 9, dtype=np.float32))
    rec = StepRecorder(tmp_path / "log", verbose=False)
    rec.add(key("a"), layout, v)
    rec.commit(0, rec.take(), lambda xs: xs)
    rec.flush()
    real = rec.writer.write

    def full_disk(df, **kw):
        raise OSError(28, "No space left on device")

    rec.writer.write = full_disk
    rec.add(key("a"), layout, v)
    rec.commit(1, rec.take(), lambda xs: xs)
    with pytest.raises(RuntimeError, match="writing the log to .* failed") as err:
        rec.flush()
    assert isinstance(err.value.__cause__, OSError)
    with pytest.raises(RuntimeError):
        rec.close()
    rec.writer.write = real
    assert list(read_parquet(tmp_path / "log")[("metadata", "step")]) == [0]


def test_recorder_empty_run_writes_valid_empty_log(tmp_path):
    for fmt, path in (("parquet", tmp_path / "e"), ("pickle", tmp_path / "e.pkl")):
        rec = StepRecorder(path, fmt, verbose=False)
        rec.close()
        df = read_parquet(path) if fmt == "parquet" else read_pickle(path)
        assert len(df) == 0 and ("scalar_stats", "rm2") in df.columns


def test_recorder_default_path_printed_once(tmp_path, capsys):
    rec = StepRecorder(None, run_name="GPT")
    rec.close()
    err = capsys.readouterr().err
    assert err.count("tandv: logging to") == 1
    assert rec.path.parent.name == "tandv_logs" and rec.path.name.startswith("GPT-")
    assert rec.path.is_dir()


def test_recorder_refuses_to_overwrite_and_bad_format(tmp_path):
    rec = StepRecorder(tmp_path / "log", verbose=False)
    rec.close()
    with pytest.raises(FileExistsError, match="already holds a log"):
        StepRecorder(tmp_path / "log", verbose=False)
    with pytest.raises(ValueError, match="out_format='csv'"):
        StepRecorder(tmp_path / "x", "csv", verbose=False)


def test_rows_mix_formats_with_zero_fill(tmp_path):
    a = np.array([1.0, 2.0**-140], np.float32)  # float32 subnormal
    b = np.array([1.0, 2.0**-130], "bfloat16")
    rec = StepRecorder(tmp_path / "log", verbose=False)
    for name, x in (("a", a), ("b", b)):
        v, layout = summarize(x)
        rec.add(key(name, dtype=str(x.dtype)), layout, v)
    rec.commit(0, rec.take(), lambda xs: xs)
    rec.close()
    df = read_parquet(tmp_path / "log").set_index(("metadata", "name"))
    assert (
        df.loc["a", ("exponent_counts", -140)] == 1 and df.loc["b", ("exponent_counts", -140)] == 0
    )
    assert (
        df.loc["b", ("exponent_counts", -130)] == 1 and df.loc["a", ("exponent_counts", -130)] == 0
    )
    assert list(df[("metadata", "dtype")]) == ["float32", "bfloat16"]


# ------------------------------------------------------------------ custom statistics


def test_custom_stats_forms_normalize_to_functions_and_rules():
    x = np.array([1.0, -3.0])
    fns, rules = parse_custom_stats(
        {"peak": (lambda a: np.abs(a).max(), "max"), "total": np.sum}, {"total": "sum"}
    )
    assert [f(x) for f in fns] == [{"peak": 3.0, "total": -2.0}]
    assert rules == {"peak": "max", "total": "sum"}
    fns, rules = parse_custom_stats([lambda a: {"a": 1}, lambda a: {"b": 2}])
    assert [f(x) for f in fns] == [{"a": 1}, {"b": 2}] and rules == {}
    assert parse_custom_stats(None) == ((), {})


@pytest.mark.parametrize(
    "stats, merge, message",
    [
        ({"q": (np.max, "median")}, None, "stats['q']: merge rule 'median'"),
        (None, {"q": "avg"}, "stats_merge['q']='avg'"),
        ({"q": 3}, None, "stats['q']: expected a function"),
        ([np.max, 3], None, "stats: expected functions"),
        ({"rm2": np.max}, {"rm2": "max"}, "clashes with a default statistic"),
    ],
)
def test_custom_stats_errors(stats, merge, message):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        parse_custom_stats(stats, merge)


def test_rows_of_one_tensor_in_two_dtypes_merge_into_the_widest_or_stay_apart():
    """The recorder merges a tensor's float16 and float32 summaries of one step into the
    float32 layout exactly; a summary it cannot re-bin exactly keeps a row named by dtype."""
    from tandv.stats.summary import merge_all, summarize
    from tandv.track.common.buffer import _KeyChecks, _merge_dtypes

    a = np.array([1.5, -2.0, 0.0, 6.0e-5, np.inf], dtype=np.float16)
    b = np.array([3.0e-30, -7.0, 1e30], dtype=np.float32)
    va, la = summarize(a)
    vb, lb = summarize(b)
    ka = TensorKey("fc", "Activation", "Linear", "float16")
    kb = TensorKey("fc", "Activation", "Linear", "float32")
    ((key, layout, v),) = _merge_dtypes([(ka, la, va), (kb, lb, vb)], _KeyChecks())
    assert key == kb and layout == lb
    want = merge_all([summarize(a.astype(np.float32), "float32")[0], vb], lb)
    np.testing.assert_array_equal(v, want)
    # a float16-format summary that counted an underflow cannot be re-binned exactly
    vc, lc = summarize(np.array([1e-9, 2.0], dtype=np.float32), "float16")
    kc = TensorKey("fc", "Activation", "Linear", "float16")
    got = _merge_dtypes([(kc, lc, vc), (kb, lb, vb)], _KeyChecks())
    assert sorted(k.name for k, _, _ in got) == ["fc", "fc@float16"]


def test_key_checks_answer_by_the_keys_not_by_the_last_answer():
    """The step buffer's checks of a step's keys remember the last list that passed: a
    later list equal to it passes without a set (equal keys of other objects too), and one
    that differs anywhere is checked again, so a repeated tensor after steps without one
    is still merged."""
    from tandv.stats.summary import merge_all, summarize
    from tandv.track.common.buffer import _KeyChecks, _merged

    checks = _KeyChecks()
    ka = TensorKey("fc", "Activation", "Linear", "float32")
    kb = TensorKey("out", "Activation", "Linear", "float32")
    assert checks.all_distinct([ka, kb]) and checks.one_dtype_each([ka, kb])
    again = [TensorKey("fc", "Activation", "Linear", "float32"), kb]  # equal, not identical
    assert checks.all_distinct(again) and checks.distinct is again
    assert not checks.all_distinct([ka, ka]) and checks.distinct is again
    assert not checks.one_dtype_each([ka, TensorKey("fc", "Activation", "Linear", "bfloat16")])
    # the merge itself: a step with a repeated key after a step without one
    x, y = np.array([1.0, -2.0], np.float32), np.array([4.0, 8.0, 0.5], np.float32)
    (vx, lay), (vy, _) = summarize(x), summarize(y)
    rows = np.stack([vx, vy])  # (a 2-D array of rows, as the fused path's to_host gives)
    first = _merged(0, [(ka, lay, 0), (kb, lay, 1)], lambda s: rows[s], checks)
    assert [k for k, _, _ in first] == [ka, kb]
    np.testing.assert_array_equal(first[1][2], vy)
    (merged,) = _merged(1, [(ka, lay, 0), (ka, lay, 1)], lambda s: rows[s], checks)
    np.testing.assert_array_equal(merged[2], merge_all([vx, vy], lay))
    np.testing.assert_allclose(merged[2], summarize(np.concatenate([x, y]))[0], rtol=1e-12)


# ----------------------------------------------------- log paths and forgotten steps (issue 15)


@pytest.mark.parametrize("fmt, name", [("pickle", "log.pkl"), ("parquet", "log")])
def test_log_path_problems_fail_when_tracking_starts(tmp_path, fmt, name):
    (tmp_path / "afile").write_text("not a directory")
    with pytest.raises(
        NotADirectoryError, match=rf"cannot write the log .*afile/{name}.*afile' is a file"
    ):
        StepRecorder(tmp_path / "afile" / name, fmt, verbose=False)
    with pytest.raises(NotADirectoryError, match="is a file, not a directory"):
        StepRecorder(tmp_path / "afile" / "deeper" / name, fmt, verbose=False)
    if sys.platform.startswith("linux") and os.path.isdir("/sys"):
        # sysfs refuses new files even to root: a real unwritable directory
        with pytest.raises(
            PermissionError, match=rf"cannot write the log '/sys/{name}': cannot create files"
        ):
            StepRecorder(f"/sys/{name}", fmt, verbose=False)


def test_pickle_refuses_an_existing_file(tmp_path):
    precious = tmp_path / "notes.pkl"
    precious.write_text("my notes")
    with pytest.raises(FileExistsError, match=r"pickle log .*notes\.pkl' already exists"):
        StepRecorder(precious, "pickle", verbose=False)
    assert precious.read_text() == "my notes"


def test_pickle_write_failure_at_close_names_the_log(tmp_path, monkeypatch):
    v, layout = summarize(np.arange(1, 9, dtype=np.float32))
    rec = StepRecorder(tmp_path / "run.pkl", "pickle", verbose=False)
    rec.add(key("a"), layout, v)
    rec.commit(0, rec.take(), lambda xs: xs)

    def full_disk(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full_disk)
    with pytest.raises(
        RuntimeError, match=r"writing the log to '.*run\.pkl' failed: OSError: .*No space left"
    ):
        rec.close()
    assert not list(tmp_path.glob(".run.pkl.*"))  # no temporary file left behind


@pytest.mark.parametrize("fmt", ["pickle", "parquet"])
def test_default_paths_are_unique_per_recorder(tmp_path, fmt):
    """Recorders opened in the same second without `out` get different logs; the pickle's
    default path is reserved at start by its claim file, which its close removes."""
    from tandv.schema.writer import claim_file

    recs = [StepRecorder(None, fmt, run_name="same", verbose=False) for _ in range(3)]
    paths = [r.path for r in recs]
    assert len(set(paths)) == 3 and all(claim_file(p, fmt).exists() for p in paths)
    v, layout = summarize(np.arange(1, 9, dtype=np.float32))
    for i, r in enumerate(recs):
        r.add(key(f"t{i}"), layout, v)
        r.commit(0, r.take(), lambda xs: xs)
        r.close()
    read = read_pickle if fmt == "pickle" else read_parquet
    assert [list(read(p)[("metadata", "name")]) for p in paths] == [["t0"], ["t1"], ["t2"]]


def test_forgotten_step_warns_then_raises(tmp_path):
    v, layout = summarize(np.arange(1, 9, dtype=np.float32))
    per = 8 * layout.size
    rec = StepRecorder(
        tmp_path / "log", verbose=False, warn_pending_bytes=10 * per, max_pending_bytes=20 * per
    )
    for _ in range(10):
        rec.add(key("a"), layout, v)
    with pytest.warns(
        RuntimeWarning, match=r"11 tensor observations .* waiting .* is tracker\.step\(\) called"
    ):
        rec.add(key("a"), layout, v)
    for _ in range(9):
        rec.add(key("a"), layout, v)
    with pytest.raises(
        RuntimeError,
        match=r"21 tensor observations .*call tracker\.step\(\) once per training step",
    ):
        rec.add(key("a"), layout, v)
    rec.commit(0, rec.take(), lambda xs: xs)  # the step ends: the count starts again
    for _ in range(10):
        rec.add(key("a"), layout, v)
    rec.commit(1, rec.take(), lambda xs: xs)
    rec.close()
    assert list(read_parquet(tmp_path / "log")[("metadata", "step")]) == [0, 1]


def test_bounded_hook_rows_warn_at_their_exact_size(tmp_path):
    """Entries added with ``most`` (a tracker's hook rows) are counted at that bound only
    while it cannot reach the warning: past it the count is exact, so the warning comes at
    the same observation as when every entry is sized."""
    v, layout = summarize(np.arange(1, 9, dtype=np.float32))
    per = 8 * layout.size
    rec = StepRecorder(
        tmp_path / "log", verbose=False, warn_pending_bytes=10 * per, max_pending_bytes=20 * per
    )
    rec.add_many([(key("a"), layout, v)] * 2, 4 * per)  # counted as 8 summaries, 2 exact
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none while the exact count is at most 10
        for _ in range(8):
            rec.add(key("a"), layout, v)
    with pytest.warns(RuntimeWarning, match=r"11 tensor observations \(0 MiB"):
        rec.add(key("a"), layout, v)
    rec.commit(0, rec.take(), lambda xs: xs)
    # a bound that could pass the warning is not used: the entries are sized
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rec.add_many([(key("b"), layout, v)] * 9, 4 * per)
        rec.add(key("b"), layout, v)
    with pytest.raises(RuntimeError, match=r"21 tensor observations"):  # (warned once before)
        rec.add_many([(key("b"), layout, v)] * 11, 4 * per)
    rec.commit(1, rec.take(), lambda xs: xs)
    rec.close()
    assert len(read_parquet(tmp_path / "log")) == 2


def test_second_step_call_without_activations_warns(tmp_path):
    v, layout = summarize(np.arange(1, 9, dtype=np.float32))
    rec = StepRecorder(tmp_path / "log", verbose=False)
    rec.add(key("a", "Activation"), layout, v)
    rec.add(key("w", "Weight"), layout, v)
    rec.commit(0, rec.take(), lambda xs: xs)
    rec.add(key("w", "Weight"), layout, v)
    with pytest.warns(
        RuntimeWarning,
        match=r"step 1 observed no activation or gradient .* more than once per "
        r"training step",
    ):
        rec.commit(1, rec.take(), lambda xs: xs)
    rec.close()


def test_each_step_gets_exactly_its_own_observations_whatever_the_last_step_had(tmp_path):
    """The step buffer writes a step's observations into room the last step left: steps of
    3, then 5 (more than the room), then 2 (fewer) observations, a discarded step between,
    each get exactly theirs, in order, with their own values (the numpy reference)."""
    rng = np.random.default_rng(0)
    rec = StepRecorder(tmp_path / "log", verbose=False)
    want: dict[int, list[tuple[str, float]]] = {}
    plan = {0: 3, 1: 5, 2: 0, 3: 2}  # (step 2 is discarded after 4 observations)
    for step, n in plan.items():
        arrays = [rng.standard_normal(16).astype(np.float32) for _ in range(n or 4)]
        entries = []
        for i, a in enumerate(arrays):
            v, layout = summarize(a)
            entries.append((key(f"s{step}.{i}"), layout, v))
        rec.add(*entries[0])  # (one alone, the rest together)
        rec.add_many(entries[1:])
        assert [k.name for k, _, _ in rec.buffer.pending] == [
            f"s{step}.{i}" for i in range(len(entries))
        ]
        if n == 0:
            rec.discard()
            assert not rec.buffer.pending
            continue
        want[step] = [
            (f"s{step}.{i}", float(a.astype(np.float64).max())) for i, a in enumerate(arrays)
        ]
        rec.commit(step, rec.take(), lambda xs: xs)
    rec.close()
    df = read_parquet(tmp_path / "log")
    got: dict[int, list[tuple[str, float]]] = {}
    for name, step, mx in zip(
        df[("metadata", "name")], df[("metadata", "step")], df[("scalar_stats", "max")]
    ):
        got.setdefault(int(step), []).append((name, float(mx)))
    assert got == want


def test_a_step_with_module_rows_among_others_does_not_warn(tmp_path):
    """Module rows that do not open the sequence they were added in (a weight first) still
    count: no warning at step 1, which has them as step 0 did; step 2 has none and warns."""
    v, layout = summarize(np.arange(1, 9, dtype=np.float32))
    rec = StepRecorder(tmp_path / "log", verbose=False)
    mixed = [(key("w", "Weight"), layout, v), (key("a", "Activation"), layout, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in (0, 1):
            rec.add_many(mixed)
            rec.add(key("s", "Optimiser_State"), layout, v)
            rec.commit(step, rec.take(), lambda xs: xs)
    rec.add_many(mixed[:1])
    with pytest.warns(RuntimeWarning, match=r"step 2 observed no activation or gradient"):
        rec.commit(2, rec.take(), lambda xs: xs)
    rec.close()


def test_a_taken_step_is_its_observations_in_the_order_they_were_added(tmp_path):
    """``take()`` hands the step over as the sequences it was added in, unjoined: read as
    one sequence (length, iteration, indexing, slicing) it is every observation in the
    order of the adds, and the recorder starts the next step empty."""
    v, layout = summarize(np.arange(1, 9, dtype=np.float32))
    rec = StepRecorder(tmp_path / "log", verbose=False)
    want = [(key(f"t{i}", "Activation"), layout, v) for i in range(7)]
    rec.add_many(tuple(want[:3]))
    rec.add(*want[3])
    rec.add_many(want[4:])
    taken = rec.take()
    assert len(taken) == 7 and bool(taken)
    assert list(taken) == want and list(taken) == want  # (read twice: the same)
    assert [taken[i] for i in range(7)] == want and taken[-1] == want[-1]
    assert taken[2:5] == want[2:5]
    assert not rec.take()  # (nothing added since)
    rec.close()


@pytest.mark.parametrize("module", ["tandv.track.torch", "tandv.track.jax"])
def test_track_names_every_option_and_documents_each(module):
    import importlib
    import inspect

    track = importlib.import_module(module).track
    params = inspect.signature(track).parameters
    assert not [p for p in params.values() if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    assert len(params) > 15
    doc = inspect.getdoc(track)
    undocumented = [
        n for n in params if not re.search(rf"^ *([a-z_]+, )*{n}(, [a-z_]+)*:", doc, re.M)
    ]
    assert not undocumented, f"{module}.track's docstring does not describe {undocumented}"
