"""Schedules: which steps are tracked. A schedule is a plain callable ``step -> bool``."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection

__all__ = ["Schedule", "make_schedule", "linear"]

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


def make_schedule(
    every: int = 1,
    schedule: Schedule | str | Collection[int] | None = None,
    start: int = 0,
    end: int | None = None,
) -> Schedule:
    """Build the tracker's schedule from its options.

    Arguments:
        every: track every N-th step (0, N, 2N, ...); ignored when ``schedule`` is given.
        schedule: a callable ``step -> bool``; a string ``"linear(interval, offset)"``;
            or a collection of step numbers.
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
        m = _LINEAR.match(schedule)
        if not m:
            raise ValueError(
                f"schedule={schedule!r}: expected 'linear(interval, offset)', e.g. 'linear(5, 2)' "
                f"for steps 2, 7, 12, ..."
            )
        base = linear(int(m.group(1)), int(m.group(2) or 0))
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
