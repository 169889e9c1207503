"""Taiyi's quantities (tandv.taiyi) against their definitions computed independently in numpy
(np.linalg.eigvalsh / svd / norm on the same tensors, captured by the test's own hooks),
Taiyi's schedule strings (which steps fire), the config form and its errors, and the table
written beside a tandv log."""

from __future__ import annotations

import copy
import math

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import tandv  # noqa: E402
from tandv.taiyi import (  # noqa: E402
    QUANTITIES,
    Monitor,
    describe_quantities,
    parse_schedule,
    read_taiyi,
    taiyi_dir,
)
from tandv.taiyi.torch import resolve_config  # noqa: E402

COV = [
    "InputCovMaxEig",
    "InputCovStableRank",
    "InputCovCondition20",
    "InputCovCondition50",
    "InputCovCondition80",
]


def values(df: pd.DataFrame, module: str, step: int | None = None) -> dict[str, float]:
    sel = df[df["module"] == module]
    if step is not None:
        sel = sel[sel["step"] == step]
    return dict(zip(sel["quantity"], sel["value"]))


class Capture:
    """The test's own record of a module's inputs and outputs (numpy float64), separate from
    the Monitor's hooks."""

    def __init__(self, module: nn.Module) -> None:
        self.inputs: list[np.ndarray] = []
        self.outputs: list[np.ndarray] = []
        module.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.inputs.append(args[0].detach().double().numpy())
        self.outputs.append(output.detach().double().numpy())


def np_cov_expectation(x: np.ndarray) -> dict[str, float]:
    """The covariance quantities from their definitions, for samples x features ``x``."""
    c = np.cov(x, rowvar=False, ddof=1)
    eig = np.sort(np.linalg.eigvalsh(c))[::-1]
    xc = x - x.mean(0)
    sv = np.linalg.svd(xc, compute_uv=False)
    d = c.shape[0]
    out = {
        "InputCovMaxEig": eig[0],
        # stable rank ||Xc||_F^2 / ||Xc||_2^2 from the SVD, a second route to tr(C) / lambda_1
        "InputCovStableRank": (sv**2).sum() / sv[0] ** 2,
    }
    for p in (20, 50, 80):
        out[f"InputCovCondition{p}"] = eig[0] / eig[int(math.floor(p * d / 100))]
    return out


def np_rankme(z: np.ndarray) -> float:
    s = np.linalg.svd(z, compute_uv=False)
    p = s / np.abs(s).sum() + 1e-7
    return float(np.exp(-(p * np.log(p)).sum()))


# -- each quantity against its definition -------------------------------------------------------


def test_covariance_quantities_of_a_linear_input_match_numpy():
    torch.manual_seed(0)
    lin = nn.Linear(6, 4)
    cap = Capture(lin)
    mon = Monitor(lin, {nn.Linear: COV})
    mix = torch.randn(6, 6)
    x = torch.randn(3, 10, 6) @ mix  # (B, T, D): 30 samples of 6 correlated features
    lin(x)
    mon.track()
    got = values(mon.to_dataframe(), "root", 0)
    want = np_cov_expectation(cap.inputs[0].reshape(-1, 6))
    assert set(got) == set(COV)
    for q in COV:
        assert got[q] == pytest.approx(want[q], rel=1e-9), q
    # the 80% condition uses a smaller eigenvalue than the 20% one
    assert got["InputCovCondition80"] > got["InputCovCondition20"] > 1


def test_conv_input_is_pixels_by_channels_and_passes_of_a_step_merge():
    torch.manual_seed(1)
    conv = nn.Conv2d(5, 3, 3)
    cap = Capture(conv)
    mon = Monitor(conv, {"Conv2d": COV + ["InputMean", "InputSndNorm", "RankMe"]})
    for _ in range(2):  # two micro-batches in one step: the quantities of both together
        conv(
            torch.randn(4, 5, 6, 6) * torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0]).view(1, 5, 1, 1) + 0.3
        )
    mon.track()
    got = values(mon.to_dataframe(), "root", 0)
    xs = np.concatenate(
        [x.transpose(0, 2, 3, 1).reshape(-1, 5) for x in cap.inputs]
    )  # (N*H*W*2, C)
    want = np_cov_expectation(xs)
    for q in COV:
        assert got[q] == pytest.approx(want[q], rel=1e-9), q
    allx = np.concatenate([x.ravel() for x in cap.inputs])
    assert got["InputMean"] == pytest.approx(allx.mean(), rel=1e-12)
    assert got["InputSndNorm"] == pytest.approx(np.linalg.norm(allx), rel=1e-12)
    z = np.concatenate([y.transpose(0, 2, 3, 1).reshape(-1, 3) for y in cap.outputs])
    assert got["RankMe"] == pytest.approx(np_rankme(z), rel=1e-7)


def test_rankme_of_a_linear_output_and_of_a_rank_one_output():
    torch.manual_seed(2)
    lin = nn.Linear(8, 6)
    cap = Capture(lin)
    mon = Monitor(lin, {nn.Linear: ["RankMe"]})
    lin(torch.randn(20, 8))
    mon.track()
    with torch.no_grad():  # every sample's output a multiple of one vector: rank 1
        lin.weight.copy_(torch.outer(torch.randn(6), torch.randn(8)))
        lin.bias.zero_()
    lin(torch.randn(20, 8))
    mon.track()
    df = mon.to_dataframe()
    assert values(df, "root", 0)["RankMe"] == pytest.approx(np_rankme(cap.outputs[0]), rel=1e-7)
    assert values(df, "root", 1)["RankMe"] == pytest.approx(np_rankme(cap.outputs[1]), rel=1e-5)
    assert values(df, "root", 1)["RankMe"] < 1.01 < values(df, "root", 0)["RankMe"]


def test_norms_of_weight_and_output_gradient():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    mon = Monitor(model, {"0": ["WeightNorm", "OutputGradSndNorm"], "2": ["OutputGradSndNorm"]})
    r1, r2 = torch.randn(4, 3), torch.randn(4, 3)
    (model(torch.randn(4, 5)) * r1).sum().backward()  # d loss / d output of "2" is r1
    (model(torch.randn(4, 5)) * r2).sum().backward()
    mon.track()
    got = mon.to_dataframe()
    w = model[0].weight.detach().double().numpy()
    assert values(got, "0")["WeightNorm"] == pytest.approx(np.sqrt((w**2).sum()), rel=1e-12)
    want = np.linalg.norm(
        np.concatenate([r1.double().numpy().ravel(), r2.double().numpy().ravel()])
    )
    assert values(got, "2")["OutputGradSndNorm"] == pytest.approx(want, rel=1e-12)


def test_output_gradient_norm_of_an_inner_layer_matches_autograd():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    mon = Monitor(model, {"0": ["OutputGradSndNorm"]})
    x = torch.randn(6, 5)
    h = model[0](x).detach().requires_grad_(True)
    model[2](model[1](h)).square().sum().backward()
    want = np.linalg.norm(h.grad.double().numpy())
    model.zero_grad()
    model(x).square().sum().backward()
    mon.track()
    assert values(mon.to_dataframe(), "0")["OutputGradSndNorm"] == pytest.approx(want, rel=1e-6)


def test_dead_neurons_are_units_never_positive_in_the_step():
    torch.manual_seed(5)
    lin = nn.Linear(4, 7)
    with torch.no_grad():  # unit k < 6 outputs x[k % 4] + bias[k]; unit 6 outputs exactly 0
        lin.weight.copy_(torch.cat([torch.eye(4)[[0, 1, 2, 3, 0, 1]], torch.zeros(1, 4)]))
        lin.bias.copy_(torch.tensor([-50.0, 0.0, -50.0, 0.0, 0.0, -50.0, 0.0]))
    cap = Capture(lin)
    mon = Monitor(lin, {nn.Linear: ["LinearDeadNeuronNum"]})
    lin(torch.randn(2, 5, 4))  # units 1, 3 and 4 are positive somewhere in this pass only
    lin(-torch.randn(3, 5, 4).abs())
    mon.track()
    y = np.concatenate([o.reshape(-1, 7) for o in cap.outputs])
    want = int((y <= 0).all(axis=0).sum())
    assert want == 4 and not (cap.outputs[1] > 0).any()
    assert values(mon.to_dataframe(), "root")["LinearDeadNeuronNum"] == want


def test_batchnorm_mean_and_var_tid_average_over_the_batches_since_last_computed():
    torch.manual_seed(6)
    bn = nn.BatchNorm2d(3, momentum=0.3)
    cap = Capture(bn)
    mon = Monitor(bn, {nn.BatchNorm2d: [["MeanTID", "linear(3, 2)"], ["VarTID", "linear(3, 2)"]]})
    expected = {}
    seen: list[np.ndarray] = []
    for step in range(6):
        bn(torch.randn(8, 3, 4, 4) * (1 + step) + step)
        seen.append(cap.inputs[-1])
        if step in (2, 5):  # the schedule fires; the batches since the last firing count
            rm = bn.running_mean.double().numpy()
            sr = np.sqrt(bn.running_var.double().numpy())
            mus = [x.mean(axis=(0, 2, 3)) for x in seen]
            sigmas = [x.std(axis=(0, 2, 3)) for x in seen]  # biased, as BatchNorm normalizes
            expected[step] = (
                np.mean([np.linalg.norm(m - rm) / np.linalg.norm(sr) for m in mus]),
                np.mean([np.linalg.norm(s - sr) / np.linalg.norm(sr) for s in sigmas]),
            )
            seen = []
        mon.track()
    df = mon.to_dataframe()
    assert sorted(set(df["step"])) == [2, 5]
    for step, (mean_tid, var_tid) in expected.items():
        got = values(df, "root", step)
        assert got["MeanTID"] == pytest.approx(mean_tid, rel=1e-9)
        assert got["VarTID"] == pytest.approx(var_tid, rel=1e-9)


def test_eval_mode_passes_are_not_counted():
    torch.manual_seed(7)
    lin = nn.Linear(3, 2)
    cap = Capture(lin)
    mon = Monitor(lin, {nn.Linear: ["InputSndNorm"]})
    lin(torch.randn(4, 3))
    lin.eval()
    lin(torch.randn(4, 3) * 100)
    lin.train()
    mon.track()
    assert values(mon.to_dataframe(), "root")["InputSndNorm"] == pytest.approx(
        np.linalg.norm(cap.inputs[0])
    )


def test_every_quantity_is_tested_and_documented():
    tested = set(COV) | {
        "InputMean",
        "InputSndNorm",
        "OutputGradSndNorm",
        "WeightNorm",
        "LinearDeadNeuronNum",
        "RankMe",
        "MeanTID",
        "VarTID",
    }
    assert tested == set(QUANTITIES)
    assert all(len(q.doc) > 40 for q in QUANTITIES.values())
    assert {q.name for q in QUANTITIES.values() if not q.exact} == set(COV)
    table = describe_quantities()
    assert table["quantity"].tolist() == list(QUANTITIES)
    assert table.set_index("quantity").loc["MeanTID", "modules"] == "batchnorm"


# -- schedules ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, fires",
    [
        ("linear(5, 2)", [2, 7, 12]),  # Taiyi's example: steps 2, 7, 12, ...
        ("linear(5,0)", [0, 5, 10]),
        (" linear( 4 ) ", [0, 4, 8, 12]),  # offset defaults to 0
        ("linear(0, 0)", list(range(14))),  # Taiyi's documented default: every step
        ("linear(1, 11)", [11, 12, 13]),
        (None, list(range(14))),
    ],
)
def test_schedule_strings_fire_at_the_documented_steps(spec, fires):
    s = parse_schedule(spec)
    assert [k for k in range(14) if s(k)] == fires


@pytest.mark.parametrize(
    "spec", ["cosine(5, 0)", "linear(5, -1)", "linear(a, 0)", "linear 5, 0", ""]
)
def test_bad_schedule_strings_are_rejected(spec):
    with pytest.raises(ValueError, match="linear\\(interval, offset\\)"):
        parse_schedule(spec)


def test_per_quantity_schedules_fire_on_their_steps_in_a_run():
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    mon = Monitor(
        model,
        {
            nn.BatchNorm1d: [["MeanTID", "linear(5, 0)"], "InputSndNorm"],
            "Linear": [["WeightNorm", "linear(5, 2)"], ["InputMean"]],
        },
    )
    for _ in range(13):
        model(torch.randn(8, 3))
        mon.track()
    df = mon.to_dataframe()
    steps = df.groupby(["module", "quantity"])["step"].apply(list).to_dict()
    assert steps[("1", "MeanTID")] == [0, 5, 10]
    assert steps[("1", "InputSndNorm")] == list(range(13))
    assert steps[("0", "WeightNorm")] == [2, 7, 12]
    assert steps[("0", "InputMean")] == list(range(13))


def test_unscheduled_steps_compute_nothing(monkeypatch):
    import tandv.taiyi.torch as tt

    calls = []
    real = tt.feature_matrix
    monkeypatch.setattr(tt, "feature_matrix", lambda x, m: calls.append(1) or real(x, m))
    lin = nn.Linear(3, 3)
    mon = Monitor(
        lin, {nn.Linear: [["InputCovMaxEig", "linear(4, 1)"], ["RankMe", "linear(4, 1)"]]}
    )
    per_step = []
    for _ in range(6):
        lin(torch.randn(5, 3))
        per_step.append(len(calls))
        mon.track()
        calls.clear()
    assert per_step == [0, 2, 0, 0, 0, 2]  # input and output matrices only at steps 1 and 5


def test_explicit_step_numbers_and_start_step():
    lin = nn.Linear(2, 2)
    mon = Monitor(lin, {nn.Linear: [["InputMean", "linear(2, 1)"]]}, start_step=1)
    for step in range(1, 6):
        lin(torch.randn(3, 2))
        mon.track(step)
    assert list(mon.to_dataframe()["step"]) == [1, 3, 5]
    assert set(mon.get_output()["root"]["InputMean"]) == {1, 3, 5}


# -- the config form and its errors ---------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.act = nn.ReLU()
        self.fc1 = nn.Linear(3, 4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.bn(self.conv(x))).mean(dim=(2, 3))
        return self.fc2(self.fc1(h))


def test_config_keys_select_by_name_class_name_and_class():
    net = Net()
    plan = resolve_config(
        net,
        {
            "fc1": ["WeightNorm"],
            "Linear": ["InputMean"],
            nn.BatchNorm2d: [["MeanTID", "linear(5, 0)"], "InputSndNorm"],
        },
    )
    assert list(plan) == ["bn", "fc1", "fc2"]  # model order
    assert [e.name for e in plan["fc1"][1]] == ["WeightNorm", "InputMean"]
    assert [e.name for e in plan["fc2"][1]] == ["InputMean"]
    assert [(e.name, e.schedule_text) for e in plan["bn"][1]] == [
        ("MeanTID", "linear(5, 0)"),
        ("InputSndNorm", "every step"),
    ]


@pytest.mark.parametrize(
    "config, error, words",
    [
        (
            {nn.Linear: ["InputCovMaxEigen"]},
            ValueError,
            ["nn.Linear", "unknown quantity", "'InputCovMaxEig'"],
        ),
        ({"fc3": ["WeightNorm"]}, ValueError, ["'fc3'", "no module", "fc1"]),
        (
            {nn.LayerNorm: ["WeightNorm"]},
            ValueError,
            ["nn.LayerNorm", "no LayerNorm module", "BatchNorm2d"],
        ),
        ({int: ["WeightNorm"]}, TypeError, ["int", "nn.Module subclass"]),
        ({3: ["WeightNorm"]}, TypeError, ["config key 3", "module path"]),
        ({nn.Conv2d: ["LinearDeadNeuronNum"]}, ValueError, ["nn.Conv2d", "'conv'", "nn.Linear"]),
        ({"fc1": ["MeanTID"]}, ValueError, ["'fc1'", "MeanTID", "BatchNorm"]),
        ({nn.ReLU: ["WeightNorm"]}, ValueError, ["nn.ReLU", "'act'", "no weight"]),
        (
            {nn.Linear: [["InputMean", "every(5)"]]},
            ValueError,
            ["nn.Linear", "'InputMean'", "linear(interval, offset)"],
        ),
        (
            {nn.Linear: [["InputMean", "linear(1, 0)", "x"]]},
            ValueError,
            ["nn.Linear", "is not a quantity"],
        ),
        ({nn.Linear: ["InputMean", "InputMean"]}, ValueError, ["listed twice"]),
        (
            {nn.Linear: [["InputMean", "linear(2, 0)"]], "fc1": ["InputMean"]},
            ValueError,
            ["'fc1'", "from key nn.Linear", "from key 'fc1'"],
        ),
        ({nn.Linear: {"InputMean": 1}}, TypeError, ["expected a list of quantities"]),
    ],
)
def test_config_errors_say_which_key_what_and_what_to_do(config, error, words):
    with pytest.raises(error) as e:
        Monitor(Net(), config)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_failed_config_leaves_no_hooks():
    net = Net()
    with pytest.raises(ValueError):
        Monitor(net, {nn.Linear: ["InputMean"], nn.Conv2d: ["Nope"]})
    assert all(not m._forward_hooks for m in net.modules())


# -- the table beside a tandv log -----------------------------------------------------------------


def test_table_is_written_beside_the_tracker_log_and_read_back():
    from tandv.track.torch import track

    torch.manual_seed(9)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    config = {
        nn.BatchNorm2d: [["MeanTID", "linear(2, 0)"], "VarTID"],
        nn.Linear: ["InputCovMaxEig", "WeightNorm", "RankMe"],
    }
    with (
        track(net, opt, out="log", track_optimizer=False) as tracker,
        Monitor(net, config, out=tracker, flush_every=2) as mon,
    ):
        for _ in range(5):
            net(torch.randn(6, 2, 5, 5)).square().mean().backward()
            mon.track()
            opt.step()
            opt.zero_grad()
            tracker.step()
        assert len(list((tracker.out_path / "taiyi").glob("part-*.parquet"))) == 2  # streamed
    back = read_taiyi(tracker.out_path)
    pd.testing.assert_frame_equal(back, mon.to_dataframe())
    assert taiyi_dir(tracker.out_path) == tracker.out_path / "taiyi"
    assert list(back.columns) == ["step", "module", "module_type", "quantity", "value"]
    assert set(back["step"]) == set(range(5))
    assert back.query("quantity == 'MeanTID'")["step"].tolist() == [0, 2, 4]
    # the tandv log itself still reads (the table's directory is not one of its parts)
    log = tandv.read_log(tracker.out_path)
    assert set(log["metadata"]["step"]) == set(range(5))
    # Taiyi's nested output form holds the same values
    nested = mon.get_output()
    row = back.iloc[0]
    assert nested[row["module"]][row["quantity"]][row["step"]] == row["value"]


def test_table_beside_a_single_file_log_and_errors(tmp_path):
    assert taiyi_dir(tmp_path / "run.pkl") == tmp_path / "run.taiyi"
    lin = nn.Linear(2, 2)
    with Monitor(lin, {nn.Linear: ["WeightNorm"]}, out=tmp_path / "run.pkl") as mon:
        mon.track()
    assert (
        read_taiyi(tmp_path / "run.pkl")["value"].tolist() == mon.to_dataframe()["value"].tolist()
    )
    with pytest.raises(FileExistsError, match="already holds a Taiyi table"):
        with Monitor(lin, {nn.Linear: ["WeightNorm"]}, out=tmp_path / "run.pkl") as again:
            again.track()
    with pytest.raises(FileNotFoundError, match="no Taiyi table"):
        read_taiyi(tmp_path / "elsewhere")


def test_beside_a_distributed_tracker_only_the_writing_rank_writes_the_table(tmp_path):
    """A tracker of a distributed run whose rank does not write its log (``writes_log`` is
    False): the monitor keeps its rows, writes no table; on the writing rank the table is
    written beside the log."""
    from types import SimpleNamespace

    lin = nn.Linear(2, 2)
    for rank, writes in ((1, False), (0, True)):
        log = tmp_path / "log"
        tracker = SimpleNamespace(out_path=log, writes_log=writes)
        with Monitor(lin, {nn.Linear: ["WeightNorm"]}, out=tracker) as mon:
            mon.track()
        assert len(mon.to_dataframe()) == 1, rank
        assert taiyi_dir(log).exists() == writes, rank
    want = torch.linalg.vector_norm(lin.weight.detach()).item()
    assert read_taiyi(tmp_path / "log")["value"].tolist() == pytest.approx([want])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_values_match_the_cpu_run():
    torch.manual_seed(10)
    config = {
        nn.Linear: COV
        + [
            "InputMean",
            "InputSndNorm",
            "OutputGradSndNorm",
            "WeightNorm",
            "LinearDeadNeuronNum",
            "RankMe",
        ],
        nn.BatchNorm2d: ["MeanTID", "VarTID"],
    }
    x = torch.randn(6, 2, 5, 5)
    cpu_net = Net()
    frames = []
    for device in ("cpu", "cuda"):
        net = copy.deepcopy(cpu_net).to(device)
        mon = Monitor(net, config)
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # conv in full float32
            net(x.to(device)).square().sum().backward()
        mon.track()
        frames.append(mon.to_dataframe())
    # fc1 maps 3 features to 4: fc2's input covariance is singular, and its smallest
    # eigenvalue round-off that differs by device: a condition number through it is only
    # known to be huge (seen on an H200: 1.6e14 on the CPU, 3.1e14 on CUDA)
    cpu, cuda = (f["value"].to_numpy() for f in frames)
    singular = cpu > 1e12
    assert singular.sum() == 1 and (cuda[singular] > 1e12).all()
    for f in frames:
        f.loc[singular, "value"] = np.inf
    pd.testing.assert_frame_equal(frames[0], frames[1], rtol=1e-6)


# -- JAX / Flax linen -----------------------------------------------------------------------------


def _flax_model():
    jax = pytest.importorskip("jax")
    fnn = pytest.importorskip("flax.linen")

    class Small(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            h = fnn.relu(fnn.Conv(4, (3, 3), padding="VALID")(x)).mean(axis=(1, 2))
            h = fnn.relu(fnn.Dense(6)(h))  # Dense_0 (Flax numbers modules as they are created)
            return fnn.Dense(3)(h)  # Dense_1

    model = Small()
    x = jax.random.normal(jax.random.key(0), (40, 6, 6, 3)) * jax.numpy.array([1.0, 2.0, 0.5]) + 0.2
    variables = model.init(jax.random.key(1), x)
    return jax, fnn, model, variables, x


def test_jax_quantities_match_numpy_on_the_same_arrays():
    jax, fnn, model, variables, x = _flax_model()
    from tandv.taiyi.jax import JAX_QUANTITIES
    from tandv.taiyi.jax import Monitor as JaxMonitor

    forward = [q for q in JAX_QUANTITIES if q != "LinearDeadNeuronNum"]
    mon = JaxMonitor({fnn.Conv: forward, "Dense": forward + ["LinearDeadNeuronNum"]})
    apply = jax.jit(lambda v, x, due: mon.apply(model, v, x, due=due), static_argnums=2)
    (y, q) = apply(variables, x, mon.due(0))
    mon.track(q)
    got = mon.to_dataframe()
    # the test's own record of each module's input and output
    _, state = model.apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
    inter = state["intermediates"]
    outs = {
        name: np.asarray(inter[name]["__call__"][0], np.float64)
        for name in ("Conv_0", "Dense_0", "Dense_1")
    }
    ins = {
        "Conv_0": np.asarray(x, np.float64),
        "Dense_0": np.maximum(outs["Conv_0"], 0).mean(axis=(1, 2)),
        "Dense_1": np.maximum(outs["Dense_0"], 0),
    }
    params = variables["params"]
    for name in ("Conv_0", "Dense_0", "Dense_1"):
        xin = ins[name].reshape(
            -1, ins[name].shape[-1]
        )  # channels-last: features are the last axis
        z = outs[name].reshape(-1, outs[name].shape[-1])
        want = np_cov_expectation(xin)
        want.update(
            InputMean=xin.mean(),
            InputSndNorm=np.linalg.norm(xin),
            RankMe=np_rankme(z),
            WeightNorm=np.linalg.norm(np.asarray(params[name]["kernel"], np.float64)),
        )
        if name.startswith("Dense"):
            want["LinearDeadNeuronNum"] = (z <= 0).all(axis=0).sum()
        v = values(got, name, 0)
        assert set(v) == set(want), name
        for qn, w in want.items():  # float32 on the device
            assert v[qn] == pytest.approx(w, rel=2e-4, abs=1e-6), (name, qn)


def test_jax_schedules_errors_and_a_module_called_twice():
    jax, fnn, model, variables, x = _flax_model()
    from tandv.taiyi.jax import Monitor as JaxMonitor

    mon = JaxMonitor({"Dense_1": [["WeightNorm", "linear(3, 1)"], "InputMean"]})
    for step in range(8):
        _, q = mon.apply(model, variables, x, due=mon.due(step))
        mon.track(q)
    steps = mon.to_dataframe().groupby("quantity")["step"].apply(list).to_dict()
    assert steps == {"WeightNorm": [1, 4, 7], "InputMean": list(range(8))}

    with pytest.raises(ValueError, match="'OutputGradSndNorm': not available for JAX"):
        JaxMonitor({fnn.Dense: ["OutputGradSndNorm"]})
    with pytest.raises(ValueError, match="Did you mean 'RankMe'"):
        JaxMonitor({fnn.Dense: ["RankMee"]})
    bad = JaxMonitor({"Dense_7": ["InputMean"], fnn.Dense: ["InputMean"]})
    _, q = bad.apply(model, variables, x, due=bad.due(0))
    with pytest.raises(ValueError, match="keys 'Dense_7' matched no module"):
        bad.track(q)
    conv = JaxMonitor({fnn.Conv: ["LinearDeadNeuronNum"]})
    with pytest.raises(
        ValueError, match="defined for nn.Dense modules, but module 'Conv_0' is a Conv"
    ):
        conv.apply(model, variables, x, due=conv.due(0))

    class Twice(fnn.Module):  # one Dense applied to two inputs: both calls count
        @fnn.compact
        def __call__(self, a, b):
            d = fnn.Dense(2)
            return d(a), d(b)

    a, b = (
        jax.random.normal(jax.random.key(2), (5, 3)),
        jax.random.normal(jax.random.key(3), (7, 3)) + 1,
    )
    tw = Twice()
    tv = tw.init(jax.random.key(4), a, b)
    m2 = JaxMonitor({"Dense_0": ["InputMean", "InputCovMaxEig"]})
    _, q = m2.apply(tw, tv, a, b, due=m2.due(0))
    m2.track(q)
    both = np.concatenate([np.asarray(a, np.float64), np.asarray(b, np.float64)])
    v = values(m2.to_dataframe(), "Dense_0")
    assert v["InputMean"] == pytest.approx(both.mean(), rel=1e-5)
    assert v["InputCovMaxEig"] == pytest.approx(
        np_cov_expectation(both)["InputCovMaxEig"], rel=1e-5
    )
