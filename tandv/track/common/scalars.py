"""Training scalars beside the log: the framework-neutral part of ``tracker.log_scalars``.

An adapter turns each value into a float or a *pending* value (:class:`Pending`: a copy to
the host under way), so that logging a device scalar (the loss) never waits for the
device. :class:`ScalarRecorder` keeps them by step and writes, at each flush, the steps
whose values have all arrived as a part file of the scalars table
(:func:`tandv.schema.scalars.scalars_path`); closing waits for the rest.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ...schema.scalars import scalars_path, write_scalars_part

__all__ = ["Pending", "ScalarRecorder", "check_scalar_args", "plain_scalar"]


class Pending(Protocol):
    """A scalar on its way to the host."""

    def ready(self) -> bool:
        """Whether :meth:`get` would return without waiting for a device."""

    def get(self) -> float:
        """The value (waits for it if it has not arrived)."""


#: An adapter's conversion of one user value: ``capture(name, value) -> float | Pending``,
#: or ``None`` when the value is not of its framework.
Capture = Callable[[str, Any], "float | Pending | None"]


def check_scalar_args(step: Any, values: Mapping[str, Any]) -> None:
    """Reject a bad ``step`` or an empty call, naming the argument."""
    if step is not None and (
        isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0
    ):
        raise ValueError(
            f"log_scalars(step={step!r}): expected None (the current step) or an int >= 0"
        )
    if not values:
        raise ValueError(
            "log_scalars(): give at least one scalar as a keyword, "
            "e.g. log_scalars(loss=loss, lr=lr)"
        )


def plain_scalar(name: str, value: Any) -> float | None:
    """``value`` as a float when it is a Python or numpy number (or a one-element numpy
    array); ``None`` for anything else (a framework's tensor)."""
    if isinstance(value, (numbers.Real, np.number, np.bool_)):
        return float(value)
    if isinstance(value, np.ndarray):
        if value.size != 1 or value.dtype.kind not in "biuf":
            raise ValueError(
                f"log_scalars({name}=...): expected one number; got a {value.dtype} array of "
                f"shape {value.shape}"
            )
        return float(value.reshape(()))
    return None


class ScalarRecorder:
    """Per-step training scalars of one log, written as part files beside it.

    Arguments:
        log: the log's path; the scalars go to :func:`~tandv.schema.scalars.scalars_path`.
        max_pending_steps: a flush is forced (waiting for values still in flight) when
            more steps than this are waiting, so memory stays bounded.
    """

    def __init__(self, log: Path, max_pending_steps: int = 4096) -> None:
        self.directory = scalars_path(log)
        self.max_pending_steps = max_pending_steps
        self._pending: dict[int, dict[str, float | Pending]] = {}
        self._parts = 0
        self.steps_written = 0

    def add(self, step: int, values: Mapping[str, float | Pending]) -> None:
        """Record ``values`` (name -> float or pending value) at ``step``; a name given twice
        for one step keeps the later value."""
        self._pending.setdefault(int(step), {}).update(values)
        if len(self._pending) > self.max_pending_steps:
            self.flush()

    @property
    def pending_steps(self) -> int:
        """How many steps wait to be written."""
        return len(self._pending)

    def flush(self, wait: bool = False) -> None:
        """Write the waiting steps whose values have arrived, in the order they were first
        logged, stopping at the first step with a value still in flight; with ``wait``
        (or past ``max_pending_steps``) all of them, waiting as needed."""
        force = wait or len(self._pending) > self.max_pending_steps
        steps, rows = [], []
        for step, values in self._pending.items():
            if not force and not all(isinstance(v, float) or v.ready() for v in values.values()):
                break
            steps.append(step)
            rows.append(
                {k: v if isinstance(v, float) else float(v.get()) for k, v in values.items()}
            )
        if not steps:
            return
        for step in steps:
            del self._pending[step]
        write_scalars_part(self.directory, self._parts, steps, rows)
        self._parts += 1
        self.steps_written += len(steps)

    def close(self) -> None:
        """Write everything still waiting (idempotent)."""
        self.flush(wait=True)
