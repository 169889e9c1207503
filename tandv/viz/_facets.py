"""A grid of panels on a matplotlib Figure (built without pyplot, so figures made in a
loop, e.g. by the report, are not kept alive by pyplot's figure registry)."""

from __future__ import annotations

import io
import math

import numpy as np
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = [
    "facet_grid",
    "figure_legend",
    "step_axis",
    "plain",
    "AUTO_COLUMNS",
    "NotebookFigure",
]

#: Panels per row when a figure's ``col_wrap`` is not given.
AUTO_COLUMNS = 4


class NotebookFigure(Figure):
    """A Figure that shows itself as a PNG when a notebook displays it: IPython asks an
    object for ``_repr_png_``, so no pyplot backend and no formatter registered on import
    are needed (a pyplot or inline backend's own printer, where set up, still wins)."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", bbox_inches="tight")
        return buf.getvalue()


def facet_grid(
    n: int,
    col_wrap: int | None,
    panel_size: tuple[float, float] = (4.8, 3.2),
    figsize: tuple[float, float] | None = None,
    sharex: bool = False,
    sharey: bool = False,
) -> tuple[NotebookFigure, list[Axes]]:
    """A Figure with ``n`` panels, ``col_wrap`` per row (``None``: at most
    :data:`AUTO_COLUMNS`, so 20-60 panels wrap into a readable grid).

    Panels beyond ``n`` in the last row are removed, so ``fig.axes`` holds exactly the
    panels (plus any colorbars added later)."""
    if col_wrap is not None and (
        isinstance(col_wrap, bool) or not isinstance(col_wrap, (int, np.integer)) or col_wrap < 1
    ):
        raise ValueError(f"col_wrap={col_wrap!r}: expected None or an int >= 1")
    ncols = min(n, AUTO_COLUMNS) if col_wrap is None else min(int(col_wrap), n)
    ncols = max(ncols, 1)
    nrows = max(math.ceil(n / ncols), 1)
    if figsize is None:
        figsize = (panel_size[0] * ncols, panel_size[1] * nrows + 0.4)
    fig = NotebookFigure(figsize=figsize, layout="constrained")
    grid = fig.subplots(nrows, ncols, squeeze=False, sharex=sharex, sharey=sharey)
    axes = list(grid.ravel())
    for ax in axes[n:]:
        ax.remove()
    return fig, axes[:n]


def plain(text: object) -> str:
    """``text`` (a tensor, statistic or scalar name from a log) as matplotlib shows it
    literally: ``$`` escaped, so a name like ``$x^$`` is not parsed as mathtext (which
    fails on it, or changes how it reads), and control characters written as escapes."""
    s = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in str(text))
    return s.replace("$", r"\$")


def figure_legend(fig: Figure, axes: list[Axes]) -> None:
    """One legend for the whole figure, below the panels, with each label once (in the
    order first met across the panels)."""
    seen: dict[str, Artist] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    if seen:
        fig.legend(
            list(seen.values()),
            list(seen),
            loc="outside lower center",
            ncols=min(len(seen), 6),
            fontsize=7,
            frameon=False,
        )


def step_axis(ax: Axes) -> None:
    """Label the x axis ``step`` and tick it at whole steps only."""
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
