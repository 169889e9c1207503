"""Small real logs for tests, built from numpy arrays through the reference summary
and the shared recorder (no framework needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from tandv.schema import read_log
from tandv.stats import summarize
from tandv.track.common import StepRecorder, TensorKey


def make_arrays(steps: int = 4, seed: int = 0) -> dict[tuple[str, str, int], np.ndarray]:
    """{(name, tensor_type, step): array}: float32 weights and bfloat16 activations whose
    scale grows by 10x per step, with NaNs in ``b`` at step 2."""
    rng = np.random.default_rng(seed)
    out = {}
    for step in range(steps):
        for name in ("a", "b"):
            x = (rng.standard_normal(200) * 10.0**step).astype(np.float32)
            if step == 2 and name == "b":
                x[:3] = np.nan
            out[(name, "Weight", step)] = x
            out[(name, "Activation", step)] = x.astype("bfloat16")
    return out


def make_log(
    path: Path, steps: int = 4, out_format: str = "parquet", **kw
) -> tuple[pd.DataFrame, dict]:
    """Write a log of :func:`make_arrays` with :class:`StepRecorder`; return (read log, arrays)."""
    arrays = make_arrays(steps)
    rec = StepRecorder(path, out_format, verbose=False, **kw)
    for step in range(steps):
        for (name, tt, s), x in arrays.items():
            if s == step:
                v, layout = summarize(x)
                rec.add(TensorKey(name, tt, "Linear", str(x.dtype)), layout, v)
        rec.commit(step, rec.take(), lambda xs: xs)
    rec.close()
    return read_log(path, trust_pickle=True), arrays
