"""``viz.interactive``: explore a log in a Jupyter notebook with ipywidgets.

Controls for tensor type, layer, step and metric redraw the figure. On the global
heatmap, clicking a cell opens the exponent histogram of that layer at that step. A
``train_stats`` frame (loss or other training statistics by step) is drawn as a
linked curve: clicking it moves a crosshair to the nearest step and sets the step of
the other views.

Figures are shown as ipympl canvases when ipympl is installed (clicks work in
JupyterLab, Jupyter Notebook 7 and VS Code); without it they are static images and
the layer/step controls do what clicks would.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.backend_bases import MouseEvent
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..schema import METADATA, SCALAR_STATS, STEP, TENSOR_TYPE, TENSOR_TYPES
from ._data import (
    VizArgumentError,
    check_log,
    layer_order,
    logged_scalars,
    select_layers,
    select_metrics,
    select_tensor_types,
)
from ._facets import plain, step_axis
from .bands import percentile_bands
from .exp_hist import exp_hist
from .scalar import HeatmapPanel, heatmap_panels, scalar_global_heatmap, scalar_line

__all__ = ["interactive", "InteractiveView", "NotInNotebookError"]

_SUPPORTED = {
    "exp_hist": exp_hist,
    "scalar_line": scalar_line,
    "scalar_global_heatmap": scalar_global_heatmap,
    "percentile_bands": percentile_bands,
}
#: Choices of the histogram's format markers: label -> dtype_annotation value.
_ANNOTATIONS = {
    "logged dtype": True,
    "none": None,
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "bfloat16": "bfloat16",
    "float16": "float16",
}


class NotInNotebookError(RuntimeError):
    """``viz.interactive`` was called outside a Jupyter kernel."""


def _in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, Notebook, VS Code): an IPython shell
    with a kernel attached. Plain Python and terminal IPython have none."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _widgets() -> Any:
    try:
        return importlib.import_module("ipywidgets")
    except ImportError as e:  # pragma: no cover - ipywidgets is in the plot extra
        raise ImportError("viz.interactive needs ipywidgets: pip install 'tandv[plot]'") from e


def _figure_widget(fig: Figure) -> Any:
    """A widget showing ``fig``: an ipympl canvas (mouse events reach matplotlib) if
    ipympl is installed, else an Output holding the static image."""
    w = _widgets()
    try:
        backend = importlib.import_module("ipympl.backend_nbagg")
    except ImportError:
        out = w.Output()
        with out:
            from IPython.display import display

            display(fig)
        return out
    # The backend protocol's exports: a canvas widget for the figure, and its manager
    # (which gives it a toolbar), without registering the figure with pyplot.
    canvas = backend.FigureCanvas(fig)
    with warnings.catch_warnings():
        # ipympl's toolbar passes its canvas on to traitlets, which warns; nothing to act on.
        warnings.filterwarnings("ignore", "Passing unrecognized arguments", DeprecationWarning)
        backend.FigureManager(canvas, 0)
    canvas.header_visible = False
    canvas.resizable = False
    return canvas


def _check_train_stats(train_stats: Any) -> pd.DataFrame:
    """``train_stats`` as a frame with a ``step`` column and numeric curves."""
    if not isinstance(train_stats, pd.DataFrame):
        raise VizArgumentError(
            "train_stats: expected a pandas DataFrame of statistics by step; "
            f"found {type(train_stats).__name__}"
        )
    ts = train_stats
    if "step" not in ts.columns:
        if ts.index.name == "step":
            ts = ts.reset_index()
        else:
            raise VizArgumentError(
                "train_stats: expected a 'step' column (or an index named 'step'); "
                f"columns are {list(ts.columns)}"
            )
    curves = [c for c in ts.columns if c != "step" and pd.api.types.is_numeric_dtype(ts[c])]
    if not curves:
        raise VizArgumentError(
            f"train_stats: no numeric column to plot besides 'step'; columns are {list(ts.columns)}"
        )
    return ts[["step", *curves]].sort_values("step")


class InteractiveView:
    """The widgets of one interactive view; shows itself in a notebook.

    Attributes:
        widget: the top-level ipywidgets container.
        controls: the control widgets by name (``tt``, ``layer``, ``step``, ``scalar_metric``,
            ``dtype_annotation``, ``inc``), those that apply to the plotting function.
        figure: the main figure now shown; ``detail_figure`` the histogram opened from
            the heatmap; ``stats_figure`` the training-statistics curve.
        step: the step the crosshair marks (``None`` until one is chosen).
    """

    def __init__(
        self,
        f: Callable[..., Figure],
        df: pd.DataFrame,
        train_stats: pd.DataFrame | bool | None = None,
        **kwargs: Any,
    ) -> None:
        name = getattr(f, "__name__", repr(f))
        if _SUPPORTED.get(name) is not f:
            raise VizArgumentError(
                f"interactive: f={name!r} is not a tandv.viz plot; "
                f"expected one of {list(_SUPPORTED)}"
            )
        self.f, self.kind, self.df = f, name, check_log(df)
        self.kwargs = dict(kwargs)
        if train_stats is None:  # the scalars logged beside the log (tracker.log_scalars), if any
            train_stats = logged_scalars(self.df)
        elif train_stats is False:
            train_stats = None
        self.train_stats = None if train_stats is None else _check_train_stats(train_stats)
        self.figure: Figure | None = None
        self.detail_figure: Figure | None = None
        self.stats_figure: Figure | None = None
        self.panels: list[HeatmapPanel] = []
        self._updating = False  # set while the view itself changes a control
        self.selected: tuple[str, str, int] | None = None  # heatmap cell: (tt, layer, step)
        self.step: int | None = kwargs.get("step") if name == "exp_hist" else None
        w = _widgets()
        self._w = w
        # Build the first figure before any widget, so bad arguments fail at once.
        first = self._call(self.kwargs)
        self.controls = self._make_controls()
        self.message = w.HTML()
        self.main = w.Box()
        self.detail = w.Box()
        self.stats = w.Box()
        self._show_main(first)
        self._draw_stats()
        self.widget = w.VBox(
            [
                w.HBox(list(self.controls.values()), layout=w.Layout(flex_flow="row wrap")),
                self.message,
                self.stats,
                self.main,
                self.detail,
            ]
        )
        for c in self.controls.values():
            c.observe(self._on_control, names="value")

    # ------------------------------------------------------------------ building

    def _call(self, kw: dict[str, Any]) -> Figure:
        if self.kind == "scalar_global_heatmap":
            fig, self.panels = heatmap_panels(self.df, **kw)
            return fig
        return self.f(self.df, **kw)

    def _types(self) -> list[str]:
        return [t for t in TENSOR_TYPES if (self.df[(METADATA, TENSOR_TYPE)] == t).any()]

    def _layers_of(self, tts: Any) -> list[str]:
        rows = self.df[self.df[(METADATA, TENSOR_TYPE)].isin(list(tts))]
        return layer_order(rows)

    def _make_controls(self) -> dict[str, Any]:
        w, kw, df = self._w, self.kwargs, self.df
        controls: dict[str, Any] = {}
        tts = select_tensor_types(df, kw["tt"])
        controls["tt"] = w.SelectMultiple(
            options=self._types(), value=tuple(tts), description="tensor type", rows=4
        )
        if self.kind in ("exp_hist", "scalar_line", "percentile_bands"):
            names = self._layers_of(tts)
            layer = kw.get("layer")
            chosen = select_layers(df, layer, tts) if layer is not None else []
            controls["layer"] = w.SelectMultiple(
                options=names, value=tuple(chosen), description="layer", rows=6
            )
        # The histogram's step; elsewhere the crosshair's (and the opened histogram's).
        steps = sorted(int(s) for s in pd.unique(df[(METADATA, STEP)]))
        start = int(kw["step"]) if self.kind == "exp_hist" else steps[0]
        controls["step"] = w.SelectionSlider(
            options=steps, value=start, description="step", continuous_update=False
        )
        if self.kind == "exp_hist":
            current = kw.get("dtype_annotation", True)
            label = next(
                (k for k, v in _ANNOTATIONS.items() if v == current and type(v) is type(current)),
                None,
            )
            options = list(_ANNOTATIONS) if label else [*_ANNOTATIONS, str(current)]
            controls["dtype_annotation"] = w.Dropdown(
                options=options, value=label or str(current), description="markers"
            )
        stats = [c for g, c in df.columns if g == SCALAR_STATS]
        if self.kind == "scalar_line":
            metrics = select_metrics(df, kw["scalar_metric"])
            controls["scalar_metric"] = w.SelectMultiple(
                options=stats, value=tuple(metrics), description="metric", rows=6
            )
        if self.kind == "scalar_global_heatmap":
            (metric,) = select_metrics(df, kw["scalar_metric"])
            controls["scalar_metric"] = w.Dropdown(
                options=stats, value=metric, description="metric"
            )
        if self.kind in ("scalar_global_heatmap", "percentile_bands"):
            controls["inc"] = w.BoundedIntText(
                value=int(kw.get("inc", 1)), min=1, max=10**9, description="every k steps"
            )
        return controls

    def _current_kwargs(self) -> dict[str, Any]:
        kw = dict(self.kwargs)
        for key, c in self.controls.items():
            if key == "step" and self.kind != "exp_hist":
                continue  # the crosshair's step is not an argument of the figure
            value = c.value
            if key in ("tt", "layer", "scalar_metric") and isinstance(value, tuple):
                value = list(value)
            if key == "dtype_annotation":
                value = _ANNOTATIONS.get(value, value)
            kw[key] = value
        return kw

    # ------------------------------------------------------------------ updating

    def _show(self, box: Any, fig: Figure, on_click: Callable[[MouseEvent], None] | None) -> None:
        for old in box.children:
            old.close()
        widget = _figure_widget(fig)
        if on_click is not None:
            fig.canvas.mpl_connect("button_press_event", on_click)
        box.children = [widget]

    def _show_main(self, fig: Figure) -> None:
        self.figure = fig
        self._mark_step()
        self._show(
            self.main, fig, self.click_heatmap if self.kind == "scalar_global_heatmap" else None
        )

    def _on_control(self, change: dict) -> None:
        if self._updating:
            return
        owner = change["owner"]
        if owner is self.controls["tt"] and "layer" in self.controls:
            # Offer the layers of the chosen tensor types, keeping those still there.
            layers = self.controls["layer"]
            names = self._layers_of(self.controls["tt"].value)
            keep = tuple(n for n in layers.value if n in names)
            self._updating = True
            try:
                layers.options = names
                layers.value = keep or tuple(names[:1])
            finally:
                self._updating = False
        if owner is self.controls["step"]:
            self.step = int(owner.value)
            if self.kind != "exp_hist":  # only the crosshair moves
                self._step_changed()
                return
        self.redraw()

    def redraw(self) -> None:
        """Redraw the main figure from the controls; an argument the log cannot serve
        (e.g. a step at which a chosen layer was not logged) shows as a message."""
        kw = self._current_kwargs()
        if "layer" in kw and not kw["layer"]:
            if self.kind != "percentile_bands":
                self.message.value = "<b>Choose at least one layer.</b>"
                return
            kw["layer"] = None  # no layer chosen: the bands of the whole model
        try:
            fig = self._call(kw)
        except VizArgumentError as e:
            self.message.value = f"<b>{type(e).__name__}:</b> {e}"
            return
        self.message.value = ""
        self._show_main(fig)
        if self.selected is not None:
            self.select_cell(*self.selected)

    # ------------------------------------------------------------------ heatmap -> histogram

    def click_heatmap(self, event: MouseEvent) -> None:
        """A click on a heatmap cell opens that layer's histogram at that step."""
        for p in self.panels:
            if event.inaxes is p.ax and event.xdata is not None and event.ydata is not None:
                cell = p.cell_at(event.xdata, event.ydata)
                if cell is not None:
                    self.select_cell(p.tt, *cell)
                return

    def select_cell(self, tt: str, layer: str, step: int) -> None:
        """Show the exponent histogram of ``layer`` (``tt``) at ``step`` under the heatmap,
        and outline its cell."""
        self.selected = (tt, layer, int(step))
        for p in self.panels:
            for patch in [a for a in p.ax.patches if a.get_gid() == "selected"]:
                patch.remove()
            if p.tt == tt and layer in p.layers and int(step) in p.steps:
                p.ax.add_patch(
                    Rectangle(
                        (p.steps.index(int(step)), p.layers.index(layer)),
                        1,
                        1,
                        fill=False,
                        edgecolor="red",
                        linewidth=2,
                        gid="selected",
                    )
                )
        if self.figure is not None:
            self.figure.canvas.draw_idle()
        try:
            fig = exp_hist(
                self.df,
                layer,
                tt,
                int(step),
                dtype_annotation=self.kwargs.get("dtype_annotation", True),
            )
        except VizArgumentError as e:
            self.message.value = f"<b>{type(e).__name__}:</b> {e}"
            return
        self.detail_figure = fig
        self._show(self.detail, fig, None)

    # ------------------------------------------------------------------ training statistics

    def _draw_stats(self) -> None:
        if self.train_stats is None:
            return
        ts = self.train_stats
        curves = [c for c in ts.columns if c != "step"]
        fig = Figure(figsize=(8, 2.6), layout="constrained")
        ax = fig.subplots()
        for c in curves:
            ax.plot(ts["step"].to_numpy(), ts[c].to_numpy(dtype=np.float64), label=plain(c))
        step_axis(ax)
        ax.set_title("training statistics (click to choose a step)", fontsize=9)
        ax.legend(fontsize=7, loc="best")
        ax.grid(True, alpha=0.3)
        self.stats_figure = fig
        self._mark_step()
        self._show(self.stats, fig, self.click_stats)

    def click_stats(self, event: MouseEvent) -> None:
        """A click on the training-statistics curve sets the step to the logged step nearest it."""
        if event.inaxes is None or event.xdata is None or self.stats_figure is None:
            return
        if event.inaxes.figure is not self.stats_figure:
            return
        self.set_step(self._nearest_step(event.xdata))

    def _nearest_step(self, x: float) -> int:
        steps = np.array(sorted(int(s) for s in pd.unique(self.df[(METADATA, STEP)])))
        return int(steps[np.argmin(np.abs(steps - x))])

    def set_step(self, step: int) -> None:
        """Move the crosshair to ``step`` (through the step control, so it shows there):
        the histogram shows that step, the other views mark it."""
        control = self.controls["step"]
        if control.value == int(step):  # no change event: act on it here
            self._on_control({"owner": control})
        else:
            control.value = int(step)  # the observer does the rest

    def _step_changed(self) -> None:
        if (
            self.kind == "scalar_global_heatmap"
            and self.selected is not None
            and self.step is not None
        ):
            self.select_cell(self.selected[0], self.selected[1], self.step)
        self._mark_step()
        for fig in (self.figure, self.stats_figure):
            if fig is not None:
                fig.canvas.draw_idle()

    def _mark_step(self) -> None:
        """Draw the crosshair at ``step``: a vertical line on the curve and line plots, and
        around the step's column on the heatmap."""
        if self.step is None:
            return
        for fig in (self.stats_figure, self.figure if self.kind != "exp_hist" else None):
            if fig is None:
                continue
            for ax in fig.axes:
                for line in [l for l in ax.get_lines() if l.get_gid() == "crosshair"]:
                    line.remove()
        if self.stats_figure is not None:
            self.stats_figure.axes[0].axvline(
                self.step, color="k", linestyle="--", linewidth=1, gid="crosshair"
            )
        if self.kind in ("scalar_line", "percentile_bands") and self.figure is not None:
            for ax in self.figure.axes:
                ax.axvline(self.step, color="k", linestyle="--", linewidth=1, gid="crosshair")
        if self.kind == "scalar_global_heatmap":
            for p in self.panels:
                if self.step in p.steps:  # heatmap x runs over column indices
                    p.ax.axvline(
                        p.steps.index(self.step) + 0.5,
                        color="red",
                        linestyle="--",
                        linewidth=1,
                        gid="crosshair",
                    )

    # ------------------------------------------------------------------ display

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)


def interactive(
    f: Callable[..., Figure],
    df: pd.DataFrame,
    train_stats: pd.DataFrame | bool | None = None,
    **kwargs: Any,
) -> InteractiveView:
    """An interactive version of a plot in a Jupyter notebook.

    Pass a plotting function of :mod:`tandv.viz` (``exp_hist``, ``scalar_line``,
    ``scalar_global_heatmap`` or ``percentile_bands``) and its keyword arguments; the
    view adds controls for tensor type, layer, step and metric (those the function
    takes). The step control sets the histogram's step and elsewhere moves a crosshair.
    On the heatmap, click a cell to open the exponent histogram of that layer at that
    step (it then follows the step control). With ``train_stats`` (a DataFrame with a
    ``step`` column, or index, and numeric columns such as ``loss``) a linked curve is
    drawn: clicking it sets the
    step, shown as a crosshair on line plots and as the histogram's step. By default
    (``train_stats=None``) the scalars logged beside the log with ``tracker.log_scalars``
    are drawn (when ``df`` was read from a file that has them: :func:`tandv.read_scalars`);
    ``train_stats=False`` draws none.

    Returns the view; as a cell's last expression it displays itself (or use
    ``IPython.display.display(view)``).

    Raises:
        NotInNotebookError: outside a Jupyter kernel (use the static functions there).
        tandv.SchemaError, VizArgumentError: for a bad log or arguments, as ``f`` would.
    """
    if not _in_notebook():
        raise NotInNotebookError(
            "viz.interactive needs a Jupyter kernel (JupyterLab, Jupyter Notebook "
            "or a VS Code notebook); "
            "outside one, call the plotting function directly, "
            "e.g. viz.exp_hist(df, ...).savefig('fig.png')"
        )
    return InteractiveView(f, df, train_stats, **kwargs)
