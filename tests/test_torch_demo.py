"""The demo (``tandv demo``) and the model it shares with the benchmarks."""

import pytest
import torch

from tandv.demos import torch_demo
from tandv.demos.torch_gpt import GPT, GPTConfig
from tandv.schema import read_log, read_scalars
from tandv.taiyi import read_taiyi


def test_demo_run_returns_a_log_with_every_tensor_type_at_every_step():
    path = torch_demo.run(steps=3, out="demo_log", seed=1, progress=False)
    assert str(path) == "demo_log"
    df = read_log(path)
    meta = df["metadata"]
    assert sorted(set(meta["step"])) == [0, 1, 2]
    for k in range(3):
        assert set(meta[meta["step"] == k]["tensor_type"]) == {
            "Activation",
            "Gradient",
            "Weight",
            "Optimiser_State",
        }
    names = set(meta["name"])
    assert {
        "root",
        "layers.0.attention.wq",
        "layers.1.mlp.fc1.weight",
        "layers.0.attention.wq.weight.exp_avg_sq",
        "layers.1.mlp.fc1.weight.update",
    } <= names
    scalars = read_scalars(path)
    assert list(scalars.columns) == ["step", "loss", "lr", "grad_norm"] and scalars[
        "step"
    ].tolist() == [0, 1, 2]
    assert (scalars["loss"] > 0).all() and (scalars["grad_norm"] > 0).all()
    taiyi = read_taiyi(path)  # linear(10, 0): of steps 0..2 only step 0 fires
    linears = {
        n
        for n, m in GPT(torch_demo.demo_config(11)).named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    assert set(taiyi["step"]) == {0} and set(taiyi["module"]) == linears
    assert set(taiyi["quantity"]) == {"InputCovStableRank", "RankMe", "OutputGradSndNorm"}
    assert (taiyi["value"] > 0).all()


def test_demo_rejects_bad_steps():
    with pytest.raises(ValueError, match="steps"):
        torch_demo.run(steps=0, progress=False)


def test_gpt_is_causal_and_checks_sequence_length():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=11, seq_len=8, d_model=16, n_layers=1, n_heads=2, d_mlp=32)
    model = GPT(cfg)
    a = torch.randint(0, 11, (1, 8))
    b = a.clone()
    b[0, -1] = (a[0, -1] + 1) % 11  # changing the last token must not change earlier logits
    torch.testing.assert_close(model(a)[:, :-1], model(b)[:, :-1])
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_cli_demo_prints_where_the_log_is(capsys):
    cli = pytest.importorskip("tandv.cli")
    pytest.importorskip("tandv.analysis")
    assert cli.main(["demo", "--steps", "2", "--out", "cli_log", "--no-report"]) == 0
    assert "cli_log" in capsys.readouterr().out
