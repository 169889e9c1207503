"""Figures of a tandv log: exponent histograms, scalar statistics over training, the
layers x steps heatmap, percentile bands, an interactive notebook view and an HTML report.

Every function takes the log as a validated pandas DataFrame (see :func:`tandv.validate`)
and returns a :class:`matplotlib.figure.Figure` built without pyplot; in a notebook the
returned figure displays itself. Bad arguments raise :class:`VizArgumentError` listing what
the log holds.
"""

from ._data import VizArgumentError, select_layers
from .bands import SIGMA_PERCENTILES, log2_percentiles, percentile_bands
from .exp_hist import exp_hist, format_markers
from .interact import InteractiveView, NotInNotebookError, interactive
from .scalar import scalar_global_heatmap, scalar_line

__all__ = [
    "VizArgumentError",
    "exp_hist",
    "scalar_line",
    "scalar_global_heatmap",
    "percentile_bands",
    "interactive",
    "InteractiveView",
    "NotInNotebookError",
    "format_markers",
    "log2_percentiles",
    "select_layers",
    "SIGMA_PERCENTILES",
]
