"""What the framework callbacks share: a log path for each training run of one callback."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def run_options(options: dict[str, Any], runs: int) -> dict[str, Any]:
    """``track()``'s options for a callback's training run number ``runs`` (0 for the
    first): a given ``out`` is the first run's log; each later run (``train()`` or ``fit()``
    called again, after a failure for instance) writes beside it, ``<out>-2``, ``<out>-3``
    (before a pickle log's suffix), the first of these not taken, so no run's log meets
    another's (a log path is never reused)."""
    opts = {"distributed": False, **options}
    out = opts.get("out")
    if runs == 0 or out is None:
        return opts
    path = Path(os.fspath(out))
    k = runs + 1
    while True:
        nxt = path.with_name(f"{path.stem}-{k}{path.suffix}" if path.suffix else f"{path.name}-{k}")
        if not nxt.exists():
            return {**opts, "out": nxt}
        k += 1
