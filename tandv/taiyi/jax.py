"""Taiyi's forward quantities for Flax linen models: the weight norm and the quantities of
module inputs and outputs (input covariance spectrum, input mean and norm, dead units,
RankMe), computed inside ``model.apply`` (jit-compatible) and stored in the same table as
the PyTorch :class:`tandv.taiyi.torch.Monitor` writes.

Not here yet: ``OutputGradSndNorm`` (needs the backward pass) and ``MeanTID``/``VarTID``
(need BatchNorm's batch statistics over steps); asking for them is an error that says so.

Features are the last axis (Flax is channels-last: a ``Conv`` input ``(N, H, W, C)`` is the
``(N*H*W, C)`` matrix of its pixels' channel vectors). A module called several times in one
``apply`` contributes all its calls (their rows concatenated). Values are computed in the
input's float type, at least float32 (float64 only with ``jax_enable_x64``), so the
covariance eigenvalues are float32-accurate by default: about 1e-7 of the largest
eigenvalue, absolute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

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

__all__ = ["Monitor", "JAX_QUANTITIES"]

#: The quantities the Flax monitor computes.
JAX_QUANTITIES = tuple(q for q in QUANTITIES if q not in ("OutputGradSndNorm", "MeanTID", "VarTID"))

Due = frozenset  # frozenset of (key index, quantity name): what fires at a step


class Monitor(TableWriter):
    """Taiyi's quantities for a Flax linen model, from Taiyi's config form.

    Config keys are a linen ``Module`` class (``nn.Dense``: every instance, subclasses
    included), a class name (``'Dense'``) or a module path as tandv names it
    (``'Dense_0'``, ``'block.fc1'``; the root is ``root_name``); values list quantities as
    ``'Name'``, ``['Name']`` or ``['Name', 'linear(interval, offset)']``.

    Use::

        monitor = Monitor({nn.Dense: ["InputCovMaxEig", "RankMe"]}, out="runs/x")
        apply = jax.jit(lambda v, x, due: monitor.apply(model, v, x, due=due), static_argnums=2)
        for step, x in enumerate(batches):
            y, q = apply(variables, x, monitor.due(step))   # q: {module: {quantity: value}}
            monitor.track(q, step)                          # one device_get, rows, part files
        df = monitor.to_dataframe()                         # or read_taiyi("runs/x")

    A key that matches no module is reported at the first :meth:`track`.

    Arguments:
        config: Taiyi's config.
        out, flush_every: where and how often the table is written (see
            :class:`tandv.taiyi.TableWriter`).
        start_step: the first step when :meth:`track` is called without one.
        root_name: the root module's name.
        quantities: quantities of your own (:class:`tandv.taiyi.UserQuantity` with ``needs``
            ``"input"``, ``"output"`` or ``"weight"``, the ``kernel``), listed in the config
            by name; ``fn(array, module)`` runs inside ``apply`` (traced: jnp operations)
            and several calls of a module in one ``apply`` give the mean of their values.

    Raises:
        ValueError / TypeError: an unknown quantity, one not available for JAX, a bad
            schedule or a key of the wrong kind (naming the key).
    """

    def __init__(
        self,
        config: Mapping[Any, Any],
        *,
        out: Any = None,
        flush_every: int = 50,
        start_step: int = 0,
        root_name: str = "root",
        quantities: Iterable[UserQuantity] | None = None,
    ) -> None:
        super().__init__(out, flush_every)
        self._user = user_quantities(quantities)
        for uq in self._user.values():
            if uq.needs == "output_grad":
                raise ValueError(
                    f"UserQuantity({uq.name!r}, needs='output_grad'): the JAX monitor sees the "
                    f"forward pass only; use 'input', 'output' or 'weight'"
                )
        if not isinstance(config, Mapping):
            raise TypeError(
                f"config: expected a dict {{module key: [quantities]}}, got {type(config).__name__}"
            )
        self._keys: list[tuple[Any, str, list[tuple[str, Schedule, str]]]] = []
        for key, value in config.items():
            where = key_text(key, "flax.linen")
            if isinstance(key, type):
                if not issubclass(key, nn.Module):
                    raise TypeError(
                        f"config key {where}: a class key must be a flax.linen Module subclass "
                        f"(such as nn.Dense), got {key.__name__}"
                    )
            elif not isinstance(key, str):
                raise TypeError(
                    f"config key {key!r}: expected a module path ('Dense_0'), a class name "
                    f"('Dense') or a linen Module class (nn.Dense), got {type(key).__name__}"
                )
            items = parse_quantity_list(value, where, extra=self._user)
            for name, _, _ in items:
                if name not in JAX_QUANTITIES and name not in self._user:
                    raise ValueError(
                        f"config[{where}] quantity {name!r}: not available for JAX/Flax yet "
                        f"(only for PyTorch models); the JAX monitor computes "
                        f"{', '.join(JAX_QUANTITIES)}."
                    )
            self._keys.append((key, where, items))
        self._root = root_name
        self._next_step = start_step
        self._matched: set[int] = set()
        self._types: dict[str, str] = {}

    def due(self, step: int) -> Due:
        """What fires at ``step``: pass it to :meth:`apply` (a static, hashable argument)."""
        return frozenset(
            (i, name)
            for i, (_, _, items) in enumerate(self._keys)
            for name, sched, _ in items
            if sched(step)
        )

    def _hits(self, path: str, module: nn.Module) -> list[int]:
        out = []
        for i, (key, _, _) in enumerate(self._keys):
            if isinstance(key, type):
                hit = isinstance(module, key)
            else:
                hit = key == path or (key == type(module).__name__)
            if hit:
                out.append(i)
        return out

    def apply(
        self, model: nn.Module, variables: Any, *args: Any, due: Due, **kwargs: Any
    ) -> tuple[Any, dict[str, dict[str, jax.Array]]]:
        """``model.apply(variables, *args, **kwargs)`` that also returns the quantities in
        ``due`` as ``{module path: {quantity: 0-d array}}`` (pure; jit it with ``due``
        static). Returns ``(model output, quantities)``; with ``mutable=...`` the model
        output is ``apply``'s ``(output, state)`` pair."""
        wanted: dict[str, set[str]] = {}
        calls: dict[str, dict[str, list[jax.Array]]] = {}
        kernels: dict[str, jax.Array] = {}
        mine: dict[str, dict[str, list[jax.Array]]] = {}  # user quantities' per-call values

        def interceptor(next_fun: Callable[..., Any], a: tuple, kw: dict, context: Any) -> Any:
            out = next_fun(*a, **kw)
            if context.method_name != "__call__":
                return out
            module = context.module
            path = ".".join(str(p) for p in module.path) or self._root
            names: set[str] = set()
            for i in self._hits(path, module):
                self._matched.add(i)
                names |= {n for j, n in due if j == i}
            if not names:
                return out
            self._check_applies(names, path, module)
            self._types[path] = type(module).__name__
            wanted.setdefault(path, set()).update(names)
            store = calls.setdefault(path, {"in": [], "out": []})
            x = a[0] if a else next(iter(kw.values()), None)
            if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):
                store["in"].append(x)
            y = out if isinstance(out, jax.Array) else None
            if y is not None and jnp.issubdtype(y.dtype, jnp.floating):
                store["out"].append(y)
            if "WeightNorm" in names:
                kernels[path] = module.variables["params"]["kernel"]
            for q in sorted(names & set(self._user)):
                uq = self._user[q]
                arg = {"input": x, "output": y}.get(uq.needs)
                if uq.needs == "weight":
                    arg = module.variables.get("params", {}).get("kernel")
                if arg is not None:
                    v = jnp.asarray(uq.fn(arg, module))
                    if v.size != 1:
                        raise ValueError(
                            f"UserQuantity {q!r}: fn returned an array of shape {v.shape}; it "
                            f"must return one number"
                        )
                    mine.setdefault(path, {}).setdefault(q, []).append(v.reshape(()))
            return out

        with nn.intercept_methods(interceptor):
            result = model.apply(variables, *args, **kwargs)
        quantities = {
            path: self._compute(names & set(QUANTITIES), calls[path], kernels.get(path))
            for path, names in wanted.items()
        }
        for path, got in mine.items():  # a weight's value is the same at every call
            quantities[path].update({q: jnp.stack(vs).mean() for q, vs in got.items()})
        return result, {p: q for p, q in quantities.items() if q}

    def _check_applies(self, names: set[str], path: str, module: nn.Module) -> None:
        kind = type(module).__name__
        if "LinearDeadNeuronNum" in names and not isinstance(module, nn.Dense):
            raise ValueError(
                f"quantity 'LinearDeadNeuronNum': defined for nn.Dense modules, but module "
                f"{path!r} is a {kind}; list it under nn.Dense."
            )
        if "WeightNorm" in names and "kernel" not in module.variables.get("params", {}):
            raise ValueError(
                f"quantity 'WeightNorm': module {path!r} ({kind}) has no 'kernel' parameter; "
                f"WeightNorm applies to modules with one (Dense, Conv, ...)."
            )

    @staticmethod
    def _compute(
        names: set[str], data: dict[str, list[jax.Array]], kernel: jax.Array | None
    ) -> dict[str, jax.Array]:
        # float32 products in full precision: on GPUs and TPUs JAX's default precision rounds
        # their inputs (TF32, bf16), which moved InputCovCondition80 by 3e-4 on an H200
        with jax.default_matmul_precision("highest"):

            def matrix(xs: list[jax.Array]) -> jax.Array:
                dt = jnp.promote_types(xs[0].dtype, jnp.float32)
                return jnp.concatenate([x.reshape(-1, x.shape[-1]).astype(dt) for x in xs])

            out: dict[str, jax.Array] = {}
            cov_names = [n for n in names if QUANTITIES[n].needs == "input_cov"]
            if data["in"]:
                x = matrix(data["in"])
                if cov_names:
                    if x.shape[0] >= 2:
                        eigs = jnp.clip(
                            jnp.linalg.eigvalsh(jnp.cov(x, rowvar=False).reshape(x.shape[1], -1)), 0
                        )[::-1]
                        out.update(finalize_cov_eigs(eigs, cov_names))
                    else:
                        out.update({n: jnp.array(jnp.nan, x.dtype) for n in cov_names})
                if "InputMean" in names:
                    out["InputMean"] = x.mean()
                if "InputSndNorm" in names:
                    out["InputSndNorm"] = jnp.sqrt(jnp.square(x).sum())
            if data["out"]:
                z = matrix(data["out"])
                if "LinearDeadNeuronNum" in names:
                    out["LinearDeadNeuronNum"] = jnp.all(z <= 0, axis=0).sum().astype(z.dtype)
                if "RankMe" in names:
                    out["RankMe"] = rankme_from_singular_values(
                        jnp.linalg.svd(z, compute_uv=False), jnp
                    )
            if "WeightNorm" in names and kernel is not None:
                k = kernel.astype(jnp.promote_types(kernel.dtype, jnp.float32))
                out["WeightNorm"] = jnp.sqrt(jnp.square(k).sum())
            return out

    def track(self, quantities: Mapping[str, Mapping[str, Any]], step: int | None = None) -> None:
        """Store the quantities :meth:`apply` returned for ``step`` (``None``: counting on
        from the last call), with one ``jax.device_get`` for all of them.

        Raises:
            ValueError: at the first call, for config keys that matched no module.
        """
        unmatched = [where for i, (_, where, _) in enumerate(self._keys) if i not in self._matched]
        if unmatched:
            raise ValueError(
                f"config keys {', '.join(unmatched)} matched no module of the model in apply(); "
                "use a "
                f"module path as tandv names it ('Dense_0', 'block.fc1'), a class name or "
                f"a linen Module class present in the model"
            )
        step = self._next_step if step is None else int(step)
        host = jax.device_get({p: dict(q) for p, q in quantities.items()})
        order = {q: i for i, q in enumerate([*QUANTITIES, *self._user])}
        rows = [
            (step, p, self._types.get(p, ""), q, float(v))
            for p, qs in host.items()
            for q, v in sorted(qs.items(), key=lambda kv: order[kv[0]])
        ]
        self.add_rows(rows)
        self.end_step()
        self._next_step = step + 1

    def close(self) -> None:
        """Write the remaining rows."""
        self.flush()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
