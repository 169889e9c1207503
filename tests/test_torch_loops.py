"""Real PyTorch loops the tracker must log right (issue 29): several optimizers in one step,
GradScaler with clipping, LBFGS's flat state, checkpointed blocks passing tensors through,
compiled wrappers of a tracked module, and loops that leave nothing to record. Each test
compares the logged rows with what the loop itself used, summarized by the numpy
reference."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from test_torch_tracker import PARAMS, assert_row, batch, index, make
from torch import nn

from tandv.schema import read_log
from tandv.track.torch import track


def grads_of(module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    return {f"{prefix}{n}": p.grad.clone() for n, p in module.named_parameters()}


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 4))
        self.D = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))


@pytest.mark.parametrize("d_steps", [1, 2])
def test_gan_loop_logs_each_parameter_with_its_own_optimizers_gradient(d_steps, tmp_path):
    """D's optimizer steps (``d_steps`` times), then G's after a backward pass that also
    reaches D: D's rows hold the gradients D's optimizer used (both, merged, when it
    stepped twice), not D's gradient after G's backward."""
    torch.manual_seed(0)
    gan = GAN()
    opt_d = torch.optim.SGD(gan.D.parameters(), lr=0.1)
    opt_g = torch.optim.Adam(gan.G.parameters(), lr=0.01)
    used: list[dict[str, list[torch.Tensor]]] = []
    ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)
    with track(gan, [opt_d, opt_g], out=tmp_path / "log", verbose=False) as tr:
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            real, z = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
            step: dict[str, list[torch.Tensor]] = {}
            fake = gan.G(z)
            for _ in range(d_steps):
                opt_d.zero_grad()
                d_loss = F.binary_cross_entropy_with_logits(
                    gan.D(real), ones
                ) + F.binary_cross_entropy_with_logits(gan.D(fake.detach()), zeros)
                d_loss.backward()
                for n, t in grads_of(gan.D, "D.").items():
                    step.setdefault(n, []).append(t)
                opt_d.step()
            opt_g.zero_grad()
            F.binary_cross_entropy_with_logits(gan.D(fake), ones).backward()  # reaches D too
            for n, t in grads_of(gan.G, "G.").items():
                step[n] = [t]
            opt_g.step()
            used.append(step)
            tr.step()
    df = read_log(tr.out_path)
    idx = index(df)
    for k in range(3):
        for name, tensors in used[k].items():
            assert_row(df, idx, (name, "Gradient", k), tensors)


def test_a_separate_embedding_optimizer_and_zeroing_after_each_step(tmp_path):
    """An embedding with its own optimizer, each optimizer zeroing its gradients (to zeros,
    not None) right after its step: every parameter keeps the gradient its optimizer used."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2))
    opt_emb = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt = torch.optim.Adam(model[2].parameters(), lr=0.01)
    used = []
    with track(model, [opt_emb, opt], out=tmp_path / "log", verbose=False) as tr:
        for i in range(2):
            tokens = torch.randint(0, 10, (5, 3), generator=torch.Generator().manual_seed(i))
            F.mse_loss(model(tokens), torch.ones(5, 2)).backward()
            used.append(grads_of(model))
            opt_emb.step()
            opt_emb.zero_grad(set_to_none=False)
            opt.step()
            opt.zero_grad(set_to_none=False)
            tr.step()
    df = read_log(tr.out_path)
    idx = index(df)
    for k in range(2):
        for name in ("0.weight", "2.weight", "2.bias"):
            assert_row(df, idx, (name, "Gradient", k), [used[k][name]])


def test_grad_scaler_skipped_step_logs_the_clipped_gradients_it_was_handed(tmp_path):
    """``unscale_``, clipping, then ``scaler.step``: every step's rows are the gradients
    ``scaler.step`` was handed, after clipping, the skipped step's (NaN found) included:
    one quantity in every row, not the unclipped gradients on the step that skipped."""
    net, opt = make(0, torch.optim.SGD)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    handed = []
    with track(
        net, opt, out=tmp_path / "log", scaler=scaler, track_activations=False, verbose=False
    ) as tr:
        for i in range(3):
            x, y = batch(i)
            if i == 1:
                x[0, 0] = float("inf")
            opt.zero_grad()
            scaler.scale(F.mse_loss(net(x), y)).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            handed.append(grads_of(net))
            scaler.step(opt)
            scaler.update()
            tr.step()
    assert scaler.get_scale() < 2.0**8  # step 1 was skipped
    df = read_log(tr.out_path)
    idx = index(df)
    for k in (0, 2):
        for name in PARAMS:
            assert_row(df, idx, (name, "Gradient", k), [handed[k][name]])
    for name in PARAMS:
        row = df.iloc[idx[(name, "Gradient", 1)]]
        want = handed[1][name]
        assert row[("scalar_stats", "nan_count")] == want.isnan().sum().item()
        assert row[("scalar_stats", "inf_count")] == want.isinf().sum().item()
        assert row[("scalar_stats", "zero_count")] == (want == 0).sum().item()
    assert not {"unscale_", "step"} & set(scaler.__dict__)


def test_lbfgs_flat_state_is_logged_as_optimizer_state(tmp_path):
    """LBFGS keeps its search direction and previous gradient as vectors over all the
    parameters, under the first parameter's state: rows ``optimizer0.<key>`` with the
    vectors' own values, and no row claims to be the first parameter's."""
    net, opt = make(0, torch.optim.LBFGS, lr=0.5, max_iter=3)
    x, y = batch(0)

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(net(x), y)
        loss.backward()
        return loss

    with track(net, opt, out=tmp_path / "log", track_activations=False, verbose=False) as tr:
        opt.step(closure)
        state = opt.state[next(iter(net.parameters()))]
        flat = {k: state[k].clone() for k in ("d", "prev_flat_grad")}
        tr.step()
    total = sum(p.numel() for p in net.parameters())
    assert all(v.numel() == total for v in flat.values())
    df = read_log(tr.out_path)
    idx = index(df)
    for k, v in flat.items():
        assert_row(df, idx, (f"optimizer0.{k}", "Optimiser_State", 0), [v])
    states = df[df[("metadata", "tensor_type")] == "Optimiser_State"]
    assert not any(n.startswith("fc1.weight.") for n in states[("metadata", "name")])


def test_adam_state_stays_per_parameter(tmp_path):
    """Per-parameter state keeps its parameter's name (the LBFGS rule only moves vectors
    over all the parameters)."""
    net, opt = make(0, torch.optim.Adam)
    with track(net, opt, out=tmp_path / "log", track_activations=False, verbose=False) as tr:
        x, y = batch(0)
        F.mse_loss(net(x), y).backward()
        opt.step()
        tr.step()
    states = set(read_log(tr.out_path).pipe(lambda d: d[("metadata", "name")]))
    assert {f"{p}.{k}" for p in PARAMS for k in ("exp_avg", "exp_avg_sq")} <= states


def test_zero_grad_before_step_without_optimizer_is_told_once(tmp_path):
    """No ``optimizer=`` and ``zero_grad()`` before ``tracker.step()``: nothing is left to
    record for parameter gradients; the tracker says so once, naming the fix."""
    net, opt = make(0, torch.optim.SGD)
    with pytest.warns(RuntimeWarning, match="no parameter gradient.*zero_grad") as record:
        with track(net, out=tmp_path / "log", verbose=False) as tr:
            for i in range(3):
                x, y = batch(i)
                F.mse_loss(net(x), y).backward()
                opt.step()
                opt.zero_grad()
                tr.step()
    told = [w for w in record if "tandv" in str(w.message)]
    assert len(told) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the right order: nothing to tell
        with track(net, out=tmp_path / "log2", verbose=False) as tr:
            x, y = batch(0)
            F.mse_loss(net(x), y).backward()
            opt.step()
            tr.step()
            opt.zero_grad()


def test_eager_tracking_of_a_model_trained_through_torch_compile(tmp_path):
    """``track(model)`` while ``torch.compile(model)`` trains: tandv's hooks do nothing
    inside the graph (no graph break, nothing of tandv traced), the weights and gradients
    are those the optimizer used, and the missing activations are told once."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    net, opt = make(0, torch.optim.SGD)
    compiled = torch.compile(net, backend="eager")
    used = []
    with pytest.warns(RuntimeWarning, match="no activation.*torch.compile"):
        with track(net, opt, out=tmp_path / "log", verbose=False) as tr:
            for i in range(3):
                x, y = batch(i)
                weights = {n: p.detach().clone() for n, p in net.named_parameters()}
                F.mse_loss(compiled(x), y).backward()
                used.append((weights, grads_of(net)))
                opt.step()
                opt.zero_grad()
                tr.step()
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1  # no recompilation across steps
    df = read_log(tr.out_path)
    idx = index(df)
    for k in range(3):
        for name in PARAMS:
            assert_row(df, idx, (name, "Weight", k), [used[k][0][name]])
            assert_row(df, idx, (name, "Gradient", k), [used[k][1][name]])
    torch._dynamo.reset()


class _Attention(nn.Module):
    """Returns its position bias, computed by the first layer and passed on (like T5)."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.rel = nn.Parameter(torch.randn(3, 3)) if first else None

    def forward(self, h, position_bias=None):
        if position_bias is None:
            position_bias = self.rel * 2.0
        scores = self.q(h) @ h.transpose(-1, -2) + position_bias
        return scores.softmax(-1) @ h, position_bias


class _Block(nn.Module):
    def __init__(self, first: bool) -> None:
        super().__init__()
        self.attn = _Attention(first)
        self.ff = nn.Linear(4, 4)

    def forward(self, h, position_bias=None):
        a, position_bias = self.attn(h, position_bias)
        return torch.tanh(self.ff(a)) + h, position_bias


class _T5Like(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(i == 0) for i in range(3)])
        self.reentrant = reentrant

    def forward(self, h):
        from torch.utils.checkpoint import checkpoint

        bias = None
        for block in self.blocks:
            if self.reentrant is None:
                h, bias = block(h, bias)
            else:
                h, bias = checkpoint(block, h, bias, use_reentrant=self.reentrant)
        return h


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_tensor_passed_through_checkpointed_blocks_is_counted_once(reentrant, tmp_path):
    """The position bias that every checkpointed block takes and returns: each output
    gradient row holds its tensor once (the recomputation hooks neither the tensor again nor
    reentrant checkpointing's detached copy of it), with the values of the same model run
    without checkpointing (captured by the test's own hooks). Under reentrant
    checkpointing a block returns the copy the checkpoint handed it, whose gradient leaves
    out the uses before the block: only its size is compared there."""
    torch.manual_seed(0)
    plain = _T5Like(None)
    x = torch.randn(2, 3, 4, requires_grad=True)
    want: dict[str, torch.Tensor] = {}

    def capture(name):
        def hook(mod, args, out):
            for i, t in enumerate(out if isinstance(out, tuple) else (out,)):
                key = f"{name}[{i}]" if isinstance(out, tuple) else name
                t.register_hook(lambda g, key=key: want.__setitem__(key, g.clone()))

        return hook

    handles = [m.register_forward_hook(capture(n)) for n, m in plain.named_modules() if n]
    plain(x).square().mean().backward()
    for h in handles:
        h.remove()
    model = _T5Like(reentrant)
    model.load_state_dict(plain.state_dict())
    with track(model, out=tmp_path / "log", track_activations=False, verbose=False) as tr:
        model(x).square().mean().backward()
        tr.step()
    df = read_log(tr.out_path)
    idx = index(df)
    passed = [n for n in want if n.endswith("[1]")]
    assert len(passed) == 6
    for name, g in want.items():
        if reentrant and name in passed:
            row = df.iloc[idx[(name, "Gradient", 0)]]
            assert row[("scalar_stats", "numel")] == g.numel(), name
        else:
            assert_row(df, idx, (name, "Gradient", 0), [g])
    for name, p in plain.named_parameters():
        assert_row(df, idx, (name, "Gradient", 0), [p.grad])
