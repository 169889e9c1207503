"""Taiyi's quantities for PyTorch models: a :class:`Monitor` that takes Taiyi's config,
hooks the selected modules, computes the quantities on their device and stores one row per
step, module and quantity (beside a tandv log when given one).

How the data is taken (the definitions are in :data:`tandv.taiyi.QUANTITIES`):

* **Features.** Input covariance, RankMe and dead-neuron counts see a tensor as a matrix
  of samples x features. The feature axis is the channel axis (dim 1) for convolutions,
  BatchNorm, InstanceNorm and GroupNorm, and the last axis for every other module; every
  other axis counts as samples, so a ``Conv2d`` input ``(N, C, H, W)`` is the ``(N*H*W, C)``
  matrix of its pixels' channel vectors and a ``Linear`` input ``(B, T, D)`` is ``(B*T, D)``.
* **Which passes.** The training-mode forward passes (and their backward passes) between
  two calls of :meth:`Monitor.track`; evaluation-mode passes and the recomputations of
  activation checkpointing are ignored. Several passes in one step (gradient accumulation)
  are merged exactly: covariances with Chan's pairwise update, Gram matrices, sums and
  sums of squares by addition, dead neurons as units dead in every pass.
* **Device.** Everything is computed on the tensor's device in float64; a step's values
  are stacked and copied to the host once per device (``eigvalsh`` runs once per distinct
  feature width per step, batched over the modules of that width).
* **MeanTID / VarTID** keep each training batch's per-channel mean and standard deviation
  (two vectors per batch) every step, and average the discrepancies to the running
  statistics over the batches since they were last computed (Taiyi's multi-step quantities).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.instancenorm import _InstanceNorm

from ..track.torch.tracker import in_backward
from ._core import (
    QUANTITIES,
    Schedule,
    TableWriter,
    UserQuantity,
    finalize_cov_eigs,
    key_text,
    parse_quantity_list,
    rankme_from_singular_values,
    user_quantities,
)

__all__ = ["Monitor", "resolve_config", "feature_matrix"]

_CHANNEL_FIRST = (_ConvNd, _BatchNorm, _InstanceNorm, nn.GroupNorm)


def feature_matrix(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """``x`` as a float64 (samples x features) matrix: features along dim 1 for
    convolutions and normalization layers with channels first, along the last dim
    otherwise; a 1-d tensor is one sample."""
    x = x.detach()
    if x.dim() <= 1:
        return x.reshape(1, -1).double()
    if isinstance(module, _CHANNEL_FIRST):
        x = x.movedim(1, -1)
    return x.reshape(-1, x.shape[-1]).double()


# -- configuration --------------------------------------------------------------------------------


@dataclass
class _Entry:
    name: str
    schedule: Schedule
    schedule_text: str
    key: str  # the config key it came from, for messages


def _matches(model: nn.Module, key: Any, root_name: str) -> list[tuple[str, nn.Module]]:
    mods = [(name or root_name, m) for name, m in model.named_modules()]
    where = key_text(key, "torch.nn")
    if isinstance(key, type):
        if not issubclass(key, nn.Module):
            raise TypeError(
                f"config key {where}: a class key must be an nn.Module subclass "
                f"(such as nn.Linear), got {key.__name__}"
            )
        hits = [(n, m) for n, m in mods if isinstance(m, key)]
        if not hits:
            present = sorted({type(m).__name__ for _, m in mods})
            raise ValueError(
                f"config key {where}: the model has no {key.__name__} module; its module "
                f"types are {present}. Remove the key or fix the class."
            )
        return hits
    if isinstance(key, str):
        by_name = [(n, m) for n, m in mods if n == key]
        if by_name:
            return by_name
        by_class = [(n, m) for n, m in mods if type(m).__name__ == key]
        if by_class:
            return by_class
        names = [n for n, _ in mods][:8]
        present = sorted({type(m).__name__ for _, m in mods})
        raise ValueError(
            f"config key {key!r}: no module of the model is named {key!r} and none is of a "
            f"class named {key!r}. Use a module path (such as {names}) or a class name "
            f"present in the model ({present})."
        )
    raise TypeError(
        f"config key {key!r}: expected a module path ('fc1'), a class name ('Conv2d') or "
        f"an nn.Module class (nn.Conv2d), got {type(key).__name__}"
    )


def _needs(q: str, user: Mapping[str, UserQuantity]) -> str:
    """What quantity ``q`` (built-in or user-defined) is computed from."""
    return QUANTITIES[q].needs if q in QUANTITIES else user[q].needs


def _check_applies(
    qname: str, path: str, module: nn.Module, where: str, user: Mapping[str, UserQuantity]
) -> None:
    kind = type(module).__name__
    if _needs(qname, user) == "weight" and not isinstance(
        getattr(module, "weight", None), torch.Tensor
    ):
        raise ValueError(
            f"config[{where}] quantity {qname!r}: module {path!r} ({kind}) has no weight "
            f"tensor; {qname} applies to modules with a .weight (Linear, Conv, norms)."
        )
    if qname not in QUANTITIES:
        return
    spec = QUANTITIES[qname]
    if spec.modules == "linear" and not isinstance(module, nn.Linear):
        raise ValueError(
            f"config[{where}] quantity {qname!r}: defined for nn.Linear modules, but "
            f"module {path!r} is a {kind}; list it under nn.Linear."
        )
    if spec.modules == "batchnorm" and not (
        isinstance(module, _BatchNorm) and module.track_running_stats
    ):
        raise ValueError(
            f"config[{where}] quantity {qname!r}: defined for BatchNorm modules with running "
            f"statistics (track_running_stats=True), but module {path!r} is a {kind}"
            + (" without running statistics" if isinstance(module, _BatchNorm) else "")
            + "; list it under nn.BatchNorm1d/2d/3d."
        )


def resolve_config(
    model: nn.Module,
    config: Mapping[Any, Any],
    root_name: str = "root",
    user: Mapping[str, UserQuantity] | None = None,
) -> dict[str, tuple[nn.Module, list[_Entry]]]:
    """Which quantities, on which schedules, each module of ``model`` gets from a Taiyi config.

    Arguments:
        model: the model.
        config: ``{key: [quantity, ...]}`` with keys a module path (``'fc1'``), a class name
            (``'Conv2d'``: every module of exactly that class; a module path of the same
            spelling wins) or an ``nn.Module`` class (``nn.BatchNorm2d``: every instance,
            subclasses included), and quantities as
            ``'Name'``, ``['Name']`` or ``['Name', 'linear(interval, offset)']``.
        root_name: the name of the root module (its path is empty in PyTorch).
        user: user-defined quantities by name, which the config may also list.

    Returns:
        ``{module path: (module, entries)}`` in the model's module order.

    Raises:
        ValueError / TypeError: naming the config key, the quantity and what to do, for an
            unknown quantity, a key that selects nothing, a quantity that does not apply to
            a selected module, or one module given one quantity by two keys with different
            schedules.
    """
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config: expected a dict {{module key: [quantities]}}, got {type(config).__name__}"
        )
    user = dict(user or {})
    order = {(name or root_name): i for i, (name, _) in enumerate(model.named_modules())}
    plan: dict[str, tuple[nn.Module, dict[str, _Entry]]] = {}
    for key, value in config.items():
        where = key_text(key, "torch.nn")
        items = parse_quantity_list(value, where, extra=user)
        for path, module in _matches(model, key, root_name):
            entries = plan.setdefault(path, (module, {}))[1]
            for qname, sched, text in items:
                _check_applies(qname, path, module, where, user)
                old = entries.get(qname)
                if old is not None:
                    if old.schedule_text != text:
                        raise ValueError(
                            f"config: module {path!r} gets {qname!r} from key {old.key} "
                            f"({old.schedule_text}) "
                            f"and from key {where} ({text}); give it under one key only"
                        )
                    continue
                entries[qname] = _Entry(qname, sched, text, where)
    return {
        p: (m, list(e.values())) for p, (m, e) in sorted(plan.items(), key=lambda kv: order[kv[0]])
    }


# -- per-module accumulation ----------------------------------------------------------------------


@dataclass
class _Acc:
    """What one module's hooks gathered in the current step (all on the module's device)."""

    cov_n: int = 0
    cov_mean: torch.Tensor | None = None
    cov_m2: torch.Tensor | None = None
    in_sum: torch.Tensor | None = None
    in_count: int = 0
    in_sq: torch.Tensor | None = None
    grad_sq: torch.Tensor | None = None
    alive: torch.Tensor | None = None
    gram: torch.Tensor | None = None
    gram_n: int = 0  # samples (rows of Z) summed into gram
    user: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # per-pass values


@dataclass
class _Watch:
    path: str
    module: nn.Module
    entries: list[_Entry]
    user: Mapping[str, UserQuantity]
    active: set[str] = field(default_factory=set)  # quantities firing at the current step
    acc: _Acc = field(default_factory=_Acc)
    bn_mu: list[torch.Tensor] = field(default_factory=list)  # per batch, since MeanTID last fired
    bn_sigma: list[torch.Tensor] = field(default_factory=list)  # per batch, since VarTID last fired

    @property
    def keeps_batches(self) -> bool:
        """Whether MeanTID/VarTID need this module's batch statistics at every step."""
        return any(_needs(e.name, self.user) == "bn_batch" for e in self.entries)

    def needs(self, *what: str) -> bool:
        return any(_needs(q, self.user) in what for q in self.active)

    def user_active(self, needs: str) -> list[UserQuantity]:
        """The user-defined quantities firing now that are computed from ``needs``."""
        return [self.user[q] for q in self.active if q in self.user and self.user[q].needs == needs]


def _tensor(m: nn.Module, name: str) -> torch.Tensor:
    """The tensor attribute ``name`` of ``m`` (a parameter or buffer: typed so for mypy)."""
    return cast(torch.Tensor, getattr(m, name))


def _add(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else a + b


def _number(uq: UserQuantity, v: Any, like: torch.Tensor) -> torch.Tensor:
    """A user quantity's value as a float64 0-dim tensor on ``like``'s device (no sync)."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(
                f"UserQuantity {uq.name!r}: fn returned a tensor of shape {tuple(v.shape)}; "
                f"it must return one number (reduce it, e.g. with .max() or .norm())"
            )
        return v.detach().reshape(()).double()
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return torch.tensor(float(v), dtype=torch.float64, device=like.device)
    raise TypeError(
        f"UserQuantity {uq.name!r}: fn returned {type(v).__name__}; expected a one-element "
        f"tensor or a number"
    )


def _keep(acc: _Acc, uq: UserQuantity, t: torch.Tensor, module: nn.Module) -> None:
    """Compute a user quantity on one pass's tensor and keep its value for the step."""
    acc.user.setdefault(uq.name, []).append(_number(uq, uq.fn(t, module), t))


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
    return None


class Monitor(TableWriter):
    """Taiyi's ``Monitor``: computes Taiyi's quantities for the modules a config selects.

    Use it as Taiyi's (``monitor.track(step)`` after the backward pass, ``get_output()``)
    or beside tandv's tracker, writing its table next to the tracker's log::

        with track(model, opt) as tracker, Monitor(model, config, out=tracker) as monitor:
            for x, y in data:
                loss_fn(model(x), y).backward()
                monitor.track()          # before zero_grad (OutputGradSndNorm needs the pass)
                opt.step(); opt.zero_grad(); tracker.step()
        df = read_taiyi(tracker.out_path)

    Arguments:
        model: the model (its modules are matched by the config's keys).
        config: Taiyi's config; see :func:`resolve_config`.
        out: where to write the table: ``None`` (kept in memory only), a tandv log path, or
            an object with ``out_path`` (a tandv ``Tracker``; read when the first rows are
            written). The table goes to :func:`tandv.taiyi.taiyi_dir` of that log.
        flush_every: write a part file every this many tracked steps (and at :meth:`close`).
        start_step: the number of the first step, when :meth:`track` is called without one.
        root_name: the name of the root module in the table.
        ddof: the delta degrees of freedom of ``VarTID``'s per-channel batch standard
            deviation ``sigma_B = sqrt(sum((x - mu_B)**2) / (n - ddof))``: 0 (default) is
            the biased one BatchNorm normalizes with; 1 is Taiyi's (``torch.var``'s default,
            unbiased). The two differ by the factor ``sqrt(n / (n - 1))``, n the samples per
            channel of a batch (``N*H*W``).
        quantities: quantities of your own (:class:`tandv.taiyi.UserQuantity`), which the
            config then lists by name like the built-in ones.

    Hooks stay installed until :meth:`close` (or the end of the ``with`` block); on a step
    where nothing of a module fires they return at once.
    """

    def __init__(
        self,
        model: nn.Module,
        config: Mapping[Any, Any],
        *,
        out: Any = None,
        flush_every: int = 50,
        start_step: int = 0,
        root_name: str = "root",
        ddof: int = 0,
        quantities: Iterable[UserQuantity] | None = None,
    ) -> None:
        if isinstance(ddof, bool) or not isinstance(ddof, int) or ddof < 0:
            raise ValueError(
                f"Monitor(ddof={ddof!r}): expected 0 (VarTID's batch std as BatchNorm "
                f"normalizes with) or 1 (Taiyi's unbiased std)"
            )
        self.ddof = ddof
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"Monitor(model=...): expected an nn.Module, got {type(model).__name__}"
            )
        super().__init__(out, flush_every)
        self.model = model
        self._user = user_quantities(quantities)
        self._watches = [
            _Watch(p, m, e, self._user)
            for p, (m, e) in resolve_config(model, config, root_name, self._user).items()
        ]
        self._next_step = start_step
        self._handles: list[Any] = []
        self._closed = False
        for w in self._watches:
            self._handles.append(
                w.module.register_forward_hook(self._make_hook(w), with_kwargs=True)
            )
        self._begin(start_step)

    # ---------------------------------------------------------------- hooks

    def _begin(self, step: int) -> None:
        self._next_step = step
        for w in self._watches:
            w.active = {e.name for e in w.entries if e.schedule(step)}
            w.acc = _Acc()

    def _make_hook(self, w: _Watch) -> Callable[..., None]:
        bn = w.keeps_batches

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not (w.active or bn) or not module.training or in_backward():
                return
            with torch.no_grad():
                self._capture(w, module, _first_tensor(args, kwargs), output)

        return hook

    def _capture(self, w: _Watch, module: nn.Module, x: torch.Tensor | None, output: Any) -> None:
        acc = w.acc
        if x is not None and x.is_floating_point():
            if w.needs("input_cov"):
                f = feature_matrix(x, module)
                n = f.shape[0]
                mean = f.mean(0)
                fc = f - mean
                m2 = fc.T @ fc
                if acc.cov_mean is None:
                    acc.cov_n, acc.cov_mean, acc.cov_m2 = n, mean, m2
                else:  # Chan et al.'s pairwise merge of (count, mean, centred second moment)
                    assert acc.cov_m2 is not None  # set together with cov_mean
                    na, tot = acc.cov_n, acc.cov_n + n
                    delta = mean - acc.cov_mean
                    acc.cov_mean = acc.cov_mean + delta * (n / tot)
                    acc.cov_m2 = acc.cov_m2 + m2 + torch.outer(delta, delta) * (na * n / tot)
                    acc.cov_n = tot
            if w.needs("input"):
                xd = x.detach().double()
                acc.in_sum = _add(acc.in_sum, xd.sum())
                acc.in_sq = _add(acc.in_sq, xd.square().sum())
                acc.in_count += x.numel()
            for uq in w.user_active("input"):
                _keep(acc, uq, x, module)
            if w.keeps_batches:
                f = feature_matrix(x, module)
                w.bn_mu.append(f.mean(0))
                w.bn_sigma.append(f.var(0, correction=self.ddof).sqrt())
        y = (
            output
            if isinstance(output, torch.Tensor)
            else _first_tensor(tuple(output), {})
            if isinstance(output, (tuple, list))
            else None
        )
        if y is None or not y.is_floating_point():
            return
        if "LinearDeadNeuronNum" in w.active:
            alive = (y.detach().reshape(-1, y.shape[-1]) > 0).any(0)
            acc.alive = alive if acc.alive is None else acc.alive | alive
        if "RankMe" in w.active:
            z = feature_matrix(y, module)
            acc.gram = _add(acc.gram, z.T @ z)
            acc.gram_n += z.shape[0]
        for uq in w.user_active("output"):
            _keep(acc, uq, y, module)
        user_grads = w.user_active("output_grad")
        if ("OutputGradSndNorm" in w.active or user_grads) and y.requires_grad:
            norm = "OutputGradSndNorm" in w.active

            def grad_hook(g: torch.Tensor) -> None:
                with torch.no_grad():
                    if norm:
                        acc.grad_sq = _add(acc.grad_sq, g.detach().double().square().sum())
                    for uq in user_grads:
                        _keep(acc, uq, g.detach(), module)

            y.register_hook(grad_hook)

    # ---------------------------------------------------------------- step

    def track(self, step: int | None = None) -> None:
        """Compute the quantities due at ``step`` from the passes since the last call (call
        it once per step, after the backward pass; Taiyi's ``monitor.track(step)``).

        Arguments:
            step: the step number; ``None`` counts on from the last call (from
                ``start_step``). The next step is taken to be ``step + 1``: the hooks decide
                what to gather by it, so number steps consecutively.
        """
        if self._closed:
            raise RuntimeError("Monitor.track() after close(); create a new Monitor")
        step = self._next_step if step is None else int(step)
        fired = {w.path: {e.name for e in w.entries if e.schedule(step)} for w in self._watches}
        values: list[
            tuple[str, str, str, torch.Tensor]
        ] = []  # (module, type, quantity, 0-dim tensor)
        # symmetric matrices whose eigenvalues are due (input covariances, output Gram matrices
        # for RankMe), grouped by size and device for one batched eigvalsh per group
        # (for RankMe with the number of samples: Z has min(n, d) singular values)
        mats: dict[tuple[int, torch.device], list[tuple[_Watch, list[str], torch.Tensor, int]]] = {}
        with torch.no_grad():
            for w in self._watches:
                due = fired[w.path]
                if not due:
                    continue
                kind = type(w.module).__name__
                acc = w.acc
                cov_names = [
                    q for q in due if _needs(q, self._user) == "input_cov" and q in w.active
                ]
                if cov_names and acc.cov_mean is not None:
                    if acc.cov_n >= 2:
                        assert acc.cov_m2 is not None  # set together with cov_mean
                        c = acc.cov_m2 / (acc.cov_n - 1)
                        mats.setdefault((c.shape[0], c.device), []).append(
                            (w, cov_names, c, c.shape[0])
                        )
                    else:  # one sample has no covariance
                        nan = torch.full(
                            (), float("nan"), dtype=torch.float64, device=acc.cov_mean.device
                        )
                        values += [(w.path, kind, q, nan) for q in cov_names]
                if "RankMe" in due and "RankMe" in w.active and acc.gram is not None:
                    mats.setdefault((acc.gram.shape[0], acc.gram.device), []).append(
                        (w, ["RankMe"], acc.gram, min(acc.gram_n, acc.gram.shape[0]))
                    )
                for q in [e.name for e in w.entries if e.name in due]:
                    v = self._value(w, q)
                    if v is not None:
                        values.append((w.path, kind, q, v))
            for group in mats.values():
                eigs = torch.linalg.eigvalsh(torch.stack([c for _, _, c, _ in group]))
                eigs = eigs.clamp_min(0).flip(-1)  # descending; negative round-off is 0
                for (w, names, _, k), e in zip(group, eigs):
                    if names == ["RankMe"]:
                        # singular values of Z (n x d) from the eigenvalues of Z^T Z (d x d):
                        # Z has min(n, d) of them; Z^T Z's other d - n eigenvalues are zeros
                        # that are no singular values of Z (each would add ~1.6e-6 to the
                        # entropy through RankMe's 1e-7 offset)
                        got = {"RankMe": rankme_from_singular_values(e[:k].sqrt(), torch)}
                    else:
                        got = finalize_cov_eigs(e, names)
                    values += [(w.path, type(w.module).__name__, q, v) for q, v in got.items()]
        self._emit(step, values)
        self.end_step()
        self._begin(step + 1)

    def _value(self, w: _Watch, q: str) -> torch.Tensor | None:
        acc, m = w.acc, w.module
        active = q in w.active
        if q == "WeightNorm":
            return torch.linalg.vector_norm(_tensor(m, "weight").detach().double())
        if q in self._user:
            uq = self._user[q]
            if uq.needs == "weight":
                with torch.no_grad():
                    return _number(
                        uq, uq.fn(_tensor(m, "weight").detach(), m), _tensor(m, "weight")
                    )
            got = acc.user.get(q)
            return torch.stack(got).mean() if active and got else None
        if q == "InputMean" and active and acc.in_count:
            assert acc.in_sum is not None  # set with the first counted input
            return acc.in_sum / acc.in_count
        if q == "InputSndNorm" and active and acc.in_sq is not None:
            return acc.in_sq.sqrt()
        if q == "OutputGradSndNorm" and active and acc.grad_sq is not None:
            return acc.grad_sq.sqrt()
        if q == "LinearDeadNeuronNum" and active and acc.alive is not None:
            return (~acc.alive).sum().double()
        if q in ("MeanTID", "VarTID"):
            batches = w.bn_mu if q == "MeanTID" else w.bn_sigma
            if not batches:
                return None
            sigma_run = _tensor(m, "running_var").detach().double().sqrt()
            ref = _tensor(m, "running_mean").detach().double() if q == "MeanTID" else sigma_run
            diff = torch.stack(batches) - ref
            batches.clear()
            return (
                torch.linalg.vector_norm(diff, dim=-1) / torch.linalg.vector_norm(sigma_run)
            ).mean()
        return None

    def _emit(self, step: int, values: list[tuple[str, str, str, torch.Tensor]]) -> None:
        """Move the step's values to the host, one copy per device, and keep them as rows."""
        if not values:
            return
        by_dev: dict[torch.device, list[int]] = {}
        for i, (_, _, _, v) in enumerate(values):
            by_dev.setdefault(v.device, []).append(i)
        host: list[float] = [0.0] * len(values)
        for idx in by_dev.values():
            got = torch.stack([values[i][3].reshape(()).double() for i in idx]).cpu().tolist()
            for i, x in zip(idx, got):
                host[i] = x
        order = {w.path: i for i, w in enumerate(self._watches)}
        qorder = {q: i for i, q in enumerate([*QUANTITIES, *self._user])}
        rows = sorted(
            ((step, p, k, q, host[i]) for i, (p, k, q, _) in enumerate(values)),
            key=lambda r: (order[r[1]], qorder[r[3]]),
        )
        self.add_rows(rows)

    # ---------------------------------------------------------------- output

    def close(self) -> None:
        """Remove the hooks and write the remaining rows (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for h in self._handles:
            h.remove()
        self._handles = []
        self.flush()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
