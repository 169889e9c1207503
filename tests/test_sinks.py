"""Live sinks in a run that others log to as well (issue 29): every row of the tandv log
reaches W&B and TensorBoard, read back from the W&B offline run file and the TensorBoard
event file, beside the loop's own metrics."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandv.schema import read_log
from tandv.track.torch import track

STEPS = 12


def _wandb_records(path: Path) -> list:
    """The records of a W&B run file, read with W&B's own record type: the file is a log of
    32 KiB blocks (a 7-byte file header ``:W&B`` + magic + version), each record in chunks
    with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # the rest of the block is padding
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            records.append(record)
            buf = b""
    return records


def _wandb_history(run_dir: Path) -> list[dict[str, str]]:
    """The history rows of a finished offline run, ``{key: value as JSON}``: read once W&B's
    service has written the run's exit record (it writes the file after ``finish()``
    returns)."""
    (path,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + 30
    while True:
        records = _wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, "W&B never finished writing the run file"
        time.sleep(0.1)
    return [
        {item.key or "/".join(item.nested_key): item.value_json for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]


def _loop(sinks, out, on_step):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    with track(net, opt, out=out, sinks=sinks, flush_every=5, verbose=False) as tr:
        for i in range(STEPS):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
            opt.zero_grad()
            loss = F.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            on_step(i, loss.item())
            tr.step()
    return read_log(tr.out_path)


def test_wandb_sink_keeps_every_row_beside_the_users_own_run_log(tmp_path, monkeypatch):
    """The loop logs its loss to the same run every step; the sink's rows, handed over
    ``flush_every`` steps late, all arrive, on tandv's own step axis, and so do the loop's."""
    wb = pytest.importorskip("wandb")
    from tandv.export import WandbSink

    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wb.init(mode="offline", dir=str(tmp_path), project="tandv-test")
    try:
        df = _loop([WandbSink(run)], tmp_path / "log", lambda i, loss: run.log({"loss": loss}))
    finally:
        run.finish()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    history = _wandb_history(run_dir)
    assert sum("loss" in h for h in history) == STEPS
    ours = {int(h["tandv/step"]): h for h in history if "tandv/step" in h}
    assert sorted(ours) == list(range(STEPS))
    for _, row in df.iterrows():
        key = f"{row[('metadata', 'tensor_type')]}/{row[('metadata', 'name')]}"
        got = ours[int(row[("metadata", "step")])]
        for stat in ("mean", "max_abs", "rm2"):
            assert float(got[f"{key}/{stat}"]) == pytest.approx(row[("scalar_stats", stat)])


def test_wandb_sink_says_when_wandb_refuses_rows(tmp_path, monkeypatch):
    """A run finished before the tracker's rows arrive refuses them: told once, every
    refused step listed, the log on disk whole."""
    wb = pytest.importorskip("wandb")
    from tandv.export import WandbSink

    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wb.init(mode="offline", dir=str(tmp_path), project="tandv-test")
    run.finish()
    sink = WandbSink(run)
    with pytest.warns(RuntimeWarning, match="W&B refused the rows of step 0.*is finished"):
        df = _loop([sink], tmp_path / "log", lambda i, loss: None)
    assert sink.refused_steps == list(range(STEPS))
    assert sorted(set(df[("metadata", "step")])) == list(range(STEPS))


def test_tensorboard_sink_keeps_every_row_beside_the_users_own_writer(tmp_path):
    """The loop writes its loss with its own SummaryWriter into the same directory: the
    event files hold every tandv row and every loss value."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from torch.utils.tensorboard import SummaryWriter

    from tandv.export import TensorBoardSink

    logdir = tmp_path / "tb"
    writer = SummaryWriter(str(logdir))
    sink = TensorBoardSink(logdir)
    df = _loop([sink], tmp_path / "log", lambda i, loss: writer.add_scalar("loss", loss, i))
    writer.close()
    mux = EventMultiplexer(size_guidance={"scalars": 0, "histograms": 0})
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    (run,) = mux.Runs()
    assert [e.step for e in mux.Scalars(run, "loss")] == list(range(STEPS))
    for _, row in df.iterrows():
        key = f"{row[('metadata', 'tensor_type')]}/{row[('metadata', 'name')]}"
        got = {e.step: e.value for e in mux.Scalars(run, f"{key}/max_abs")}
        assert got[int(row[("metadata", "step")])] == pytest.approx(
            row[("scalar_stats", "max_abs")], rel=1e-6
        )
