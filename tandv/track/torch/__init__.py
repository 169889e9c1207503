"""PyTorch tracker: ``from tandv.track.torch import track``.

See :func:`track` for the options and :mod:`tandv.track.torch.tracker` for what each
row of the log holds.
"""

from .noise import GradientNoiseScale
from .summary import dtype_name, summarize_torch
from .tracker import StatFn, Tracker, track

__all__ = ["track", "Tracker", "StatFn", "GradientNoiseScale", "summarize_torch", "dtype_name"]
