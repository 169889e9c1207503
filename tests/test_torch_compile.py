"""Tracking compiled PyTorch models: a compiled run's log against an eager run's log of the
same model and data, graph breaks, recompilation and the options that are refused.

The models have bias-free layers: inductor sums a bias gradient over the batch in another
order than ATen (a few ulps apart), which would make the two runs' *training* differ;
matrix products and ReLU are bitwise the same compiled and eager, so every row must be."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from tandv.schema import read_log
from tandv.track.torch import summary as kernel
from tandv.track.torch import track

STEPS = 6
STATS = {"l1": lambda t: t.abs().sum()}  # a custom statistic
EVERY = 2  # steps 0, 2, 4 recorded: scheduled and unscheduled graphs both run


class Net(nn.Module):
    """A tuple output whose second element is an inner module's output (its gradient
    comes from two uses: inside the model and in the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16, bias=False)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 3, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.act(self.fc1(x))
        return self.fc2(h), h


class InplaceNet(Net):
    """``act`` changes ``fc1``'s output in place: two values, two gradients, one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)


def train(
    how: object, out: str, steps: int = STEPS, warm: int = 2, model_cls: type = Net, **options
):
    """Train ``model_cls`` ``steps`` steps with Adam under a tracker; ``how``: ``"eager"``,
    ``"torch.compile"`` or ``"model.compile"`` (inductor), or a dynamo backend for
    ``torch.compile(fullgraph=True)``. After ``warm`` steps a recompilation raises.
    Returns the log, the losses and the number of graphs compiled after each step."""
    torch.manual_seed(0)
    net = model_cls()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    model: nn.Module = net
    if how == "torch.compile":
        model = torch.compile(net)
    elif how == "model.compile":
        net.compile()
    elif how != "eager":
        model = torch.compile(net, backend=how, fullgraph=True)  # a graph break would raise
    gen = torch.Generator().manual_seed(1)
    losses = []
    graphs = []
    with track(model, opt, out=out, verbose=False, every=EVERY, **options) as tracker:
        for step in range(steps):
            x, y = torch.randn(32, 6, generator=gen), torch.randn(32, 3, generator=gen)
            with torch._dynamo.config.patch(error_on_recompile=step >= warm):
                pred, h = model(x)
            loss = ((pred - y) ** 2).mean() + h.mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            tracker.step()
            losses.append(loss.item())
            graphs.append(counters["stats"]["unique_graphs"])
    return read_log(out), losses, graphs


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    key = [("metadata", "step"), ("metadata", "tensor_type"), ("metadata", "name")]
    return df.sort_values(key).reset_index(drop=True)


def assert_same_log(got: pd.DataFrame, want: pd.DataFrame) -> None:
    """Same rows; counts, extrema and exponent counts equal; moments to 1e-6 relative."""
    got, want = _sorted(got), _sorted(want)
    pd.testing.assert_frame_equal(got["metadata"], want["metadata"])
    pd.testing.assert_frame_equal(got["exponent_counts"], want["exponent_counts"])
    exact = ["numel", "zero_count", "nan_count", "inf_count", "min", "max", "min_abs", "max_abs"]
    pd.testing.assert_frame_equal(got["scalar_stats"][exact], want["scalar_stats"][exact])
    moments = [c for c in want["scalar_stats"].columns if c not in exact]
    np.testing.assert_allclose(
        got["scalar_stats"][moments].to_numpy(),
        want["scalar_stats"][moments].to_numpy(),
        rtol=1e-6,
        atol=0,
    )


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory):
    return train("eager", str(tmp_path_factory.mktemp("eager") / "log"))[:2]


@pytest.mark.parametrize("how", ["torch.compile", "model.compile"])
def test_compiled_log_equals_eager_log(how, eager_run, tmp_path):
    """Inductor (its C++ backend on the CPU): the log and the losses of the eager run, no
    graph break, and no recompilation once a scheduled and an unscheduled step have run
    (``train`` turns recompilation into an error after the warm-up)."""
    torch._dynamo.reset()
    counters.clear()
    log, losses, graphs = train(how, str(tmp_path / "log"))
    want, want_losses = eager_run
    assert losses == want_losses  # the same training, compiled and eager (see the notes above)
    assert dict(counters["graph_break"]) == {}
    # one graph for recorded steps, one for the others (hooks inlined, no graph of their
    # own), compiled in the first two steps and never again
    assert graphs[1] == graphs[-1] == 2
    assert set(log.metadata.tensor_type) == {"Activation", "Gradient", "Weight", "Optimiser_State"}
    assert sorted(log.metadata.step.unique()) == [0, 2, 4]
    # eager module paths, never the wrapper's ``_orig_mod.`` prefix
    names = set(log.metadata.name[log.metadata.tensor_type == "Activation"])
    assert names == {"root[0]", "root[1]", "fc1", "act", "fc2"}
    assert_same_log(log, want)
    record, want_record = log.attrs["tandv"], want.attrs["tandv"]
    assert (record["model"], record["options"]["compiled"]) == ("Net", True)
    assert want_record["options"]["compiled"] is False


class GraphRecorder:
    """A dynamo backend that runs graphs as traced (no inductor) and keeps them."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> object:
        self.graphs.append(gm)
        return gm.forward

    def observe_calls(self, gm: torch.fx.GraphModule) -> int:
        return sum(
            n.op == "call_function" and "tandv.observe" in str(n.target) for n in gm.graph.nodes
        )


@pytest.mark.parametrize("backend", ["graphs", "inductor"])
def test_module_changing_its_input_in_place(backend, tmp_path):
    """``ReLU(inplace=True)``: ``fc1``'s row holds the values before the ReLU and their
    gradient, ``act``'s those after, as in eager mode (dynamo's graphs run as traced, and
    inductor's, which reuse buffers in place)."""
    torch._dynamo.reset()
    how = GraphRecorder() if backend == "graphs" else "torch.compile"
    log, losses, _ = train(how, str(tmp_path / "log"), steps=3, model_cls=InplaceNet)
    want, want_losses, _ = train("eager", str(tmp_path / "eager"), steps=3, model_cls=InplaceNet)
    assert losses == want_losses
    rows = want.set_index([("metadata", "name"), ("metadata", "tensor_type")])["scalar_stats"]
    assert (
        rows.loc[("fc1", "Activation"), "min"].min()
        < 0
        <= rows.loc[("act", "Activation"), "min"].min()
    )
    assert_same_log(log, want)


def test_unscheduled_steps_run_a_graph_without_tracking(tmp_path):
    """Two graphs, traced once each: the recorded steps' one calls ``tandv::observe`` once
    per tracked output (5 names), and once for each root output that is an inner module's
    output too (its gradient is summarized by that module's hook: 2 aliases); the other
    never calls it. The log, with a custom statistic computed inside the operator, equals
    the eager one (graphs run by autograd, no inductor)."""
    torch._dynamo.reset()
    backend = GraphRecorder()
    log, losses, _ = train(backend, str(tmp_path / "log"), stats=STATS)
    assert len(backend.graphs) == 2
    calls = sorted(backend.observe_calls(g) for g in backend.graphs)
    assert calls == [0, 7]
    want, want_losses, _ = train("eager", str(tmp_path / "eager"), stats=STATS)
    assert "l1" in log.scalar_stats.columns
    assert losses == want_losses
    assert_same_log(log, want)


def test_compiled_graph_uses_the_fused_kernel_workspace(tmp_path):
    """The operator's summaries go through the tracker's device path (the fused Triton
    kernel into the workspace rows, in Triton's interpreter here) and match the eager
    run on the same path."""
    pytest.importorskip("triton")
    torch._dynamo.reset()
    with kernel.cpu_path("fused"):
        log, _, _ = train(GraphRecorder(), str(tmp_path / "log"), steps=3)
        want, _, _ = train("eager", str(tmp_path / "eager"), steps=3)
    assert_same_log(log, want)


def test_hooks_inline_without_graph_breaks():
    """``torch._dynamo.explain`` of a tracked model's call: one graph, no break, the
    operator in it for each output and each alias (see above)."""
    torch.manual_seed(0)
    net = Net()
    with track(torch.compile(net), out="log", verbose=False):
        explanation = torch._dynamo.explain(lambda x: net(x))(torch.randn(4, 6))
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1
    ops = [str(op) for graph_ops in explanation.ops_per_graph for op in graph_ops]
    assert sum("tandv.observe" in op for op in ops) == 7


def test_a_closed_tracker_leaves_the_model_untracked_and_a_new_one_tracks_it(tmp_path):
    """Hooks that come and go make dynamo compile again: after ``close`` the model runs a
    graph without the operator; a second tracker of the same compiled model gets rows."""
    torch._dynamo.reset()
    backend = GraphRecorder()
    torch.manual_seed(0)
    net = Net()
    model = torch.compile(net, backend=backend)
    x = torch.randn(4, 6)
    model(x)  # compiled before tracking: that graph has no hooks
    assert backend.observe_calls(backend.graphs[-1]) == 0
    for run in ("first", "second"):
        with track(model, out=str(tmp_path / run), verbose=False, track_gradients=False) as tracker:
            model(x)
            tracker.step()
        assert backend.observe_calls(backend.graphs[-1]) == 5
        rows = read_log(str(tmp_path / run))
        assert sorted(rows.metadata.name[rows.metadata.tensor_type == "Activation"]) == [
            "act",
            "fc1",
            "fc2",
            "root[0]",
            "root[1]",
        ]
        model(x)
        assert backend.observe_calls(backend.graphs[-1]) == 0


@pytest.mark.parametrize(
    "compile_",
    [
        lambda net: torch.compile(net, mode="reduce-overhead"),
        lambda net: torch.compile(net, options={"triton.cudagraphs": True}),
        lambda net: torch.compile(net, mode="max-autotune"),
        lambda net: net.compile(mode="reduce-overhead") or net,
    ],
    ids=["mode", "options", "max-autotune", "in-place"],
)
def test_cuda_graphs_are_refused_naming_the_option(compile_):
    """CUDA graphs would replay without calling the tracker: refused at start, with the
    option to change; weights and optimizer state alone (no hooks) are fine."""
    torch.manual_seed(0)
    model = compile_(Net())
    with pytest.raises(
        ValueError, match=r"triton.cudagraphs.*mode=\"default\".*track_activations=False"
    ):
        track(model, out="log")
    track(model, out="log2", track_activations=False, track_gradients=False).close()


@pytest.mark.parametrize("model_cls", [Net, InplaceNet])
def test_a_submodule_compiled_in_place_inside_an_eager_model(model_cls, tmp_path):
    """``net.fc2.compile()``: that module's hook runs in its graph, the others eagerly
    (the operator is an ordinary call there; ``act`` returns ``fc1``'s output changed in
    place); the log equals the eager one."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    backend = GraphRecorder()
    net = model_cls()
    net.fc2.compile(backend=backend)
    x = torch.randn(8, 6)
    with track(net, out=str(tmp_path / "log"), verbose=False) as tracker:
        pred, h = net(x)
        (pred.sum() + h.sum()).backward()
        tracker.step()
    assert [backend.observe_calls(g) for g in backend.graphs] == [1]  # fc2's output
    torch.manual_seed(0)
    net = model_cls()
    with track(net, out=str(tmp_path / "eager"), verbose=False) as tracker:
        pred, h = net(x)
        (pred.sum() + h.sum()).backward()
        tracker.step()
    assert_same_log(read_log(str(tmp_path / "log")), read_log(str(tmp_path / "eager")))


class Checkpointed(nn.Module):
    """``Net`` under non-reentrant activation checkpointing: its forward runs again in the
    backward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Net()
        self.out = nn.Linear(3, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pred, _ = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
        return self.out(pred)


def test_activation_checkpointing_inside_the_graph(tmp_path):
    """The recomputed forward is not counted again, and the rows equal eager mode's
    (AOT autograd's graphs, run without inductor)."""
    torch._dynamo.reset()
    counters.clear()
    logs = []
    for how in ("eager", "aot_eager"):
        torch.manual_seed(0)
        net = Checkpointed()
        model = net if how == "eager" else torch.compile(net, backend=how)
        x = torch.randn(8, 6)
        with track(model, out=str(tmp_path / how), verbose=False) as tracker:
            for _ in range(2):
                model(x).sum().backward()
                tracker.step()
        logs.append(read_log(str(tmp_path / how)))
    assert dict(counters["graph_break"]) == {}
    acts = logs[1][(logs[1].metadata.tensor_type == "Activation") & (logs[1].metadata.step == 1)]
    # one observation per step each (a second would double the merged numel)
    assert dict(zip(acts.metadata.name, acts.scalar_stats.numel)) == {
        "inner.fc1": 8 * 16,
        "inner.act": 8 * 16,
        "inner.fc2": 8 * 3,
        "inner[0]": 8 * 3,
        "inner[1]": 8 * 16,
        "out": 8 * 2,
        "root": 8 * 2,
    }
    assert_same_log(logs[1], logs[0])


def test_the_observe_operator_reaches_its_kernel_once_and_never_under_tracing(monkeypatch):
    """``tandv::observe`` outside a compiled graph: on a tensor that requires grad it runs
    its kernel once, with its arguments, records nothing for autograd (its autograd keys
    fall through) and returns nothing; under fake tensors (what dynamo and AOT autograd
    trace with) it never reaches the kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tandv.track.torch import _compiled

    calls = []

    class Hooks:
        def observe(self, *args):
            calls.append(args)

    hooks = Hooks()
    monkeypatch.setitem(_compiled._HOOKS, -7, lambda: hooks)
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    assert torch.ops.tandv.observe(y, -7, 4, "fc", "Activation") is None
    assert len(calls) == 1
    got, *rest = calls[0]
    assert got is y and rest == [4, "fc", "Activation", -1, ""]
    y.sum().backward()  # the call left the graph as it was
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    with torch.no_grad():
        torch.ops.tandv.observe(y, -7, 5, "g", "Gradient", 1, "h")
    assert calls[1][1:] == (5, "g", "Gradient", 1, "h")
    with FakeTensorMode() as mode:
        torch.ops.tandv.observe(mode.from_tensor(y), -7, 4, "fc", "Activation")
    assert len(calls) == 2
