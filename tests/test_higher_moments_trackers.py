"""The trackers' ``moments=4`` option: ``skew`` and ``kurtosis`` columns in the log, equal to
``scipy.stats`` of the tensors the test captures itself (float32, mean 1e4 x the spread),
merged over micro-batches and over processes."""

from __future__ import annotations

import numpy as np
import pytest
from _benchmarks import load_benchmark

from tandv.schema import read_log
from tandv.stats.summary import Layout, finalize, summarize
from tandv.track.common import TensorKey
from tandv.track.common.distributed import LOCAL, merge_ranks

stats = pytest.importorskip("scipy.stats")
torch = pytest.importorskip("torch")
nn = torch.nn
RTOL = 1e-6


def _want(tensors) -> tuple[float, float]:
    """scipy's skewness and excess kurtosis of the tensors' values together, in float64."""
    a = np.concatenate([np.asarray(t, np.float64).ravel() for t in tensors])
    return float(stats.skew(a)), float(stats.kurtosis(a))


def _assert_row(df, name: str, tt: str, step: int, tensors) -> None:
    m = df["metadata"]
    sel = (m["name"] == name) & (m["tensor_type"] == tt) & (m["step"] == step)
    assert sel.sum() == 1, (name, tt, step)
    row = df[sel].iloc[0]
    skew, kurt = _want(tensors)
    # Standardized moments, relative to their own scale: skewness to 1e-6 relative (or 1e-6
    # absolute near 0), Pearson's kurtosis (the excess + 3) to 1e-6 relative. The excess alone
    # near 0 (a Gaussian-like tensor) carries the float32 variance's rounding of paths whose
    # m2 is summed in float32, ~3e-7 absolute: no relative bound holds there.
    got_s, got_k = row[("scalar_stats", "skew")], row[("scalar_stats", "kurtosis")]
    assert got_s == pytest.approx(skew, rel=RTOL, abs=RTOL), (name, tt, step)
    assert got_k + 3 == pytest.approx(kurt + 3, rel=RTOL), (name, tt, step)


class _Net(nn.Module):
    """A small MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def test_option_is_checked():
    from tandv.track.common.options import TrackOptions

    for bad in (3, True, "4"):
        with pytest.raises(ValueError, match="moments="):
            TrackOptions(moments=bad)
    assert TrackOptions(moments=4).moments == 4


@pytest.fixture(params=["host", "fused", "ops"])
def torch_path(request):
    """CPU tensors by the host kernel, by the fused Triton kernel CUDA tensors take (in
    Triton's interpreter), and by the torch-op path (CUDA tensors without Triton)."""
    from tandv.track.torch import summary as kernel

    if request.param == "fused":
        pytest.importorskip("triton")
    with kernel.cpu_path(request.param):
        yield request.param


def test_torch_tracker_logs_exact_skew_and_kurtosis(tmp_path, torch_path):
    from tandv.track.torch import track

    torch.manual_seed(0)
    net = _Net()
    with torch.no_grad():
        net.fc2.bias.add_(1e4)  # fc2's outputs: mean 1e4, spread ~1
    opt = torch.optim.SGD(net.parameters(), lr=1e-6)
    acts: dict[str, list] = {}
    grads: dict[str, list] = {}

    def hook(name):
        def h(mod, args, out):
            acts.setdefault(name, []).append(out.detach().numpy().copy())
            out.register_hook(lambda g: grads.setdefault(name, []).append(g.numpy().copy()))

        return h

    for name in ("fc1", "fc2"):
        getattr(net, name).register_forward_hook(hook(name))
    g = torch.Generator().manual_seed(1)
    record = []
    with track(net, opt, out=str(tmp_path / "log"), moments=4, verbose=False) as tr:
        for _ in range(2):
            acts.clear(), grads.clear()
            weights = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
            opt.zero_grad()
            for _ in range(2):  # two micro-batches of different sizes: merged rows
                x = torch.randn(int(torch.randint(5, 40, (1,), generator=g)), 16, generator=g)
                (net(x) - 1e4).pow(3).sum().backward()
            pgrads = {n: p.grad.numpy().copy() for n, p in net.named_parameters()}
            opt.step()
            tr.step()
            record.append((dict(acts), dict(grads), weights, pgrads))
    df = read_log(tr.out_path)
    for step, (a, gr, w, pg) in enumerate(record):
        for name in ("fc1", "fc2"):
            assert len(a[name]) == len(gr[name]) == 2
            _assert_row(df, name, "Activation", step, a[name])
            _assert_row(df, name, "Gradient", step, gr[name])
        for name in w:
            _assert_row(df, name, "Weight", step, [w[name]])
            _assert_row(df, name, "Gradient", step, [pg[name]])
    # the shifted activation really is one whose mean dominates
    mean = df[df["metadata"]["name"] == "fc2"][("scalar_stats", "mean")].iloc[0]
    assert abs(mean) > 1e3


class _Ranks:
    """Two simulated ranks' collectives for :func:`merge_ranks`, answered from what each
    sends (``sent``, filled by a first recording pass)."""

    def __init__(self, rank: int, sent: dict, record: bool) -> None:
        self.rank, self.world_size, self.timeout = rank, 2, 1.0
        self.sent, self.record = sent, record

    def all_gather_ints(self, values: np.ndarray) -> np.ndarray:
        if self.record:
            self.sent["ints"].append(values)
            return np.stack([values] * 2)
        return np.stack(self.sent["ints"])

    def gather(self, vector: np.ndarray, dst: int) -> list[np.ndarray] | None:
        if self.record:
            self.sent["vectors"].append(vector)
            return None
        return list(self.sent["vectors"]) if self.rank == dst else None

    def broadcast_text(self, text: str | None, src: int) -> str:  # pragma: no cover
        raise AssertionError("not used")


def test_rank_merge_keeps_skew_and_kurtosis_exact():
    """The cross-process merge (the trackers' ``distributed`` runs) of ``moments=4``
    summaries: each rank's half of an activation whose mean dominates, merged on rank 0."""
    rng = np.random.default_rng(3)
    x = (rng.standard_t(5, 6000) + rng.exponential(1.0, 6000) + 1e4).astype(np.float32)
    halves = [x[:2500], x[2500:]]
    layout = Layout("float32", moments=4)
    key = TensorKey("fc", "Activation", "Linear", "float32")
    rows = [[(key, layout, summarize(h, fmt="float32", moments=4)[0], LOCAL)] for h in halves]
    sent: dict = {"ints": [], "vectors": []}
    for r in range(2):
        merge_ranks(0, rows[r], _Ranks(r, sent, True), writer=2)  # records what each sends
    out = [merge_ranks(0, rows[r], _Ranks(r, sent, False)) for r in range(2)]
    assert out[1] == []
    ((k, lay, v),) = out[0]
    assert k == key and lay == layout
    got, _ = finalize(v, layout)
    skew, kurt = _want([x])
    assert got["skew"] == pytest.approx(skew, rel=RTOL)
    assert got["kurtosis"] == pytest.approx(kurt, rel=RTOL)


_m3_m4_programs: dict = {}


@pytest.mark.parametrize("mean, rtol", [(0.0, RTOL), (4e4, 1e-3)])
def test_jax_summary_computes_m3_m4(mean, rtol):
    """XLA's summary (``summarize_jax``) with ``moments=4``, whole and merged, against scipy.
    Its values travel in float32: at mean 4e4 x the spread the float32 mean and m2 of the
    core summary are themselves off by ~1e-3 and ~5e-6 of the spread, which bounds the
    skewness and kurtosis (measured: 2e-5 whole, 1.5e-4 merged)."""
    jax = pytest.importorskip("jax")
    from tandv.stats.summary import merge
    from tandv.track.jax import summarize_jax, to_vector

    rng = np.random.default_rng(0)
    x = rng.standard_t(5, 20_000) + 0.5 * rng.exponential(1.0, 20_000) + mean
    x = x.astype(np.float32)
    layout = Layout("float32", moments=4)
    skew, kurt = _want([x])
    if layout not in _m3_m4_programs:  # one program for both cases (op by op: ~14 s each)
        _m3_m4_programs[layout] = jax.jit(
            lambda a: [summarize_jax(p, layout) for p in (a, a[:7000], a[7000:])]
        )
    whole, *parts = (to_vector(s) for s in _m3_m4_programs[layout](x))
    for v in (whole, merge(parts[0], parts[1], layout)):
        got, _ = finalize(v, layout)
        assert got["skew"] == pytest.approx(skew, rel=rtol, abs=rtol)
        assert got["kurtosis"] + 3 == pytest.approx(kurt + 3, rel=rtol)


def test_overhead_benchmark_with_moments_runs_in_tiny_mode(capsys):
    import re

    bench = load_benchmark("overhead")
    tiny = "--layers 1 --d-model 16 --heads 2 --mlp 32 --vocab 32 --seq 8 --batch 2"
    argv = tiny.split() + "--steps 2 --warmup 1 --every 1 --moments".split()
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    line = next(t for t in out.splitlines() if t.startswith("every=1: untracked"))
    u, t, v, r2, r4, r42 = (float(w) for w in re.findall(r"\d+\.\d+", line))
    assert u > 0 and t > 0 and v > 0
    assert r4 / r2 == pytest.approx(r42, rel=1e-2)  # the three ratios are of the same medians
