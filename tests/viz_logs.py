"""Hand-built tandv logs for the viz tests, made without any DL framework.

Rows come from the numpy reference (:func:`tandv.stats.summarize`) through the same
row builder the trackers use (:func:`tandv.track.common.build_rows`), so the logs look
like real ones; the tests then compare figures against these logs' own values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from tandv.schema import concat_logs, validate
from tandv.stats import format_name, summarize
from tandv.track.common import TensorKey, build_rows

Entry = tuple[str, str, int]  # (name, tensor_type, step)


def log_from_arrays(
    arrays: Mapping[Entry, np.ndarray], fmt: Any = None, module_type: str = "Linear"
) -> pd.DataFrame:
    """A log with one row per ``(name, tensor_type, step)`` holding the summary of its array.

    Exponent counts use ``fmt`` (default: each array's own dtype)."""
    by_step: dict[int, list] = {}
    for (name, tt, step), x in arrays.items():
        v, layout = summarize(x, fmt)
        key = TensorKey(name, tt, module_type, format_name(np.asarray(x).dtype))
        by_step.setdefault(step, []).append((key, layout, v))
    return validate(concat_logs([build_rows(s, by_step[s]) for s in sorted(by_step)]))


LAYERS = ("embed", "layers.0.attn", "layers.0.mlp", "layers.1.attn", "layers.1.mlp", "head")
TYPES = ("Activation", "Gradient", "Weight")


def training_log(steps: int = 8, seed: int = 0, nan_from: int | None = 5) -> pd.DataFrame:
    """A small run: six layers, three tensor types, ``steps`` steps (0..steps-1).

    Scales differ by tensor type (gradients small) and the head's activations grow
    ten-fold per step, so its metrics span decades; from step ``nan_from`` the head's
    gradient holds a NaN and an inf."""
    rng = np.random.default_rng(seed)
    arrays: dict[Entry, np.ndarray] = {}
    for step in range(steps):
        for i, name in enumerate(LAYERS):
            for tt, scale in zip(TYPES, (1.0, 1e-3, 0.05)):
                s = (
                    scale
                    * (1 + i)
                    * (10.0**step if (name == "head" and tt == "Activation") else 1.0)
                )
                x = (rng.standard_normal(256) * s).astype(np.float32)
                if tt == "Activation" and name.endswith("mlp"):
                    x[x < 0] = 0  # ReLU output: zeros are not counted in the histogram
                if (
                    nan_from is not None
                    and step >= nan_from
                    and name == "head"
                    and tt == "Gradient"
                ):
                    x[0], x[1] = np.nan, np.inf
                arrays[(name, tt, step)] = x
    return log_from_arrays(arrays)
