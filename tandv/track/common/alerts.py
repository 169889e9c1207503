"""Alerts while training: a step that went non-finite, or that a user's rule flags, stops the
run (or warns) as soon as its summaries reach the host.

The check runs where a step's host summaries become entries of the log
(:meth:`~tandv.track.common.buffer.StepBuffer.commit`), so it costs no transfer and no sync
of its own, and both trackers share it. :class:`AlertWatch` inspects each committed step and
keeps the first error due; the tracker core raises it from the next ``tracker.step()`` (or
from closing), after writing every step up to the bad one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from ...analysis import computation_order
from ...stats.summary import FIELD_INDEX

__all__ = ["AlertError", "NonFiniteError", "AlertWatch", "Rule", "check_alert_options"]

#: A rule of ``track(alerts=...)``: a step's rows (a log frame, in computation order) to a
#: message (the alert) or ``None`` (nothing to report).
Rule = Callable[[pd.DataFrame], "str | None"]
#: What ``track(on_nonfinite=...)`` takes besides ``None``.
NONFINITE_MODES = ("raise", "warn")

_NAN, _INF = FIELD_INDEX["nan_count"], FIELD_INDEX["inf_count"]


class AlertError(RuntimeError):
    """A rule of ``track(alerts=...)`` flagged a step. The log on disk holds every step up to
    that one and the tracker is closed.

    Attributes:
        step: the step flagged.
        rows: that step's rows (a log frame, in computation order).
    """

    def __init__(self, message: str, step: int, rows: pd.DataFrame) -> None:
        super().__init__(message)
        self.step = step
        self.rows = rows

    def __reduce__(self) -> tuple[Any, ...]:
        # the arguments again, so that the error crosses processes (multiprocessing, Ray)
        return (type(self), (str(self), self.step, self.rows))


class NonFiniteError(AlertError):
    """A tracked tensor held NaN or inf (``track(on_nonfinite="raise")``). The log on disk
    holds every step up to that one and the tracker is closed.

    Attributes:
        step: the first step whose tensors held NaN or inf.
        name, tensor_type: the first such tensor of that step in computation order.
        rows: the rows of that step's tensors holding NaN or inf, in computation order.
    """

    def __init__(self, message: str, step: int, rows: pd.DataFrame) -> None:
        super().__init__(message, step, rows)
        self.name = str(rows[("metadata", "name")].iloc[0])
        self.tensor_type = str(rows[("metadata", "tensor_type")].iloc[0])


def check_alert_options(on_nonfinite: Any, alerts: Any) -> tuple[Rule, ...]:
    """Check ``track(on_nonfinite=..., alerts=...)``; returns the rules of ``alerts`` as a tuple.

    Raises:
        ValueError / TypeError: naming the argument and what it takes.
    """
    mode = isinstance(on_nonfinite, str) and on_nonfinite in NONFINITE_MODES
    if not (on_nonfinite is None or mode or callable(on_nonfinite)):
        raise ValueError(
            f"track(on_nonfinite={on_nonfinite!r}): expected None, 'raise', 'warn', or a "
            f"callable taking the rows of the tensors that hold NaN/inf"
        )
    rules = () if alerts is None else (alerts,) if callable(alerts) else tuple(alerts)
    for rule in rules:
        if not callable(rule):
            raise TypeError(
                f"track(alerts=...): expected a callable (or a list of them) taking a step's "
                f"rows and returning a message or None; got {type(rule).__name__}"
            )
    return rules


def _rows(step: int, entries: Sequence[Any]) -> pd.DataFrame:
    """The rows of ``entries`` at ``step``, in computation order."""
    from .rows import build_rows

    rows = build_rows(step, entries)
    return rows.iloc[computation_order(rows)].reset_index(drop=True)


class AlertWatch:
    """Inspects each committed step (:meth:`inspect`) for NaN/inf and the user's rules, and
    keeps the first error due (:attr:`due`) for the tracker to raise.

    Arguments:
        on_nonfinite: ``"raise"``, ``"warn"`` (a ``RuntimeWarning`` at the first step holding
            NaN/inf, once), a callable given the rows of each such step's tensors that hold
            NaN/inf (an exception it raises is delivered as ``"raise"`` delivers its error),
            or ``None`` (no check).
        rules: callables ``rows -> message | None`` over each recorded step's rows; a message
            becomes an :class:`AlertError` due, an exception raised by a rule is due itself.
    """

    def __init__(self, on_nonfinite: Any, rules: Sequence[Rule]) -> None:
        self.on_nonfinite = on_nonfinite
        self.rules = tuple(rules)
        #: the error to raise from the next ``tracker.step()`` (the earliest step's)
        self.due: BaseException | None = None
        #: the log's path, for the messages (set by the tracker when the log opens)
        self.path: str | None = None
        self._warned = False

    @classmethod
    def of(cls, on_nonfinite: Any, alerts: Any) -> AlertWatch | None:
        """The watch of ``track()``'s options, or ``None`` when they ask for no alert."""
        rules = check_alert_options(on_nonfinite, alerts)
        return None if on_nonfinite is None and not rules else cls(on_nonfinite, rules)

    def inspect(self, step: int, entries: Sequence[tuple[Any, Any, np.ndarray]]) -> None:
        """Check the merged host summaries ``entries`` (``(key, layout, vector)``) of
        ``step``; the first error found is kept in :attr:`due`. Nothing is checked while an
        error is due (the tracker stops at that step)."""
        if self.due is not None or not entries:
            return
        if self.on_nonfinite is not None:
            bad = [e for e in entries if e[2][_NAN] > 0 or e[2][_INF] > 0]
            if bad:
                self._nonfinite(step, _rows(step, bad))
        if self.rules and self.due is None:
            rows = _rows(step, entries)
            for rule in self.rules:
                try:
                    message = rule(rows)
                except Exception as e:  # the rule's own error stops the run as an alert would
                    self.due = e
                    return
                if message is not None:
                    text = f"tandv: alert at step {step}: {message}{self._stopped(step)}"
                    self.due = AlertError(text, step, rows)
                    return

    def _stopped(self, step: int) -> str:
        where = f" {self.path}" if self.path else ""
        return f". Tracking stopped: the log{where} holds the steps up to {step}"

    def _nonfinite(self, step: int, rows: pd.DataFrame) -> None:
        mode = self.on_nonfinite
        if callable(mode):
            try:
                mode(rows)
            except Exception as e:
                self.due = e
            return
        first = rows.iloc[0]
        n = len(rows)
        message = (
            f"tandv: NaN/inf at step {step}: first in {first[('metadata', 'tensor_type')]} "
            f"{first[('metadata', 'name')]!r} ({int(first[('scalar_stats', 'nan_count')])} NaN, "
            f"{int(first[('scalar_stats', 'inf_count')])} inf) in computation order; {n} "
            f"tensor{'s' if n != 1 else ''} held NaN/inf at this step"
        )
        if mode == "raise":
            self.due = NonFiniteError(message + self._stopped(step), step, rows)
        elif not self._warned:
            self._warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=2)
