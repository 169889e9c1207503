"""Custom statistics: the ``stats`` / ``stats_merge`` options shared by both trackers."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...stats.summary import DEFAULT_STATS, MERGE_RULES

__all__ = ["StatFn", "StatsSpec", "parse_custom_stats"]

#: A custom statistic function: one tensor/array in, ``{name: scalar}`` out.
StatFn = Callable[[Any], Mapping[str, Any]]
#: What ``track(stats=...)`` accepts (see :func:`parse_custom_stats`).
StatsSpec = StatFn | Sequence[StatFn] | Mapping[str, Any] | None


def parse_custom_stats(
    stats: StatsSpec, stats_merge: Mapping[str, str] | None = None
) -> tuple[tuple[StatFn, ...], dict[str, str]]:
    """Normalize the trackers' ``stats`` and ``stats_merge`` options.

    ``stats`` may be

    - a function ``f(x) -> {name: scalar}``, or a list of them (several names per function);
    - a mapping ``{name: f}`` with ``f(x) -> scalar``, or ``{name: (f, rule)}``.

    ``stats_merge`` maps names to how observations of one tensor in one step combine:
    ``"sum"``, ``"min"``, ``"max"`` or ``"mean"`` (weighted by element count; the default).

    Returns:
        ``(functions, rules)``: functions each returning ``{name: scalar}``, and the merge
        rule of every name given a rule (others default to ``"mean"``).

    Raises:
        TypeError / ValueError: naming the entry that is wrong.
    """
    rules: dict[str, str] = {}
    fns: list[StatFn] = []
    if stats is None:
        pass
    elif isinstance(stats, Mapping):
        singles: dict[str, Callable[[Any], Any]] = {}
        for name, spec in stats.items():
            fn, rule = (
                (spec, None)
                if callable(spec)
                else (spec if isinstance(spec, tuple) and len(spec) == 2 else (None, None))
            )
            if not isinstance(name, str) or not callable(fn):
                raise TypeError(
                    f"stats[{name!r}]: expected a function x -> scalar, or (function, rule); "
                    f"got {spec!r}"
                )
            singles[name] = fn
            if rule is not None:
                rules[name] = rule
        fns.append(functools.partial(_apply_each, singles))
    else:
        items = (stats,) if callable(stats) else tuple(stats)
        for f in items:
            if not callable(f):
                raise TypeError(
                    f"stats: expected functions x -> {{name: scalar}} (or a mapping name -> "
                    f"function); got {f!r}"
                )
        fns.extend(items)
    where = {name: f"stats[{name!r}]: merge rule {rule!r}" for name, rule in rules.items()}
    for name, rule in (stats_merge or {}).items():
        rules[name] = rule
        where[name] = f"stats_merge[{name!r}]={rule!r}"
    for name, rule in rules.items():
        if rule not in MERGE_RULES:
            raise ValueError(f"{where[name]}: expected one of {MERGE_RULES}")
        if name in DEFAULT_STATS:
            raise ValueError(
                f"custom statistic {name!r} clashes with a default statistic; rename it"
            )
    return tuple(fns), rules


def percentile_columns(percentiles: Sequence[float] | None) -> tuple[tuple[str, float], ...]:
    """The trackers' ``percentiles`` option as ``((column, q), ...)``: ``q`` in [0, 100],
    columns named ``pct<q>`` (``pct1``, ``pct50``, ``pct99.9``).

    Raises:
        TypeError / ValueError: naming the entry that is not a percentage.
    """
    if percentiles is None:
        return ()
    if isinstance(percentiles, (str, bytes)) or not isinstance(percentiles, Sequence):
        raise TypeError(
            f"percentiles={percentiles!r}: expected a sequence of percentages, e.g. (1, 50, 99)"
        )
    out: dict[str, float] = {}
    for q in percentiles:
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 100:
            raise ValueError(f"percentiles: {q!r} is not a percentage in [0, 100]")
        out[f"pct{float(q):g}"] = float(q)
    if not out:
        raise ValueError("percentiles=(): give at least one percentage, or leave the option out")
    return tuple(out.items())


def _apply_each(fns: Mapping[str, StatFn], x: Any) -> dict[str, Any]:
    """``{name: fn(x)}`` for the functions given one by name in ``stats``."""
    return {k: f(x) for k, f in fns.items()}
