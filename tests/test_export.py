"""TensorBoard export, read back with TensorBoard's own event reader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from tandv.export import TensorBoardSink, tensorboard  # noqa: E402
from tandv.schema import read_log  # noqa: E402
from tandv.track.torch import track  # noqa: E402


def _train(sinks=(), out="log", steps=3, flush_every=2):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    with track(net, opt, out=out, sinks=sinks, flush_every=flush_every, verbose=False) as tr:
        for i in range(steps):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
            opt.zero_grad()
            F.mse_loss(net(x), y).backward()
            opt.step()
            tr.step()
    return read_log(tr.out_path)


def _events(logdir):
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def _check(df, acc):
    tags = acc.Tags()
    for _, row in df.iterrows():
        kind, name, step = (
            row[("metadata", "tensor_type")],
            row[("metadata", "name")],
            row[("metadata", "step")],
        )
        for stat in ("mean", "max_abs", "nan_count"):
            got = {e.step: e.value for e in acc.Scalars(f"{kind}/{name}/{stat}")}
            assert got[step] == pytest.approx(
                row[("scalar_stats", stat)], rel=1e-6
            )  # float32 in events
        counts = row["exponent_counts"]
        exps = {lab: c for lab, c in counts.items() if c and lab not in ("-inf", "+inf")}
        hist = {e.step: e.histogram_value for e in acc.Histograms(f"{kind}/{name}/exponents")}[step]
        assert hist.num == counts.sum()
        # each exponent's count sits in the bucket whose upper edge is 2**(n+1)
        by_edge = dict(zip(hist.bucket_limit, hist.bucket))
        for lab, c in exps.items():
            assert by_edge[2.0 ** (int(lab) + 1)] == c
    assert (
        len(tags["scalars"])
        == len(
            {(r[("metadata", "tensor_type")], r[("metadata", "name")]) for _, r in df.iterrows()}
        )
        * 8
    )


def test_tensorboard_export_of_a_log(tmp_path):
    df = _train(out=tmp_path / "log")
    logdir = tensorboard(tmp_path / "log", tmp_path / "tb")
    _check(df, _events(logdir))


def test_tensorboard_sink_live_from_the_tracker(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    df = _train(sinks=[sink], out=tmp_path / "log", steps=5, flush_every=2)
    _check(df, _events(tmp_path / "tb"))
    with pytest.raises(TypeError, match="sinks"):
        _train(sinks=["not callable"], out=tmp_path / "log2")


def test_wandb_sink_offline(tmp_path, monkeypatch):
    """A real offline W&B run receives one log call per step holding every row's scalars
    and a log2|x| histogram whose bins are the exponent counts."""
    wb = pytest.importorskip("wandb")
    from tandv.export import WandbSink
    from tandv.export import wandb as to_wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    df = _train(out=tmp_path / "log")
    run = wb.init(mode="offline", dir=str(tmp_path), project="tandv-test")
    calls = []
    real_log = run.log
    monkeypatch.setattr(
        run, "log", lambda data, step=None: calls.append((step, data)) or real_log(data, step=step)
    )
    try:
        to_wandb(tmp_path / "log", run)
    finally:
        run.finish()
    assert all(s is None for s, _ in calls)  # W&B's step is left alone: tandv/step carries it
    assert [d["tandv/step"] for _, d in calls] == sorted(set(df[("metadata", "step")]))
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # written by W&B
    for _, data in calls:
        rows = df[df[("metadata", "step")] == data["tandv/step"]]
        for _, row in rows.iterrows():
            base = f"{row[('metadata', 'tensor_type')]}/{row[('metadata', 'name')]}"
            assert data[f"{base}/max_abs"] == row[("scalar_stats", "max_abs")]
            hist = data[f"{base}/log2_abs"]
            counts = row["exponent_counts"]
            exps = {int(lab): c for lab, c in counts.items() if lab not in ("-inf", "+inf")}
            edges = np.asarray(hist.bins)
            got = dict(zip(edges[:-1].astype(int), hist.histogram))
            for e, c in exps.items():
                assert got[e] == c
    with pytest.raises(TypeError, match="wandb.init"):
        WandbSink(object())


def test_jax_tracker_feeds_its_sinks(tmp_path):
    """The JAX tracker hands every written batch of rows to its sinks, and closes them."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import optax
    import pandas as pd

    from tandv.track.jax import track as jax_track

    class Recording:
        def __init__(self):
            self.batches, self.closed = [], False

        def __call__(self, rows):
            self.batches.append(rows)

        def close(self):
            self.closed = True

    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    opt = optax.sgd(0.1)
    state = opt.init(params)

    def update(p, s, x):
        g = jax.grad(lambda q: jnp.sum((x @ q["w"] + q["b"]) ** 2))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    sink = Recording()
    with jax_track(
        model_state=params,
        optimizer_state=state,
        out=tmp_path / "log",
        sinks=[sink],
        flush_every=2,
        verbose=False,
    ) as tr:
        for i in range(3):
            params, state, grads = tr.intercept(update, params, state, jnp.full((2, 4), float(i)))
            tr.step(params, state, grads)
    df = read_log(tr.out_path)
    from tandv.schema import run_record

    assert run_record(df)["framework"] == "jax" and run_record(df)["options"]["flush_every"] == 2
    sent = pd.concat(sink.batches, ignore_index=True)
    assert sink.closed and len(sink.batches) == 2 and len(sent) == len(df)
    key = [("metadata", "step"), ("metadata", "tensor_type"), ("metadata", "name")]
    a = sent.sort_values(key).reset_index(drop=True)[("scalar_stats", "max_abs")]
    b = df.sort_values(key).reset_index(drop=True)[("scalar_stats", "max_abs")]
    np.testing.assert_array_equal(a.to_numpy(), b.to_numpy())
