"""A step's batches (issue 27): the weights, the parameter gradients and the optimizer state
are each summarized together, with their names, row keys and layouts found once and the
entries of a step kept for the next while the rows come back at the same places. The
rows stay those of each tensor as it was used, summarized by the numpy reference, step
after step, as gradients come and go, the optimizer's state tensors are replaced, and the
model's parameters are replaced or its layers added."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from test_torch_tracker import (
    PARAMS,
    _interpreted_only,
    any_path,  # noqa: F401 (the fixture: host and fused paths)
    assert_row,
    batch,
    index,
    make,
)

from tandv.schema import read_log
from tandv.track.torch import summary as kernel
from tandv.track.torch import track
from tandv.track.torch import tracker as tracker_module
from tandv.track.torch._workspace import BatchLaunch, tensor_guard


def _train_changing(tmp_path, net, opt, steps: int = 4, before=None, after_backward=None):
    """Train ``net`` tracked for ``steps`` steps, calling ``before(i)`` before step
    ``i``'s forward and ``after_backward(i)`` between its backward pass and the update,
    and check that every weight, gradient and Adam-moment row is the numpy reference's
    summary of the tensor the test itself read at that step (a parameter without a
    gradient has no gradient row to check). Returns the log, its index and what was
    read, after a collection (so that what only the tracker could keep is gone)."""
    used: list[dict[tuple[str, str], torch.Tensor]] = []
    with track(net, opt, out=tmp_path / "log", verbose=False) as tr:
        for i in range(steps):
            if before is not None:
                before(i)
            step: dict[tuple[str, str], torch.Tensor] = {}
            for name, p in net.named_parameters():
                step[(name, "Weight")] = p.detach().clone()
            x, y = batch(i)
            opt.zero_grad(set_to_none=True)
            F.mse_loss(net(x), y).backward()
            if after_backward is not None:
                after_backward(i)
            for name, p in net.named_parameters():
                if p.grad is not None:
                    step[(name, "Gradient")] = p.grad.clone()
            opt.step()
            for name, p in net.named_parameters():
                for key in ("exp_avg", "exp_avg_sq"):
                    step[(f"{name}.{key}", "Optimiser_State")] = opt.state[p][key].clone()
            used.append(step)
            tr.step()
        gc.collect()
    df = read_log(tr.out_path)
    idx = index(df)
    for k, step in enumerate(used):
        for (name, kind), t in step.items():
            assert_row(df, idx, (name, kind, k), [t])
    return df, idx, used


@pytest.mark.usefixtures("any_path")
def test_batch_rows_follow_the_tensors_as_gradients_come_and_go_and_state_is_replaced(tmp_path):
    """Steps 0-1 plain; step 2 without ``fc2.bias``'s gradient (set to ``None`` before the
    update: no row, and Adam leaves its state alone); step 3 after ``load_state_dict`` gave
    the optimizer new state tensors (the old ones kept alive, unchanged from step 2: their
    values would be the wrong rows); step 4 plain again."""
    net, opt = make(0)
    kept_alive = []

    def after_backward(i: int) -> None:
        if i == 2:
            net.fc2.bias.grad = None
        if i == 3:
            kept_alive.append(opt.state_dict())  # (the state tensors of step 2)
            opt.load_state_dict(copy.deepcopy(kept_alive[-1]))

    _, idx, used = _train_changing(tmp_path, net, opt, steps=5, after_backward=after_backward)
    assert ("fc2.bias", "Gradient", 2) not in idx
    assert all((name, "Gradient", 2) in idx for name in PARAMS if name != "fc2.bias")
    # the replaced state moved on at step 3: its rows are not those of the tensors kept
    old = kept_alive[0]["state"][0]["exp_avg"]
    new = used[3][("fc1.weight.exp_avg", "Optimiser_State")]
    assert not torch.equal(old, new)


@pytest.mark.parametrize("guarded", [True, False], ids=["guard", "no-guard"])
def test_a_prepared_batch_notices_tensors_changed_in_place(tmp_path, monkeypatch, guarded):
    """The fused path keeps a batch's launch (its table and slots) while its tensors are
    the same ones at the same addresses with the same sizes: a parameter whose data is
    replaced (``p.data = ...``: a new address), shrunk where it lies (same address, fewer
    elements), made a transposed view of itself (same address and size, not contiguous)
    or a lazily negated one (same address, size and strides) between steps gets the rows
    of what it is at each step, by the numpy reference. With the tensor guard that
    spares a steady state's questions, and without it (a torch that has none)."""
    _interpreted_only("fused")
    if not guarded:
        monkeypatch.setattr(tracker_module, "tensor_guard", lambda tensors: None)
    net, _ = make(0)
    used: list[dict[str, torch.Tensor]] = []
    changes = {
        2: ("fc1.weight", lambda w: w * 2.0),  # a new tensor (a new address)
        3: ("fc2.bias", lambda b: b[:2]),  # the same address, fewer elements
        4: ("fc1.weight", lambda w: w.t()),  # the same address and size, not contiguous
        5: ("fc1.weight", lambda w: w.t()),  # contiguous again, at the same address
        7: ("fc1.weight", torch._neg_view),  # negated lazily: the same address and strides
        8: ("fc1.weight", torch._neg_view),  # not negated again
    }
    options = dict(track_activations=False, track_gradients=False, track_optimizer=False)
    with (
        kernel.cpu_path("fused"),
        track(net, out=tmp_path / "log", verbose=False, **options) as tr,
    ):
        for i in range(10):
            if i in changes:
                name, change = changes[i]
                p = net.get_parameter(name)
                p.data = change(p.data)
            used.append({n: p.detach().clone() for n, p in net.named_parameters()})
            tr.step()  # (no forward: the weights are captured here)
    df = read_log(tr.out_path)
    idx = index(df)
    for k, step in enumerate(used):
        for name, t in step.items():
            assert_row(df, idx, (name, "Weight", k), [t])
    assert int(df.iloc[idx[("fc2.bias", "Weight", 3)]][("scalar_stats", "numel")]) == 2


class _Sub(torch.Tensor):
    """A tensor subclass (a tensor's class may be assigned in place)."""


def test_a_tensor_guard_fails_at_every_change_a_batch_launch_depends_on():
    """:func:`tensor_guard` passes the tensors it was made of, and tensors like them (other
    objects, other addresses), and fails at each change the batch launch would otherwise
    ask each tensor about: strides (a transposed view of itself at the same address),
    size, dtype, lazy negation, the Python class, ``requires_grad``, one object passed
    twice, or something that is not a tensor."""
    a, b, p = torch.randn(4, 5), torch.randn(4, 5), torch.nn.Parameter(torch.randn(3))
    check = tensor_guard([a, b, p])
    assert check is not None, "this torch has no usable TensorGuards"
    assert check(a, b, p)
    assert check(a.clone(), b * 2, torch.nn.Parameter(torch.ones(3)))  # others like them
    sub = b.clone()
    sub.__class__ = _Sub
    changed = {
        "strides": (a, b.t().contiguous().t(), p),
        "size": (a, b[:3], p),
        "dtype": (a, b.double(), p),
        "lazy negation": (a, torch._neg_view(b), p),
        "class": (a, sub, p),
        "plain tensor for a parameter": (a, b, p.detach()),
        "requires_grad": (a, b, torch.nn.Parameter(torch.randn(3), requires_grad=False)),
        "one object twice": (a, a, p),
        "not a tensor": (a, None, p),
    }
    for what, args in changed.items():
        assert not check(*args), what
    assert tensor_guard([a, None]) is None  # (what it cannot guard: no guard, no error)


def test_the_guard_is_tried_again_after_a_context_that_refused_its_test(monkeypatch):
    """The guard's test (which makes small tensors) run inside a dispatch mode that refuses
    every operation gives no guard for that batch, and is not taken as the answer: outside
    the mode the next try finds the guard."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tandv.track.torch import _workspace

    class Refuse(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            raise RuntimeError(f"refused: {func}")

    monkeypatch.setattr(_workspace, "_guard_found", [])
    a, b = torch.randn(3), torch.randn(3)
    with Refuse():
        assert tensor_guard([a, b]) is None
    check = tensor_guard([a, b])
    assert check is not None and check(a, b) and not check(a, a)


def test_a_steady_state_batch_asks_its_tensors_only_their_addresses(tmp_path, monkeypatch):
    """In a plain loop on the fused path, from the second step on, every batch (weights,
    gradients, optimizer state) passes its :func:`tensor_guard` and its launch is handed
    the sizes (it reads only the addresses), and the rows stay the numpy reference's."""
    _interpreted_only("fused")
    calls: list[tuple[int, bool]] = []
    original = BatchLaunch.summarize

    def spy(self, tensors, sizes=None):
        calls.append((len(tensors), sizes is not None))
        return original(self, tensors, sizes)

    monkeypatch.setattr(BatchLaunch, "summarize", spy)
    net, opt = make(0)
    with kernel.cpu_path("fused"):
        _train_changing(tmp_path, net, opt, steps=4)
    # a step's weights, gradients and state (both moments of each parameter): a launch each
    n = len(PARAMS)
    assert [count for count, _ in calls] == [n, n, 2 * n] * 4
    assert not any(guarded for _, guarded in calls[:3])  # (the first: no guard yet)
    assert all(guarded for _, guarded in calls[6:]), calls


def _state_changed_after_update(tmp_path, net, opt, change, steps: int = 2):
    """``steps`` tracked steps of ``net``, ``change(i)`` called after step ``i``'s update
    (before ``tracker.step()`` summarizes the state); the log and its index."""
    with track(net, opt, out=tmp_path / "log", verbose=False) as tr:
        for i in range(steps):
            x, y = batch(i)
            opt.zero_grad(set_to_none=True)
            F.mse_loss(net(x), y).backward()
            opt.step()
            change(i)
            tr.step()
    df = read_log(tr.out_path)
    return df, index(df)


@pytest.mark.usefixtures("any_path")
def test_state_rows_follow_a_value_moved_to_another_parameters_state(tmp_path):
    """The optimizer state's batch is kept while the state holds the same tensors in the
    same order under the same parameters. After step 1's update, ``fc1.bias``'s
    ``exp_avg_sq`` is moved to the front of ``fc2.weight``'s state (a new dict, as
    ``moved``): the flattened values keep their order (the two parameters' states lie
    next to each other), but the tensor is now another parameter's, so step 1's rows name
    it ``fc2.weight.moved`` and ``fc1.bias`` has no ``exp_avg_sq`` row there."""
    net, opt = make(0)
    params = dict(net.named_parameters())
    moved = []

    def move(i: int) -> None:
        if i != 1:
            return
        order = [id(p) for p in opt.state]
        a, b = params["fc1.bias"], params["fc2.weight"]
        assert order.index(id(b)) == order.index(id(a)) + 1  # (neighbours)
        value = opt.state[a].pop("exp_avg_sq")
        opt.state[b] = {"moved": value, **opt.state[b]}
        moved.append(value.clone())

    df, idx = _state_changed_after_update(tmp_path, net, opt, move)
    assert ("fc1.bias.exp_avg_sq", "Optimiser_State", 0) in idx
    assert ("fc1.bias.exp_avg_sq", "Optimiser_State", 1) not in idx
    assert ("fc2.weight.moved", "Optimiser_State", 0) not in idx
    assert_row(df, idx, ("fc2.weight.moved", "Optimiser_State", 1), moved)


@pytest.mark.usefixtures("any_path")
def test_state_rows_follow_a_key_renamed_over_the_same_value(tmp_path):
    """After step 1's update every parameter's last state entry, ``exp_avg_sq``, is put
    back under another key (``v``): the same tensors, in the same order, under the same
    parameters, so only the key tells. Step 1's rows name them by the new key."""
    net, opt = make(0)
    renamed = {}

    def rename(i: int) -> None:
        if i != 1:
            return
        for name, p in net.named_parameters():
            state = opt.state[p]
            assert list(state)[-1] == "exp_avg_sq"  # (the last: the order is kept)
            state["v"] = state.pop("exp_avg_sq")
            renamed[name] = state["v"].clone()

    df, idx = _state_changed_after_update(tmp_path, net, opt, rename)
    assert renamed
    for name, value in renamed.items():
        assert (f"{name}.exp_avg_sq", "Optimiser_State", 0) in idx
        assert (f"{name}.exp_avg_sq", "Optimiser_State", 1) not in idx
        assert_row(df, idx, (f"{name}.v", "Optimiser_State", 1), [value])


def test_a_state_key_that_is_not_a_string_names_its_rows_as_a_string(tmp_path):
    """A state value under a key that is not a string (here a tensor, a new one at each
    step: comparing two of them gives no single truth value) is still summarized, under
    the key's string, at every step; the batch found again when the key changes."""
    net, opt = make(0)
    p = dict(net.named_parameters())["fc1.bias"]
    values = []

    def new_key(i: int) -> None:
        state = opt.state[p]
        for key in [k for k in state if isinstance(k, torch.Tensor)]:
            del state[key]
        value = torch.full((4,), float(i + 1))
        state[torch.tensor([1.0, 2.0])] = value
        values.append(value.clone())

    df, idx = _state_changed_after_update(tmp_path, net, opt, new_key, steps=3)
    name = f"fc1.bias.{torch.tensor([1.0, 2.0])}"
    for i, value in enumerate(values):
        assert_row(df, idx, (name, "Optimiser_State", i), [value])


def _position(params: list[torch.Tensor], p: torch.Tensor) -> int:
    """Where ``p`` itself is in ``params`` (``list.index`` compares tensors' values)."""
    return next(k for k, q in enumerate(params) if q is p)


@pytest.mark.usefixtures("any_path")
def test_rows_follow_a_parameter_replaced_between_steps(tmp_path):
    """Step 2 starts with ``fc1.weight`` replaced by a new parameter (and in the optimizer
    in its place): its weight, gradient and state rows from step 2 are the new tensor's,
    by the numpy reference (they were the old one's, which the tracker kept alive), and
    the tracker no longer holds the old parameter."""
    net, opt = make(0)
    released = []

    def change(i: int) -> None:
        if i == 2:
            old = net.fc1.weight
            new = torch.nn.Parameter(torch.linspace(-3.0, 5.0, old.numel()).reshape(old.shape))
            net.fc1.weight = new
            group = opt.param_groups[0]["params"]
            group[_position(group, old)] = new
            opt.state.pop(old, None)
            released.append(weakref.ref(old))

    df, idx, _ = _train_changing(tmp_path, net, opt, before=change)
    assert [r() for r in released] == [None]  # (nothing keeps the old one)
    row = df.iloc[idx[("fc1.weight", "Weight", 2)]]
    assert row[("scalar_stats", "max")] == 5.0  # (the new values: a check of the reference)


class Stack(torch.nn.Module):
    """Layers applied in turn: a model that grows by appending one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.usefixtures("any_path")
def test_rows_follow_a_layer_added_between_steps(tmp_path):
    """A layer appended (and its parameters given to the optimizer) before step 2 has
    activation, output-gradient, weight and gradient rows from step 2 on, by the numpy
    reference of what the test's own hooks saw; none before."""
    net = Stack()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    seen: dict[tuple[str, str, int], torch.Tensor] = {}
    now = [0]  # the step under way, for the test's own hooks
    with track(net, opt, out=tmp_path / "log", verbose=False) as tr:
        for i in range(4):
            now[0] = i
            if i == 2:
                net.layers.append(torch.nn.Linear(6, 6))
                opt.add_param_group({"params": list(net.layers[2].parameters())})
                layer = net.layers[2]

                def keep(mod, args, out):
                    seen[("layers.2", "Activation", now[0])] = out.detach().clone()
                    out.register_hook(
                        lambda g: seen.__setitem__(("layers.2", "Gradient", now[0]), g.clone())
                    )

                layer.register_forward_hook(keep)
            if i >= 2:
                seen[("layers.2.weight", "Weight", i)] = net.layers[2].weight.detach().clone()
            x, _ = batch(i)
            opt.zero_grad(set_to_none=True)
            net(x).pow(2).mean().backward()
            if i >= 2:
                seen[("layers.2.weight", "Gradient", i)] = net.layers[2].weight.grad.clone()
            opt.step()
            tr.step()
    df = read_log(tr.out_path)
    idx = index(df)
    for key, t in seen.items():
        assert_row(df, idx, key, [t])
    for i in (0, 1):
        assert not [k for k in idx if k[0].startswith("layers.2") and k[2] == i]
    assert {k[1] for k in idx if k[0].startswith("layers.2") and k[2] == 3} >= {
        "Activation",
        "Gradient",
        "Weight",
    }


@pytest.mark.usefixtures("any_path")
def test_gradient_rows_are_those_of_what_each_optimizer_updated(tmp_path):
    """The parameters an optimizer updated in a step are those its lists held at its
    update, whatever they hold at ``tracker.step()``: ``fc2``'s group added after step 1's
    update was not updated then, so its gradients are captured at ``tracker.step()`` (as
    those of a parameter no optimizer holds); the group dropped after step 2's update was
    updated, so its gradients are captured once, by the optimizer's hook, not a second
    time at ``tracker.step()``. Every step has one gradient row per parameter, the numpy
    reference's summary of the gradient the test read."""
    net, _ = make(0)
    opt = torch.optim.SGD(net.fc1.parameters(), lr=0.1)
    seen: dict[tuple[str, str, int], torch.Tensor] = {}
    with track(net, opt, out=tmp_path / "log", verbose=False) as tr:
        for i in range(4):
            x, y = batch(i)
            opt.zero_grad(set_to_none=True)
            net.zero_grad(set_to_none=True)
            F.mse_loss(net(x), y).backward()
            for name, p in net.named_parameters():
                seen[(name, "Gradient", i)] = p.grad.clone()
            opt.step()
            if i == 1:
                opt.add_param_group({"params": list(net.fc2.parameters())})
            if i == 2:
                del opt.param_groups[1]
            tr.step()
    df = read_log(tr.out_path)
    idx = index(df)
    for key, t in seen.items():
        assert_row(df, idx, key, [t])  # (a gradient counted twice has twice its numel)
    gradient_rows = [k for k in idx if k[1] == "Gradient" and k[0] in PARAMS]
    assert len(gradient_rows) == 4 * len(PARAMS)


@pytest.mark.usefixtures("any_path")
def test_rows_follow_parameters_changed_without_a_registration(tmp_path):
    """Changes PyTorch's registration hooks do not report: before step 2, ``fc1.bias`` put
    straight into ``fc1._parameters`` (as ``Module._apply`` does in PyTorch's overwrite
    mode); before step 3, ``fc2.bias`` set to ``None``. Step 2's rows are the new bias's,
    step 3 has no ``fc2.bias`` row, and the tracker holds neither old bias."""
    net, opt = make(0)
    released = []
    group = opt.param_groups[0]["params"]

    def change(i: int) -> None:
        if i == 2:
            old = net.fc1.bias
            new = torch.nn.Parameter(torch.arange(old.numel(), dtype=old.dtype) - 2.5)
            net.fc1._parameters["bias"] = new
            group[_position(group, old)] = new
            opt.state.pop(old, None)
            released.append(weakref.ref(old))
        if i == 3:
            old = net.fc2.bias
            net.fc2.bias = None
            del group[_position(group, old)]
            opt.state.pop(old, None)
            released.append(weakref.ref(old))

    df, idx, _ = _train_changing(tmp_path, net, opt, before=change)
    assert [r() for r in released] == [None, None]
    assert not [key for key in idx if key[0].startswith("fc2.bias") and key[2] == 3]
    assert df.iloc[idx[("fc1.bias", "Weight", 2)]][("scalar_stats", "min")] == -2.5
