"""The documentation's examples run: every ```python block of README.md and docs/*.md is
executed, each page's blocks in order in one namespace (a page reads as one session), in
the test's temporary directory. A page may start that namespace with one of the small
fixtures below (``<!-- docs-test: setup NAME -->``); a block that cannot run here says
why in ``<!-- docs-test: skip (why) -->`` on the line before it, and those are counted.

Also: the benchmark tables the pages include are what ``benchmarks/tables.py`` renders
from ``benchmarks/results/*.json`` (no table of figures is typed by hand), and every
snippet a page includes exists.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _benchmarks import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_SKIPPED = 5  # torchrun, a Jupyter kernel, inductor, the Trainer callbacks: keep it small

_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)
_SKIP = re.compile(r"<!-- docs-test: skip \((.+?)\) -->\n$")
_SETUP = re.compile(r"^<!-- docs-test: setup (\w+) -->$", re.M)

FIXTURES = {
    "torch": """
import torch, tandv
from torch import nn
from tandv.track.torch import track
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss_fn = nn.functional.mse_loss
loader = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(3)]
x, y = loader[0]
""",
    "jax": """
import jax, jax.numpy as jnp, optax, tandv
from flax import linen as nn, nnx

class MyLinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.relu(nn.Dense(16)(x)))

class MyNnxModel(nnx.Module):
    def __init__(self, rngs):
        self.fc1, self.fc2 = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 1, rngs=rngs)
    def __call__(self, x):
        return self.fc2(nnx.relu(self.fc1(x)))

x = jax.random.normal(jax.random.key(0), (16, 8)); y = x.sum(1, keepdims=True)
batches = [(x, y)] * 3
""",
}
FIXTURES["log"] = (
    FIXTURES["torch"]
    + """
with track(model, opt, out="run", verbose=False) as _tracker:
    for _x, _y in loader:
        loss_fn(model(_x), _y).backward(); opt.step(); opt.zero_grad(); _tracker.step()
path = "run"
"""
)


def blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason or None)`` for each ```python block of ``page``."""
    text = page.read_text()
    found = []
    for m in _BLOCK.finditer(text):
        before = text[: m.start()]
        skip = _SKIP.search(before[-400:])
        found.append((before.count("\n") + 1, m.group(1), skip.group(1) if skip else None))
    return found


def _pages_with_code() -> list[Path]:
    """The pages with a block that runs here."""
    return [p for p in PAGES if any(why is None for *_, why in blocks(p))]


def test_the_pages_have_examples_and_few_are_skipped():
    """Most pages show code, and the blocks that do not run here are few and say why."""
    every = [(p, b) for p in PAGES for b in blocks(p)]
    assert len(every) >= 25, f"only {len(every)} python blocks in the docs"
    skipped = [f"{p.name}:{line}: {why}" for p, (line, _, why) in every if why]
    assert 0 < len(skipped) <= MAX_SKIPPED, "\n".join(skipped)
    for p in PAGES:  # a marker that matches no block would silently do nothing
        text = p.read_text()
        assert len(re.findall(r"^<!-- docs-test: skip", text, re.M)) == sum(
            1 for *_, w in blocks(p) if w
        ), p
        for name in _SETUP.findall(text):
            assert name in FIXTURES, f"{p.name}: unknown docs-test setup {name!r}"


@pytest.mark.parametrize("page", _pages_with_code(), ids=lambda p: p.name)
def test_the_examples_of_a_page_run(page, tmp_path, monkeypatch, capsys):
    """Run the page's blocks in order in one namespace (in tmp_path, cwd of every test)."""
    if any(re.search(r"^\s*(import|from) jax\b", code, re.M) for _, code, _ in blocks(page)):
        pytest.importorskip("flax")
    pytest.importorskip("torch")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for name in _SETUP.findall(page.read_text()):
        exec(compile(FIXTURES[name], f"<docs-test setup {name}>", "exec"), namespace)
    ran = 0
    for line, code, skip in blocks(page):
        if skip:
            continue
        try:
            exec(compile(code, f"{page.name}:{line}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(
                f"{page.name}, the block at line {line} failed: {error!r}"
            ) from error
        ran += 1
    assert ran > 0


def test_the_readme_links_to_pages_that_exist():
    """mkdocs checks the site's links; the README is not part of the site, so its links to
    docs/ pages (and their anchors' files) are checked here."""
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10, local
    missing = [link for link in local if not (ROOT / link).exists()]
    assert missing == [], f"README.md links to files that do not exist: {missing}"


def test_the_benchmark_tables_are_the_rendered_results():
    """Every docs/benchmarks/*.md is what benchmarks/tables.py renders from its results
    file, and every table a page includes exists (mkdocs would fail on a missing one too)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tables.py"), "--check"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    results = {p.stem for p in (ROOT / "benchmarks" / "results").glob("*.json")}
    included = {
        m for p in PAGES for m in re.findall(r'^--8<-- "([a-z_]+)\.md"$', p.read_text(), re.M)
    }
    assert included == results, (
        f"results not shown: {results - included}; missing: {included - results}"
    )


def test_the_table_renderer_writes_ranges_pairs_and_notes():
    """The cell forms of benchmarks/tables.py, against hand-written expectations."""
    tables = load_benchmark("tables")
    assert tables.cell([172, 180], "ms", 0) == "172-180 ms"
    assert tables.cell(1190, "ms", 0) == "1.19 s"
    assert tables.cell({"value": [1.3, 1.35], "paren": [1.25, 1.28], "runs": 4}, "", 2) == (
        "1.30-1.35 (1.25-1.28), 4 runs"
    )
    assert tables.cell([[2.2, 1.1], [3.01, None]], "x", 2) == "2.20x / 1.10x, 3.01x / -"
    assert tables.cell({"value": [0.96, 1.14], "step_by_step": 1.03}, "x", 2) == (
        "0.96-1.14x; step by step 1.03x"
    )
    assert tables.cell(3521, "", 0) == "3,521"
    assert tables.cell(4.4) == "4.4"
    with pytest.raises(ValueError, match="a cell object takes"):
        tables.cell({"valeu": 1})


def test_the_overhead_benchmark_adds_its_run_to_a_results_file(tmp_path):
    """``benchmarks/overhead.py --results FILE`` (a tiny model, 2 steps) appends a row with
    the run's ratios to a copy of the docs' results file, and the table renders it."""
    import json
    import shutil

    results = tmp_path / "torch_overhead.json"
    shutil.copy(ROOT / "benchmarks" / "results" / "torch_overhead.json", results)
    before = json.loads(results.read_text())["rows"]
    size = "--layers 1 --d-model 32 --heads 2 --mlp 64 --vocab 32 --seq 8 --batch 2".split()
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), *size]
        + ["--steps", "2", "--warmup", "1", "--every", "1", "10", "--results", str(results)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(results.read_text())["rows"]
    assert rows[:-1] == before
    row = rows[-1]
    printed = re.search(
        r"every=1: .* ratio of medians ([\d.]+); ratio of means ([\d.]+)", out.stdout
    )
    assert printed, out.stdout
    assert row["every1"] == {"value": float(printed[1]), "paren": float(printed[2])}
    # the host kernel's share of the tracked step (every=1: every step reads its tensors)
    step = re.search(r"every=1: tracked ([\d.]+) ms", out.stdout)
    kernel = re.search(r"in the host kernel: ([\d.]+) ms .*, ([\d.]+) M elements", out.stdout)
    assert step and kernel, out.stdout
    assert 0 < float(kernel[1]) <= float(step[1]) and float(kernel[2]) > 0
    # the same calls outside the step, and the ratio they alone would give
    floor = re.search(r"outside the step: ([\d.]+) ms .*a floor of ([\d.]+) for", out.stdout)
    untracked = re.search(r"untracked ([\d.]+) ms", out.stdout)
    assert floor and untracked, out.stdout
    f, u = float(floor[1]), float(untracked[1])
    # (both printed to 0.05 ms, the ratio to 0.0005: the tiny run's times are a few ms)
    slack = 0.05 / u + 0.05 * f / u**2 + 5e-4
    assert f > 0 and float(floor[2]) == pytest.approx((u + f) / u, abs=slack)
    assert row["model"].startswith("1 layers, d_model 32") and row["untracked"] > 0
    tables = load_benchmark("tables")
    table = tables.render(json.loads(results.read_text()), "torch_overhead")
    assert table.splitlines()[-1].startswith("| 1 layers, d_model 32")
