"""Schedules: which steps are tracked. A schedule is a plain callable ``step -> bool``."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection

__all__ = ["Schedule", "make_schedule", "linear", "parse_linear"]

Schedule = Callable[[int], bool]


def linear(interval: int, offset: int = 0) -> Schedule:
    """Track steps ``offset, offset + interval, offset + 2*interval, ...`` (Taiyi's ``linear``)."""
    if not isinstance(interval, int) or interval < 1:
        raise ValueError(
            f"linear(interval, offset): interval must be an int >= 1; got {interval!r}"
        )
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"linear(interval, offset): offset must be an int >= 0; got {offset!r}")
    return lambda step: step >= offset and (step - offset) % interval == 0


_LINEAR = re.compile(r"^\s*linear\s*\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?\)\s*$")


def parse_linear(text: str, what: str = "schedule=", note: str = "") -> Schedule:
    """Taiyi's schedule string ``"linear(interval, offset)"`` as a schedule: the one parser
    of it, for the trackers' ``schedule=`` and for Taiyi configs.

    It fires at steps ``offset, offset + interval, offset + 2 * interval, ...``
    (``"linear(5, 2)"``: 2, 7, 12, ...); ``offset`` defaults to 0. ``interval`` 0 means every
    step from ``offset`` on: Taiyi documents ``"linear(0, 0)"`` as its default, and its
    default tracks every step.

    Arguments:
        text: the string.
        what: how the error names the setting (``"schedule="``).
        note: said at the end of the error (what else the caller accepts).

    Raises:
        ValueError: for any other string, saying what is accepted.
    """
    m = _LINEAR.match(text)
    if not m:
        raise ValueError(
            f"{what}{text!r}: expected 'linear(interval, offset)' with non-negative integers, "
            f"e.g. 'linear(5, 2)' for steps 2, 7, 12, ...{note}"
        )
    return linear(max(int(m.group(1)), 1), int(m.group(2) or 0))


def make_schedule(
    every: int = 1,
    schedule: Schedule | str | Collection[int] | None = None,
    start: int = 0,
    end: int | None = None,
) -> Schedule:
    """Build the tracker's schedule from its options.

    Arguments:
        every: track every N-th step (0, N, 2N, ...); ignored when ``schedule`` is given.
        schedule: a callable ``step -> bool``; a string ``"linear(interval, offset)"``
            (:func:`parse_linear`); or a collection of step numbers.
        start, end: track only steps with ``start <= step < end`` (``end=None``: no end).

    Raises:
        ValueError / TypeError: naming the argument that is wrong.
    """
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"every={every!r}: expected an int >= 1 (track every N-th step)")
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start={start!r}: expected an int >= 0")
    if end is not None and (not isinstance(end, int) or end < start):
        raise ValueError(f"end={end!r}: expected None or an int >= start ({start})")
    if schedule is None:
        base: Schedule = (lambda step: step % every == 0) if every > 1 else (lambda step: True)
    elif isinstance(schedule, str):
        base = parse_linear(schedule)
    elif callable(schedule):
        base = schedule
    elif isinstance(schedule, Collection):
        steps = frozenset(schedule)
        if not all(isinstance(s, int) and s >= 0 for s in steps):
            raise ValueError("schedule: a collection of steps must hold ints >= 0")
        base = steps.__contains__
    else:
        raise TypeError(
            f"schedule={schedule!r}: expected a callable step -> bool, 'linear(interval, offset)', "
            f"or a collection of steps"
        )
    if start == 0 and end is None:
        return base
    return lambda step: start <= step and (end is None or step < end) and bool(base(step))
