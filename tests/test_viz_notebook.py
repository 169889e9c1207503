"""Executes the example notebook (torch tracking -> figures -> interactive view -> report)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def test_example_notebook_runs(tmp_path, monkeypatch):
    import nbclient
    import nbformat

    # The kernel is a fresh process: make it import this checkout's tandv.
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    figures = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(figures) >= 4  # exp_hist, scalar_line, heatmap, percentile bands
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)
    report = tmp_path / "quickstart_report.html"
    assert report.is_file() and report.stat().st_size > 50_000
