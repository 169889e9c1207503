"""The HTML report: self-contained, right content, and clean in a real browser."""

from __future__ import annotations

import base64
import io
import os
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from browser import Browser, chromium_path
from PIL import Image
from viz_logs import log_from_arrays, training_log

from tandv import viz
from tandv.cli import main
from tandv.schema import write_parquet
from tandv.viz.report import write_report


class Page(HTMLParser):
    """Collects tags with their attributes, tables (as lists of row cells) and sections."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.tables: list[list[list[str]]] = []
        self.section_imgs: dict[str, int] = {}
        self._section: str | None = None
        self._cell: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "section":
            self._section = a.get("id")
            self.section_imgs[self._section] = 0
        elif tag == "img" and self._section:
            self.section_imgs[self._section] += 1
        elif tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def records(table: list[list[str]]) -> list[dict[str, str]]:
    head, *rows = table
    return [dict(zip(head, r)) for r in rows]


def find_table(page: Page, first_header: str, has: str) -> list[dict[str, str]]:
    for t in page.tables:
        if t and t[0] and t[0][0] == first_header and has in t[0]:
            return records(t)
    raise AssertionError(f"no table with columns {first_header!r}, {has!r}")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, str]:
    path = write_report(
        training_log(steps=8), tmp_path_factory.mktemp("rep") / "report.html", title="Run <42>"
    )
    return path, path.read_text(encoding="utf-8")


def test_report_is_one_self_contained_file(report):
    path, text = report
    page = Page(text)
    tags = [t for t, _ in page.tags]
    assert "script" not in tags and "link" not in tags and "iframe" not in tags
    imgs = [a["src"] for t, a in page.tags if t == "img"]
    assert imgs and all(src.startswith("data:image/png;base64,") for src in imgs)
    for src in imgs:  # every figure is a real PNG
        Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).verify()
    links = [a.get("href") for t, a in page.tags if a.get("href")]
    assert all(h.startswith("#") for h in links)
    assert "http://" not in text and "https://" not in text
    assert "<title>Run &lt;42&gt;</title>" in text  # the title is escaped
    assert path.stat().st_mode & 0o777 == 0o644


def test_report_sections_and_figures(report):
    _, text = report
    page = Page(text)
    assert list(page.section_imgs) == [
        "overview",
        "nonfinite",
        "formats",
        "ranges",
        "heatmaps",
        "bands",
    ]
    assert page.section_imgs["heatmaps"] == 3  # one heatmap per tensor type in the log
    assert page.section_imgs["ranges"] == 3  # histograms of the top tensors per tensor type
    assert page.section_imgs["bands"] == 1
    overview = find_table(page, "tensor type", "tensors")
    assert [(r["tensor type"], r["tensors"], r["steps logged"]) for r in overview] == [
        ("Activation", "6", "8"),
        ("Gradient", "6", "8"),
        ("Weight", "6", "8"),
    ]
    # The head's gradient gets one NaN and one inf from step 5 (see viz_logs.training_log).
    assert find_table(page, "tensor", "first step") == [
        {"tensor": "head", "tensor type": "Gradient", "first step": "5", "NaN": "1", "inf": "1"}
    ]
    worrying = find_table(page, "tensor", "binades")
    assert (
        worrying[0]["tensor"],
        worrying[0]["tensor type"],
        worrying[0]["NaN+inf (all steps)"],
    ) == ("head", "Gradient", "6")


def test_report_underflow_and_overflow_shares():
    # 8 values: 2**-12 underflows float8_e4m3fn (smallest subnormal 2**-9) but not e5m2
    # (2**-16); 2**-20 underflows both float8 formats; 1e5 overflows both (max 448 / 57344);
    # bfloat16 holds all of them.
    x = np.array([2.0**-12, 2.0**-20, 1e5, 1, 1, 1, 1, 1], np.float32)
    log = log_from_arrays({("w", "Weight", 0): x, ("a", "Activation", 0): np.ones(4, np.float32)})
    text = Path(write_report(log, "r.html", "t")).read_text()
    page = Page(text)
    shares = {r["format"]: r for r in find_table(page, "format", "Weight underflow")}
    assert (
        shares["float8_e4m3fn"]["Weight underflow"] == "25%"
        and shares["float8_e4m3fn"]["Weight overflow"] == "12.5%"
    )
    assert (
        shares["float8_e5m2"]["Weight underflow"] == "12.5%"
        and shares["float8_e5m2"]["Weight overflow"] == "12.5%"
    )
    assert (
        shares["bfloat16"]["Weight underflow"] == "0"
        and shares["bfloat16"]["Weight overflow"] == "0"
    )
    assert all(shares[f]["Activation underflow"] == "0" for f in shares)
    assert "No NaN or inf was logged in any tensor." in text


def test_cli_report_writes_the_file(capsys):
    write_parquet(training_log(steps=3, nan_from=None), "log.parquet")
    assert main(["report", "log.parquet", "-o", "out/report.html"]) == 0
    assert "report written to out/report.html" in capsys.readouterr().out
    assert Page(Path("out/report.html").read_text()).section_imgs["heatmaps"] == 3


def test_report_refuses_an_invalid_log():
    with pytest.raises(viz.VizArgumentError, match="no rows"):
        write_report(training_log(steps=2).iloc[:0], "r.html", "t")


# ------------------------------------------------------------------ real browser


def blank_fraction(png: bytes) -> tuple[float, int]:
    """(share of pixels that are the page's most common colour, number of distinct colours)."""
    im = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3)
    colours, counts = np.unique(im, axis=0, return_counts=True)
    return counts.max() / counts.sum(), len(colours)


@pytest.fixture(scope="module")
def browser():
    if chromium_path() is None:
        # `make test` must pass on a machine with only python3 and make; CI (.ci/run)
        # installs chromium and sets TANDV_REQUIRE_BROWSER=1, which makes the test required
        message = (
            "chromium is not installed: the report's browser test needs Debian's `chromium` "
            "package (apt-get install chromium; .ci/run installs it)"
        )
        if os.environ.get("TANDV_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    with Browser() as b:
        yield b


def test_report_in_headless_chromium(report, browser):
    path, _ = report
    result = browser.open(path.resolve().as_uri())
    assert result.console_errors == []
    assert result.network_requests == []
    im = Image.open(io.BytesIO(result.screenshot_png))
    assert im.height > 2000  # the full page, figures included, was laid out
    dominant, ncolours = blank_fraction(result.screenshot_png)
    assert dominant < 0.95 and ncolours > 200


def test_browser_check_catches_errors_network_and_blank_pages(tmp_path, browser):
    """The checks above can fail: a broken page and a blank page are caught."""
    bad = tmp_path / "bad.html"
    bad.write_text(
        '<html><body><img src="https://tandv.invalid/x.png">'
        '<script>console.error("broken"); missing();</script></body></html>'
    )
    result = browser.open(bad.as_uri())
    assert "broken" in result.console_errors
    assert any("missing is not defined" in e for e in result.console_errors)
    assert result.network_requests == ["https://tandv.invalid/x.png"]
    blank = tmp_path / "blank.html"
    blank.write_text("<html><body></body></html>")
    dominant, ncolours = blank_fraction(browser.open(blank.as_uri()).screenshot_png)
    assert dominant > 0.99 and ncolours < 5


def test_report_of_a_minimal_custom_log():
    """A hand-made log with only a custom statistic (no rm2, numel or NaN counts) still
    gets a report: the heatmap shows that statistic, shares are of the counted values."""
    import pandas as pd

    cols = pd.MultiIndex.from_tuples(
        [
            ("metadata", "name"),
            ("metadata", "type"),
            ("metadata", "tensor_type"),
            ("metadata", "step"),
            ("metadata", "dtype"),
            ("scalar_stats", "foo"),
            ("exponent_counts", "-inf"),
            ("exponent_counts", -12),
            ("exponent_counts", 0),
            ("exponent_counts", "+inf"),
        ]
    )
    df = pd.DataFrame(
        [
            ["a", "", "Weight", 0, "float32", 1.0, 0, 1, 3, 0],
            ["a", "", "Weight", 1, "float32", 2.0, 0, 0, 4, 0],
        ],
        columns=cols,
    )
    text = Path(write_report(df, "min.html", "minimal")).read_text()
    page = Page(text)
    assert page.section_imgs["heatmaps"] == 1 and "foo per layer and step" in text
    shares = {r["format"]: r for r in find_table(page, "format", "Weight underflow")}
    # 1 of the 8 counted values (2**-12) underflows float8_e4m3fn; none underflows e5m2.
    assert shares["float8_e4m3fn"]["Weight underflow"] == "12.5%"
    assert shares["float8_e5m2"]["Weight underflow"] == "0"


def test_report_of_the_demo_has_update_ratios_and_taiyi_quantities(tmp_path):
    from tandv.demos import torch_demo
    from tandv.schema import read_log

    log = torch_demo.run(steps=2, out=tmp_path / "log", seed=0, progress=False)
    df = read_log(log)
    text = write_report(df, tmp_path / "r.html").read_text(encoding="utf-8")
    page = Page(text)
    assert page.section_imgs["updates"] == 1 and page.section_imgs["taiyi"] == 1
    # the update ratio at the last step, from the log's root-mean-squares: ||x|| = rm2 * sqrt(n)
    meta, stats = df["metadata"], df["scalar_stats"]
    last = meta["step"] == meta["step"].max()
    norm = {
        (n, t): r * np.sqrt(k)
        for n, t, r, k in zip(
            meta["name"][last], meta["tensor_type"][last], stats["rm2"][last], stats["numel"][last]
        )
    }
    ratios = [
        v / norm[(n[: -len(".update")], "Weight")]
        for (n, t), v in norm.items()
        if t == "Weight" and n.endswith(".update")
    ]
    assert len(ratios) == sum(1 for _ in torch_demo.GPT(torch_demo.demo_config(11)).parameters())
    assert f"the median is {np.median(ratios):.3g}" in text
    assert "3 quantities of" in text
