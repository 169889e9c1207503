"""Framework-free part of the Taiyi quantities: their names and definitions, Taiyi's
schedule strings, the per-module quantity lists of a Taiyi config, and the table the
results are stored in (one row per step, module and quantity; a parquet directory beside
the tandv log).

Nothing here imports torch or jax; the adapters (``tandv.taiyi.torch``) find the modules,
compute the quantities on the device and hand this module plain rows.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..track.common.schedule import Schedule, parse_linear

__all__ = [
    "QUANTITIES",
    "QuantitySpec",
    "UserQuantity",
    "Schedule",
    "parse_schedule",
    "parse_quantity_list",
    "COLUMNS",
    "rows_to_frame",
    "to_nested",
    "taiyi_dir",
    "write_part",
    "read_taiyi",
    "finalize_cov_eigs",
    "rankme_from_singular_values",
    "TableWriter",
]


# -- the quantities -------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantitySpec:
    """What one Taiyi quantity is.

    Attributes:
        name: Taiyi's name (the config and the table use it).
        needs: which data it is computed from: ``"input_cov"`` (covariance of the module's
            input features), ``"input"``, ``"output"``, ``"output_grad"``, ``"weight"`` or
            ``"bn_batch"`` (per-batch statistics of a BatchNorm's input, kept over steps).
        modules: ``None`` (any module with the data) or the kind of module it is defined
            for: ``"linear"`` or ``"batchnorm"``.
        exact: whether the value is an exact function of the step's tensors (up to float64
            rounding) or an estimate (eigenvalues of a covariance estimated from a batch).
        doc: the definition.
    """

    name: str
    needs: str
    modules: str | None
    exact: bool
    doc: str


_COV_NOTE = (
    "Eigenvalues of the sample covariance of the step's inputs: exact for that batch "
    "(float64), an estimate of the population covariance's spectrum."
)

#: Every supported quantity, by Taiyi's name, in Taiyi's order.
QUANTITIES: dict[str, QuantitySpec] = {
    q.name: q
    for q in [
        QuantitySpec(
            "InputCovMaxEig",
            "input_cov",
            None,
            False,
            "Largest eigenvalue lambda_1 of the sample covariance C = Xc^T Xc / (n - 1) of the "
            "module's input features (X: n samples x d features, Xc: X minus its column means). "
            + _COV_NOTE,
        ),
        QuantitySpec(
            "InputCovStableRank",
            "input_cov",
            None,
            False,
            "Stable rank of the centred input, ||Xc||_F^2 / ||Xc||_2^2 = tr(C) / lambda_1 "
            "(sum of C's eigenvalues over the largest); between 1 and d. " + _COV_NOTE,
        ),
        QuantitySpec(
            "InputCovCondition20",
            "input_cov",
            None,
            False,
            "lambda_1 / lambda_k with eigenvalues in descending order lambda_1 >= ... >= lambda_d "
            "and k = floor(0.2 d) + 1: the condition number of the top 20% of C's spectrum "
            "(inf when lambda_k is exactly 0; where C is singular, lambda_k is usually round-off "
            "instead, and the value is huge and depends on the device: 1.6e14 on the CPU and "
            "3.1e14 on a GPU for one float64 covariance of rank 3 of 4). " + _COV_NOTE,
        ),
        QuantitySpec(
            "InputCovCondition50",
            "input_cov",
            None,
            False,
            "As InputCovCondition20 with k = floor(0.5 d) + 1 (the median eigenvalue). "
            + _COV_NOTE,
        ),
        QuantitySpec(
            "InputCovCondition80",
            "input_cov",
            None,
            False,
            "As InputCovCondition20 with k = floor(0.8 d) + 1. " + _COV_NOTE,
        ),
        QuantitySpec(
            "InputMean",
            "input",
            None,
            True,
            "Mean of all elements of the module's input (first positional argument).",
        ),
        QuantitySpec(
            "InputSndNorm",
            "input",
            None,
            True,
            "L2 (Frobenius) norm of the module's input, all elements; with several forward "
            "passes in a step, the norm of all of them together (sqrt of the summed squares).",
        ),
        QuantitySpec(
            "OutputGradSndNorm",
            "output_grad",
            None,
            True,
            "L2 norm of the gradient of the loss w.r.t. the module's output; with several "
            "backward passes in a step, the norm of all of them together.",
        ),
        QuantitySpec(
            "WeightNorm",
            "weight",
            None,
            True,
            "L2 (Frobenius) norm of the module's ``weight`` as it is when the step is tracked.",
        ),
        QuantitySpec(
            "LinearDeadNeuronNum",
            "output",
            "linear",
            True,
            "Number of output units of a Linear layer that are dead for the step's batch: "
            "their output is <= 0 for every sample, so a ReLU after them passes nothing and "
            "their weights get no gradient through it.",
        ),
        QuantitySpec(
            "RankMe",
            "output",
            None,
            True,
            "RankMe (Garrido et al. 2023, arXiv:2210.02885) of the module's output Z (samples "
            "x features): exp(-sum_k p_k log p_k) with p_k = s_k / ||s||_1 + 1e-7 and s the "
            "the min(samples, features) singular values of Z; a smooth effective rank between 1 "
            "and min(samples, features). In the PyTorch monitor s is the square roots of the "
            "largest min(n, d) eigenvalues of Z^T Z (float64), so the Gram matrix merges over "
            "forward passes; zero singular values of a rank-deficient output then come out near "
            "1e-8 of the largest, which raises RankMe slightly (up to about 1e-4 relative, rank "
            "5 of width 2048). The JAX monitor takes s from an SVD of Z.",
        ),
        QuantitySpec(
            "MeanTID",
            "bn_batch",
            "batchnorm",
            True,
            "BatchNorm training/inference discrepancy of the mean (Wang et al. 2022, "
            "arXiv:2210.05153): the average over the training batches seen since the last "
            "time it was computed of ||mu_B - mu_run||_2 / ||sqrt(var_run)||_2, mu_B the "
            "batch's per-channel mean and mu_run, var_run the running statistics at the "
            "step it is computed.",
        ),
        QuantitySpec(
            "VarTID",
            "bn_batch",
            "batchnorm",
            True,
            "BatchNorm training/inference discrepancy of the scale: the average over the same "
            "batches of ||sigma_B - sigma_run||_2 / ||sigma_run||_2, sigma_B the batch's "
            "per-channel standard deviation (biased, as BatchNorm normalizes with; Taiyi's code "
            "takes the unbiased one: Monitor(..., ddof=1)) and sigma_run = sqrt(var_run).",
        ),
    ]
}

#: What a :class:`UserQuantity` can be computed from.
USER_NEEDS = ("input", "output", "output_grad", "weight")


@dataclass(frozen=True)
class UserQuantity:
    """A quantity of your own, used in a config like Taiyi's built-in ones (Taiyi's users
    write their own quantity classes; here a function is enough).

    ``Monitor(model, {nn.Linear: ["OutputAbsMax"]}, quantities=[UserQuantity("OutputAbsMax",
    "output", lambda y, module: y.abs().max())])``.

    Attributes:
        name: the name the config and the table use (not a built-in quantity's).
        needs: what ``fn`` is given: ``"input"`` (the module's first tensor argument) or
            ``"output"`` (its first tensor output) at each training-mode forward pass,
            ``"output_grad"`` (the gradient of the loss w.r.t. that output) at each backward
            pass, or ``"weight"`` (``module.weight``) once, when :meth:`Monitor.track` runs.
        fn: ``fn(tensor, module)`` returning one number: a 0-dim (or one-element) tensor of
            the framework, on the tensor's device (it is not copied to the host until the
            step's values are, once), or a Python number. It runs under ``torch.no_grad()``.
        doc: the definition, shown by :func:`describe_quantities`-like listings.

    With several passes in a step (gradient accumulation), the step's value is the mean of
    the per-pass values.
    """

    name: str
    needs: str
    fn: Callable[[Any, Any], Any]
    doc: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"UserQuantity(name={self.name!r}): expected a non-empty string")
        if self.name in QUANTITIES:
            raise ValueError(
                f"UserQuantity(name={self.name!r}): a built-in quantity has this name; "
                f"choose another"
            )
        if self.needs not in USER_NEEDS:
            raise ValueError(
                f"UserQuantity({self.name!r}, needs={self.needs!r}): expected one of "
                f"{list(USER_NEEDS)}"
            )
        if not callable(self.fn):
            raise TypeError(
                f"UserQuantity({self.name!r}, fn=...): expected a callable fn(tensor, module), "
                f"got {type(self.fn).__name__}"
            )


def user_quantities(quantities: Iterable[UserQuantity] | None) -> dict[str, UserQuantity]:
    """A monitor's ``quantities=`` argument by name, checked (no name given twice)."""
    out: dict[str, UserQuantity] = {}
    for q in quantities or ():
        if not isinstance(q, UserQuantity):
            raise TypeError(
                f"quantities=[...]: expected UserQuantity objects, got {type(q).__name__}"
            )
        if q.name in out:
            raise ValueError(f"quantities=[...]: {q.name!r} is given twice")
        out[q.name] = q
    return out


#: Percentile of each condition quantity.
CONDITION_PERCENT = {
    "InputCovCondition20": 20,
    "InputCovCondition50": 50,
    "InputCovCondition80": 80,
}

#: ``p_k`` offset in RankMe (the paper's epsilon).
RANKME_EPS = 1e-7


def key_text(key: Any, nn_package: str) -> str:
    """A config key as the user wrote it (``nn.Linear``, ``'fc1'``): a class from
    ``nn_package`` (``"torch.nn"``, ``"flax.linen"``) is spelled ``nn.<name>``."""
    if isinstance(key, type):
        return f"nn.{key.__name__}" if key.__module__.startswith(nn_package) else key.__name__
    return repr(key)


def condition_index(percent: int, d: int) -> int:
    """0-based index into descending eigenvalues of the denominator of
    ``InputCovCondition<percent>``."""
    return min(int(np.floor(percent * d / 100)), d - 1)


def finalize_cov_eigs(eigs: Any, names: Sequence[str]) -> dict[str, Any]:
    """The covariance quantities ``names`` from ``eigs``, the eigenvalues of one covariance
    in descending order (a 1-d torch tensor, jax or numpy array; negative round-off is
    clamped to 0 by the caller). Values stay arrays of the caller's framework."""
    d = eigs.shape[0]
    top = eigs[0]
    out: dict[str, Any] = {}
    for name in names:
        if name == "InputCovMaxEig":
            out[name] = top
        elif name == "InputCovStableRank":
            out[name] = eigs.sum() / top
        else:
            out[name] = top / eigs[condition_index(CONDITION_PERCENT[name], d)]
    return out


def rankme_from_singular_values(s: Any, xp: Any) -> Any:
    """RankMe from singular values ``s`` (any order), with ``xp`` the array module
    (``numpy``, ``torch`` or ``jax.numpy``) that ``s`` belongs to."""
    p = s / s.sum() + RANKME_EPS
    return xp.exp(-(p * xp.log(p)).sum())


# -- schedules ------------------------------------------------------------------------------------


def parse_schedule(spec: str | Schedule | None) -> Schedule:
    """Taiyi's schedule string as a callable ``step -> bool``.

    ``"linear(interval, offset)"`` fires at steps ``offset, offset + interval, offset +
    2 * interval, ...`` (Taiyi's example: ``"linear(5, 2)"`` fires at 2, 7, 12, ...); steps
    count from 0 as :meth:`Monitor.track` counts them. ``interval`` 0 means every step from
    ``offset`` on: Taiyi documents ``"linear(0, 0)"`` as the default, and its default
    tracks every step. The string is read by
    :func:`tandv.track.common.schedule.parse_linear`, as the trackers' ``schedule=`` is.
    ``None`` (no setting) is every step; a callable is used as it is.

    Raises:
        ValueError: for any other string, saying what is accepted.
        TypeError: for anything that is neither a string nor a callable.
    """
    if spec is None:
        return lambda step: True
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"schedule {spec!r}: expected a string like 'linear(5, 0)' or a callable "
            f"step -> bool, got {type(spec).__name__}"
        )
    return parse_linear(spec, "schedule ", " ('linear' is the only kind Taiyi has)")


def _unknown_quantity(name: Any, where: str, extra: Iterable[str] = ()) -> ValueError:
    known = [*QUANTITIES, *extra]
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(
        f"config[{where}]: unknown quantity {name!r}.{hint} Known quantities: "
        f"{', '.join(known)} (a quantity of your own: Monitor(..., "
        f"quantities=[UserQuantity(...)]))."
    )


def parse_quantity_list(
    value: Any, where: str, extra: Iterable[str] = ()
) -> list[tuple[str, Schedule, str]]:
    """One value of a Taiyi config: the quantities for one module key, each with its
    schedule, as ``(name, schedule, schedule_text)``.

    Accepted items (Taiyi's forms): ``"Name"``, ``["Name"]`` and ``["Name", "linear(a, b)"]``;
    also ``("Name", callable)``. A bare string value is one quantity. ``where`` names the
    config key in error messages; ``extra`` names user-defined quantities also accepted.

    Raises:
        ValueError: an unknown quantity (with the closest known name), a bad schedule, a
            quantity listed twice for the key, or an item of the wrong shape.
        TypeError: a value that is not a list of items.
    """
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(
            f"config[{where}]: expected a list of quantities such as "
            f"['InputSndNorm', ['MeanTID', 'linear(5, 0)']], got {type(value).__name__}"
        )
    out: list[tuple[str, Schedule, str]] = []
    seen: set[str] = set()
    extra = set(extra)
    for item in value:
        if isinstance(item, str):
            name, sched = item, None
        elif isinstance(item, (list, tuple)) and 1 <= len(item) <= 2 and isinstance(item[0], str):
            name, sched = item[0], (item[1] if len(item) == 2 else None)
        else:
            raise ValueError(
                f"config[{where}]: item {item!r} is not a quantity; write 'Name', ['Name'] "
                f"or ['Name', 'linear(interval, offset)']"
            )
        if name not in QUANTITIES and name not in extra:
            raise _unknown_quantity(name, where, extra)
        if name in seen:
            raise ValueError(f"config[{where}]: quantity {name!r} is listed twice; keep one entry")
        seen.add(name)
        try:
            fn = parse_schedule(sched)
        except (ValueError, TypeError) as e:
            raise type(e)(f"config[{where}] quantity {name!r}: {e}") from None
        text = sched if isinstance(sched, str) else ("every step" if sched is None else repr(sched))
        out.append((name, fn, text))
    return out


# -- the table ------------------------------------------------------------------------------------

#: Columns of the Taiyi table, with their dtypes.
COLUMNS: dict[str, str] = {
    "step": "int64",
    "module": "string",
    "module_type": "string",
    "quantity": "string",
    "value": "float64",
}

#: Name of the directory (inside a parquet log directory) holding the table's part files.
TAIYI_DIR = "taiyi"


def rows_to_frame(rows: Iterable[tuple[int, str, str, str, float]]) -> pd.DataFrame:
    """Rows ``(step, module, module_type, quantity, value)`` as a table with :data:`COLUMNS`."""
    df = pd.DataFrame(list(rows), columns=list(COLUMNS))
    return df.astype(COLUMNS)


def to_nested(df: pd.DataFrame) -> dict[str, dict[str, dict[int, float]]]:
    """The table in Taiyi's output form ``{module: {quantity: {step: value}}}``."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for step, module, quantity, value in zip(df["step"], df["module"], df["quantity"], df["value"]):
        out.setdefault(str(module), {}).setdefault(str(quantity), {})[int(step)] = float(value)
    return out


def taiyi_dir(log_path: str | os.PathLike) -> Path:
    """Where the Taiyi table of a tandv log lives: ``<log dir>/taiyi/`` for a parquet log
    directory (the log reader reads only the ``*.parquet`` files directly in it), and
    ``<dir>/<stem>.taiyi/`` beside a single-file log ``<dir>/<stem>.pkl``/``.parquet``."""
    p = Path(log_path)
    if p.suffix in (".pkl", ".pickle", ".parquet") and not p.is_dir():
        return p.with_name(p.stem + ".taiyi")
    return p / TAIYI_DIR


def write_part(df: pd.DataFrame, directory: str | os.PathLike, index: int) -> Path:
    """Write rows as part file ``index`` of a Taiyi table directory (atomically renamed)."""
    from ..schema.io import atomic_write  # pyarrow stays lazy for readers of QUANTITIES

    path = Path(directory) / f"part-{index:06d}.parquet"
    return atomic_write(path, lambda tmp: df.to_parquet(tmp, index=False))


def _check(df: pd.DataFrame, where: str) -> pd.DataFrame:
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(
            f"{where}: not a Taiyi table: columns {missing} are missing (expected {list(COLUMNS)})"
        )
    df = df[list(COLUMNS)].astype(COLUMNS)
    # built-in quantities and user-defined ones (any name) may be there
    if (df["quantity"].isna() | (df["quantity"].str.len() == 0)).any():
        raise ValueError(f"{where}: empty quantity names in column 'quantity'")
    return df


def read_taiyi(path: str | os.PathLike) -> pd.DataFrame:
    """Read the Taiyi table written beside a tandv log.

    Arguments:
        path: the tandv log (its directory, or its ``.pkl``/``.parquet`` file; the table is
            found with :func:`taiyi_dir`), the table's own directory, or one part file.

    Returns:
        A DataFrame with columns ``step``, ``module``, ``module_type``, ``quantity``,
        ``value``, one row per step, module and quantity, in the order written.

    Raises:
        FileNotFoundError: when no table is there.
        ValueError: when the files are not a Taiyi table.
    """
    p = Path(path)
    candidates = [p] if p.is_file() else [taiyi_dir(p), p]
    for c in candidates:
        if c.is_file():
            files = [c]
        elif c.is_dir():
            files = sorted(f for f in c.glob("part-*.parquet"))
        else:
            continue
        if files:
            df = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
            return _check(df, str(c))
    raise FileNotFoundError(
        f"no Taiyi table at {str(p)!r} (looked in {[str(c) for c in candidates]}); "
        f"a Monitor writes one when given out="
    )


def describe_quantities() -> pd.DataFrame:
    """The quantities as a table: name, what they are computed from, exact or estimated,
    and their definition."""
    return pd.DataFrame(
        [(q.name, q.needs, q.modules or "any", q.exact, q.doc) for q in QUANTITIES.values()],
        columns=["quantity", "computed_from", "modules", "exact", "definition"],
    )


def check_known(names: Iterable[str]) -> None:
    """Raise :class:`ValueError` for the first name that is not a quantity."""
    for n in names:
        if n not in QUANTITIES:
            raise _unknown_quantity(n, "?")


class TableWriter:
    """The rows a monitor has made, kept in memory and streamed as part files beside a log.

    Arguments:
        out: ``None`` (memory only), a tandv log path, or an object with ``out_path`` (a
            tandv tracker; read when the first rows are written). The table goes to
            :func:`taiyi_dir` of that log. Beside a tracker of a distributed run only the
            rank that writes the log writes the table (its own rank's values, not merged
            over the ranks); the other ranks keep their rows in memory.
        flush_every: write a part file every this many :meth:`end_step` calls.
    """

    def __init__(self, out: Any = None, flush_every: int = 50) -> None:
        if not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(f"flush_every={flush_every!r}: expected an int >= 1")
        self._out = out
        self._dir: Path | None = None
        self._flush_every = flush_every
        self._rows: list[tuple[int, str, str, str, float]] = []
        self._unflushed = 0
        self._parts = 0
        self._steps_since_flush = 0

    def add_rows(self, rows: Sequence[tuple[int, str, str, str, float]]) -> None:
        """Keep rows ``(step, module, module_type, quantity, value)``."""
        self._rows.extend(rows)
        self._unflushed += len(rows)

    def end_step(self) -> None:
        """Count a step; write a part file every ``flush_every`` steps."""
        self._steps_since_flush += 1
        if self._out is not None and self._steps_since_flush >= self._flush_every:
            self.flush()

    @property
    def out_dir(self) -> Path | None:
        """The directory the table is written to (``None`` when it is kept in memory only,
        or its tracker has not started yet)."""
        if self._dir is None and self._out is not None:
            log = getattr(self._out, "out_path", self._out)
            if log is not None:
                self._dir = taiyi_dir(log if isinstance(log, (str, os.PathLike)) else str(log))
        return self._dir

    def flush(self) -> None:
        """Write the rows not yet written as one part file (nothing without ``out``)."""
        self._steps_since_flush = 0
        if self._out is None or not self._unflushed:
            return
        if not getattr(self._out, "writes_log", True):
            # a tracker of a distributed run on a rank that does not write its log: the
            # writing rank alone writes the table beside it (its own rank's values)
            self._unflushed = 0
            return
        d = self.out_dir
        if d is None:
            raise RuntimeError(
                "Monitor(out=tracker): the tracker has no out_path yet; enter its "
                "`with track(...)` block before the first Monitor.track()"
            )
        if self._parts == 0 and d.is_dir() and any(d.glob("part-*.parquet")):
            raise FileExistsError(
                f"{str(d)!r} already holds a Taiyi table; choose another log path or remove it"
            )
        write_part(rows_to_frame(self._rows[-self._unflushed :]), d, self._parts)
        self._parts += 1
        self._unflushed = 0

    def to_dataframe(self) -> pd.DataFrame:
        """All rows so far: columns ``step``, ``module``, ``module_type``, ``quantity``,
        ``value``."""
        return rows_to_frame(self._rows)

    def get_output(self) -> dict[str, dict[str, dict[int, float]]]:
        """All values so far in Taiyi's form ``{module: {quantity: {step: value}}}``."""
        return to_nested(self.to_dataframe())
