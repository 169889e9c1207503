"""The recorder's per-step path: rows built as plain columns and written straight to
Arrow, the fused path's finishing of rows, and the per-run caches of the PyTorch tracker's
step (what ``benchmarks/host_cost.py`` times). Each is checked against the slower, general
path it replaces."""

from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from pandas.testing import assert_frame_equal
from torch import nn

os.environ.setdefault("TRITON_INTERPRET", "1")

from tandv.schema import SchemaError, read_parquet, validate  # noqa: E402
from tandv.schema.writer import PartWriter, Rows  # noqa: E402
from tandv.stats.summary import summarize  # noqa: E402
from tandv.track.common.rows import Scratch, TensorKey, build_rows, row_columns  # noqa: E402
from tandv.track.torch import _fused, _workspace, track  # noqa: E402
from tandv.track.torch import summary as kernel  # noqa: E402


def entries(seed: int, names: list[str]) -> list[tuple[TensorKey, object, np.ndarray]]:
    """Summaries of random tensors: float32 and bfloat16 formats (exponent columns that
    differ), one with a custom statistic (a layout of its own), zeros and a NaN."""
    rng = np.random.default_rng(seed)
    out = []
    for i, name in enumerate(names):
        x = (rng.standard_normal(64) * 10.0 ** rng.integers(-6, 6)).astype(np.float32)
        x[:3] = 0.0
        if i == 1:
            x[5] = np.nan
        fmt = "bfloat16" if i % 3 == 2 else "float32"
        extras = {"peak": (float(i), "max")} if i == 4 else None
        v, layout = summarize(x, fmt, extras)
        kind = "Weight" if i % 2 else "Activation"
        out.append((TensorKey(name, kind, "Linear", fmt), layout, v))
    return out


def batch() -> tuple[np.ndarray, list]:
    names = [f"layer{i}" for i in range(6)]
    steps, rows = [], []
    for step in (0, 3, 4):
        got = entries(step, names)
        steps += [step] * len(got)
        rows += got
    return np.array(steps, dtype=np.int64), rows


def test_rows_go_to_parquet_as_their_dataframe_would(tmp_path):
    """A part written from the columns holds the same columns, types, values and footer
    metadata as the part written from the same rows' DataFrame; it reads back as it."""
    steps, got = batch()
    rows = row_columns(steps, got)
    frame = build_rows(steps, got)
    assert frame.equals(rows.frame())
    run = {"framework": "torch", "options": {"every": 1}}
    tables = []
    for name, what in (("direct", rows), ("frame", frame)):
        w = PartWriter(tmp_path / name)
        w.run = run
        w.write(what)
        w.close()
        tables.append(pq.read_table(tmp_path / name / "part-000000.parquet"))
    direct, reference = tables
    assert direct.schema.equals(reference.schema, check_metadata=True)
    assert direct.column_names == reference.column_names
    for name in direct.column_names:  # (NaN statistics: compared as equal)
        a, b = direct[name].to_numpy(), reference[name].to_numpy()
        assert a.dtype == b.dtype, name
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), name
    # exponent columns zero in every row are left out, the -inf/+inf counts kept
    stored = [c for c in direct.column_names if c.startswith("exponent_counts.")]
    assert "exponent_counts.-inf" in stored and "exponent_counts.+inf" in stored
    assert len(stored) < len(rows.labels)
    back = read_parquet(tmp_path / "direct")
    assert np.array_equal(back[("metadata", "step")].to_numpy(), steps)
    assert np.array_equal(
        back[("scalar_stats", "numel")].to_numpy(), frame[("scalar_stats", "numel")].to_numpy()
    )


def test_rows_built_in_a_kept_scratch_are_the_rows_of_fresh_arrays():
    """The writer thread stacks each batch's summaries, and rounds a one-layout batch's
    counts, in memory it keeps: the rows built there equal those built in fresh arrays;
    their statistics are arrays of their own (the next batch leaves them as they were),
    their counts are the scratch's (reused by the next batch, after the writer has written
    the rows)."""
    steps, got = batch()
    later = entries(11, [f"layer{i}" for i in range(len(got))])
    scratch = Scratch()
    first = row_columns(steps, got, scratch)
    first_frame = first.frame()
    stats = {k: v.copy() for k, v in first.stats.items()}
    second = row_columns(steps, later, scratch)
    assert_frame_equal(first_frame, build_rows(steps, got))
    assert_frame_equal(second.frame(), build_rows(steps, later))
    assert not first_frame.equals(second.frame())
    for k, v in first.stats.items():
        np.testing.assert_array_equal(v, stats[k])
    # one layout: its counts were rounded into the scratch, and are again
    one = [e for e in got if e[1] is got[0][1]]
    a = row_columns(np.arange(len(one)), one, scratch)
    b = row_columns(np.arange(len(one)), one, scratch)
    assert np.shares_memory(a.counts, b.counts)
    np.testing.assert_array_equal(b.counts, row_columns(np.arange(len(one)), one).counts)


def test_step_period_finds_blocks_of_one_step_with_the_same_values():
    from tandv.schema.writer import step_period

    names = ["a", "b", "c"]
    steps = np.repeat(np.array([4, 5, 7], np.int64), 3)
    assert step_period(steps, names * 3, ["x"] * 9) == 3
    assert step_period(steps[:3], names) == 3  # one step: one block
    assert step_period(steps, names * 2 + ["a", "c", "b"]) == 0  # another order
    assert step_period(steps, tuple(names * 3)) == 0  # not a list: not read
    assert step_period(np.array([4, 4, 5, 5, 5, 7], np.int64), names * 2) == 0  # sizes
    assert step_period(np.array([4, 5, 5, 4, 5, 5], np.int64), ["a", "b"] * 3) == 0
    assert step_period(np.zeros(0, np.int64), []) == 0


def test_rows_in_blocks_of_one_step_are_checked_and_written_as_any_rows(tmp_path):
    """Rows of steps that logged the same tensors (the writer's common batch) build and
    check each block's strings once; the part holds what the general path writes, and
    conforms() still says no to what validate rejects inside that shape."""
    steps, got = batch()  # three steps, the same six tensors in the same order
    rows = row_columns(steps, got)
    assert rows._period == 6 and rows.conforms()
    general = Rows(**{**_fields(rows), "names": tuple(rows.names)})  # (not a list: no period)
    assert general._period == 0
    assert rows.table().schema.equals(general.table().schema)
    assert_frame_equal(rows.table().to_pandas(), general.table().to_pandas())
    cases = {
        # a step's block logged twice: a repeated (name, tensor_type, step)
        "repeated step": {"steps": np.repeat(np.array([0, 3, 0], np.int64), 6)},
        # a tensor twice within each block
        "repeated row": {"names": ["layer0", "layer1", "layer0", *rows.names[3:6]] * 3},
        # an unknown dtype in one block only: no period, the full check
        "one block's dtype": {"dtypes": [*rows.dtypes[:12], "float33", *rows.dtypes[13:]]},
    }
    for what, change in cases.items():
        broken = Rows(**{**_fields(rows), **change})
        assert not broken.conforms(), what
        with pytest.raises(SchemaError):
            validate(broken.frame())


def _fields(rows: Rows) -> dict[str, Any]:
    return {f: getattr(rows, f) for f in Rows.__dataclass_fields__}


def test_finalize_many_rounds_counts_into_the_array_given():
    from tandv.stats.summary import finalize_many

    v, layout = summarize(np.array([1.0, -3.0, 0.25, 1e-30], np.float32))
    rows = np.stack([v, v])
    out = np.full((2, layout.num_counts), -1, np.int64)
    st, counts = finalize_many(rows, layout, counts_out=out)
    assert counts is out
    np.testing.assert_array_equal(out, finalize_many(rows, layout)[1])
    with pytest.raises(ValueError, match=r"counts_out.*int64 array of shape \(2, "):
        finalize_many(rows, layout, counts_out=np.zeros((2, 3), np.int64))


def test_parts_encode_the_metadata_by_dictionary_and_the_numbers_plainly(tmp_path):
    """A part's metadata columns (names, types, steps: repeated from row to row) are
    dictionary-encoded; its statistics and counts are not (building dictionaries of values
    that seldom repeat cost most of a write); the part reads back as the rows."""
    steps, got = batch()
    rows = row_columns(steps, got)
    w = PartWriter(tmp_path / "log")
    w.write(rows)
    (part,) = (tmp_path / "log").glob("*.parquet")
    meta = pq.ParquetFile(part).metadata
    group = meta.row_group(0)
    for i in range(meta.num_columns):
        column = group.column(i)
        dictionary = any("DICTIONARY" in e for e in column.encodings)
        assert dictionary == column.path_in_schema.startswith("metadata."), column
    back = read_parquet(tmp_path / "log")
    assert back[("metadata", "name")].tolist() == list(rows.names)
    np.testing.assert_array_equal(back[("scalar_stats", "mean")], rows.stats["mean"])


def test_rows_that_break_the_schema_get_validates_error(tmp_path):
    """Rows the fast check cannot vouch for are checked as a DataFrame: a repeated
    (name, tensor_type, step) is refused with the error validate gives."""
    got = entries(0, ["a", "b"])
    twice = got + [got[0]]
    rows = row_columns(7, twice)
    assert not rows.conforms()
    with pytest.raises(SchemaError) as expected:
        validate(rows.frame())
    w = PartWriter(tmp_path / "log")
    with pytest.raises(SchemaError) as err:
        w.write(rows)
    assert str(err.value) == str(expected.value)
    assert not list((tmp_path / "log").glob("*.parquet"))
    assert row_columns(7, got).conforms()


@pytest.mark.parametrize("bad", ["negative count", "unknown dtype", "non-str name"])
def test_conforms_says_no_to_what_validate_rejects(bad):
    rows = row_columns(1, entries(1, ["a", "b", "c"]))
    fields = {f: getattr(rows, f) for f in Rows.__dataclass_fields__}
    if bad == "negative count":
        counts = rows.counts.copy()
        counts[1, 0] = -1
        fields["counts"] = counts
    elif bad == "unknown dtype":
        fields["dtypes"] = ["float32", "float33", "float32"]
    else:
        fields["names"] = ["a", 2, "c"]
    broken = Rows(**fields)
    assert not broken.conforms()
    with pytest.raises(SchemaError):
        validate(broken.frame())


def test_tensor_key_hash_survives_pickling():
    """The key's hash is kept on it; a pickled key (another process: another string hash)
    finds it afresh, so it still finds its equal in a dict."""
    key = TensorKey("blocks.0.mlp", "Gradient", "Linear", "float32")
    back = pickle.loads(pickle.dumps(key))
    assert back == key and {key: 1}[back] == 1
    assert "_hash" not in repr(key)


@pytest.mark.parametrize(
    "dtype, fmt",
    [
        (torch.float32, "float32"),
        (torch.float32, "bfloat16"),
        (torch.float16, "float32"),
        (torch.bfloat16, "float8_e4m3fn"),
    ],
)
def test_finishing_rows_on_the_host_folds_as_the_device_does(dtype, fmt):
    """finish_rows folds the dtype's exponent counts into the format's bins by runs on the
    host; the torch path (used on the device) does it with the 0/1 matrix: the same
    summaries, exactly, counts included."""
    from tandv.stats.summary import Layout

    spec = _fused.spec_for(dtype)
    layout = Layout(fmt)
    rng = np.random.default_rng(2)
    rows = np.zeros((5, _fused.row_size(spec, layout)))
    rows[:, : _fused.HEADER] = np.abs(rng.standard_normal((5, _fused.HEADER))) + 1.0
    rows[:, _fused.N_READ] = 1000.0
    rows[:, _fused.HEADER : _fused.HEADER + spec.nbd] = rng.integers(0, 9, (5, spec.nbd))
    host = _fused.finish_rows(rows, spec, layout)
    device = _fused.finish_rows(torch.from_numpy(rows), spec, layout, torch).numpy()
    assert np.array_equal(host[:, layout.exponent_counts], device[:, layout.exponent_counts])
    np.testing.assert_allclose(host, device, rtol=1e-12, equal_nan=True)


@pytest.mark.parametrize(
    "dtype, fmt, extras",
    [
        (torch.float32, "float32", ()),
        (torch.float32, "bfloat16", ()),
        (torch.float16, "float32", (("peak", "max"), ("scale", "mean"))),
        (torch.bfloat16, "float8_e4m3fn", ()),
        (torch.float64, "float64", ()),
    ],
)
def test_compiled_finishing_gives_numpys_summaries_bit_for_bit(dtype, fmt, extras):
    """The writer thread finishes a step's rows in one compiled call, reading each where it
    lies in the step's buffer; numpy's ``finish_rows`` of the same rows gathered is the
    reference: the same values, every bit, in rows that exercise each branch (no element,
    only NaN and inf, non-finite values read as zeros and no zero, a zero maximum, counts
    above the format's top exponent, 2**E at float64's end)."""
    from tandv.stats.summary import Layout
    from tandv.track.torch import _finish

    spec = _fused.spec_for(dtype)
    layout = Layout(fmt, extras=extras)
    assert _finish.takes(layout)
    size = _fused.row_size(spec, layout)
    rng = np.random.default_rng(5)
    n = 12
    rows = rng.standard_normal((n, size)) * 10.0 ** rng.integers(-5, 5, (n, 1))
    counts = [_fused.N_READ, _fused.NAN, _fused.INF, _fused.ZERO, _fused.OVER]
    rows[:, counts] = rng.integers(0, 4, (n, len(counts)))
    rows[:, _fused.N_READ] += 50.0
    rows[:, _fused.MAX_ABS] = np.abs(rows[:, _fused.MAX_ABS])
    rows[5, _fused.MAX_ABS] = 1.7e308 if dtype == torch.float64 else 3.0e38
    # the kernel's scale: 2**E about the largest magnitude
    rows[:, _fused.SCALE_EXP] = np.ceil(np.log2(rows[:, _fused.MAX_ABS]))
    rows[:, _fused.HEADER : _fused.HEADER + spec.nbd] = rng.integers(0, 9, (n, spec.nbd))
    rows[0, counts] = 0.0  # no element
    rows[1, _fused.N_READ] = rows[1, _fused.NAN] + rows[1, _fused.INF]  # only NaN and inf
    rows[2, [_fused.NAN, _fused.ZERO, _fused.MIN]] = (2.0, 0.0, 0.5)  # patched minimum
    rows[3, [_fused.INF, _fused.ZERO, _fused.MAX]] = (1.0, 0.0, -0.25)  # patched maximum
    rows[4, [_fused.MAX_ABS, _fused.SCALE_EXP]] = 0.0
    # the rows where a step's buffer holds them: out of order, with gaps
    offsets = (rng.permutation(n) * (size + 7) + 3).astype(np.int64)
    values = rng.standard_normal(int(offsets.max()) + size + 5)
    for r, o in enumerate(offsets):
        values[o : o + size] = rows[r]
    got = _finish.finish_at(values, offsets, spec, layout)
    want = _fused.finish_rows(rows, spec, layout)
    assert got.shape == want.shape == (n, layout.size)
    np.testing.assert_array_equal(got.view(np.int64), want.view(np.int64))


def test_compiled_finishing_leaves_block_formats_and_higher_moments_to_numpy():
    from tandv.stats.blocks import block_extras
    from tandv.stats.summary import Layout
    from tandv.track.torch import _finish

    assert not _finish.takes(Layout("float32", moments=4))
    assert not _finish.takes(Layout("float32", extras=block_extras(["mxfp8_e4m3"])))


@pytest.fixture
def fused_path():
    with kernel.cpu_path("fused"):
        yield


def test_plain_batches_summarize_as_the_general_path(fused_path, monkeypatch, tmp_path):
    """The cached row keys and layouts of a step's parameters give the summaries the
    general loop gives, and the same slots come back when the rows are the same."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with track(net, verbose=False, out=tmp_path / "log") as tr:
        items = [(name, "Weight", net, p) for name, p in net.named_parameters()]
        fast = tr._summaries(items)
        fast_host = _workspace.to_host([s for *_, s in fast], tr._workspace.end_step())
        again = tr._summaries(items)
        assert [s for *_, s in again] == [s for *_, s in fast]  # the same slot objects
        tr._workspace.end_step()
        monkeypatch.setattr(tr, "_summaries_plain", lambda items: None)
        slow = tr._summaries(items)
        slow_host = _workspace.to_host([s for *_, s in slow], tr._workspace.end_step())
    assert [(k, lay) for k, lay, _ in fast] == [(k, lay) for k, lay, _ in slow]
    for a, b in zip(fast_host, slow_host):
        assert np.array_equal(a, b, equal_nan=True)


def test_the_trackers_start_loads_the_finishing_its_writer_calls(fused_path, tmp_path):
    """A tracker on the fused path loads the compiled finishing of rows when it starts (its
    first load in a process holds the interpreter ~0.3 s: not mid-training in the writer),
    in the one specialization the writer then calls; the rows it finishes are numpy's."""
    from tandv.track.torch import _finish

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    calls: list[tuple[Any, ...]] = []
    finish = _finish._finish

    def spy(*args: Any) -> None:
        calls.append(args)
        finish(*args)

    try:
        with track(net, opt, verbose=False, out=tmp_path / "log") as tr:
            assert len(finish.signatures) == 1  # loaded at the start
            signatures = list(finish.signatures)
            _finish._finish = spy
            for _ in range(3):
                net(torch.randn(5, 8)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                tr.step()
    finally:
        _finish._finish = finish
    assert len(calls) == 3 and finish.signatures == signatures  # no other one compiled
    log = read_parquet(tmp_path / "log")
    assert len(log) == sum(len(args[1]) for args in calls)  # every row finished there


def test_a_parameter_moved_into_the_optimizer_is_captured_once(fused_path, tmp_path):
    """The parameters whose gradients are captured are found again when an optimizer's
    parameter groups change: a parameter added to the optimizer after the first step is
    captured by the optimizer's hook, not also at tracker.step() (twice: a gradient row
    counting every value twice)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    opt = torch.optim.SGD(net[0].parameters(), lr=0.1)
    with track(net, opt, out=tmp_path / "log", verbose=False) as tr:
        for step in range(3):
            if step == 1:
                opt.add_param_group({"params": list(net[1].parameters())})
            net(torch.randn(3, 4)).square().sum().backward()
            opt.step()
            tr.step()
            opt.zero_grad()
            net.zero_grad()
    df = read_parquet(tmp_path / "log")
    rows = df[
        (df[("metadata", "tensor_type")] == "Gradient") & (df[("metadata", "name")] == "1.weight")
    ]
    assert rows[("metadata", "step")].tolist() == [0, 1, 2]
    assert rows[("scalar_stats", "numel")].tolist() == [12, 12, 12]


def test_to_host_finishes_each_slot_as_its_own_row_would():
    """A step's summaries of several row kinds (two dtypes, two layouts, a raw vector of the
    torch-op path, a host vector in between), at offsets out of order and one row read
    twice, come back in order, each as finishing its own row alone gives it."""
    from tandv.stats.summary import Layout

    device = torch.device("cpu")
    rng = np.random.default_rng(5)
    kinds = []
    for dtype, fmt in ((torch.float32, "float32"), (torch.bfloat16, "float8_e4m3fn")):
        spec = _fused.spec_for(dtype)
        layout = Layout(fmt)
        kinds.append(_workspace.RowKind(device, _fused.row_size(spec, layout), layout, spec))
    raw_layout = Layout("float32")
    raw_size = kernel.raw_device(torch.ones(4), raw_layout).numel()
    kinds.append(_workspace.RowKind(device, raw_size, raw_layout, None))
    # rows laid out one after another, then observed in another order
    values = np.zeros(sum(k.size for k in kinds) * 3)
    placed, off = [], 0
    for i in range(7):
        kind = kinds[i % 3]
        row = values[off : off + kind.size]
        if kind.spec is None:  # a raw vector of random values
            row[:] = kernel.raw_device(torch.from_numpy(rng.standard_normal(20)), raw_layout)
        else:  # a fused row: positive partial results, exponent counts
            row[:] = rng.integers(1, 50, kind.size)
            row[_fused.N_READ] = 10_000.0
            row[_fused.OVER] = row[_fused.INF] = 0.0
        placed.append(tuple.__new__(_workspace.Slot, (off, kind)))
        off += kind.size
    slots = [placed[i] for i in (4, 0, 2, 0, 5, 1, 6, 3)]  # placed[0] twice
    vector = rng.standard_normal(9)
    summaries = [*slots[:3], vector, *slots[3:]]
    flight = _workspace.Flight([(device, torch.from_numpy(values.copy()), off, None)])
    got = _workspace.to_host(summaries, flight)
    assert len(got) == len(summaries) and got[3] is vector
    for s, v in zip(slots, got[:3] + got[4:]):
        row = values[s.offset : s.offset + s.size][None]
        if s.spec is None:
            want = kernel.finish_raw(row, np)[0]
        else:
            want = _fused.finish_rows(row, s.spec, s.layout)[0]
        assert v.shape == want.shape
        assert np.array_equal(v, want, equal_nan=True)
