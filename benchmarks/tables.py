"""Render the benchmark results in ``benchmarks/results/*.json`` as the Markdown tables the
documentation includes (``docs/benchmarks/<name>.md``, pulled into the pages by
pymdownx.snippets), so that no figure in a docs table is typed by hand.

A results file holds a table: ``columns`` (each a ``key``, a ``title``, and how its cells
are written: ``unit`` ``"ms"``, ``"s"``, ``"MiB"``, ``"x"`` or ``""`` and ``decimals``,
or none to write numbers as the file holds them),
``rows`` (objects keyed by column), and a ``caption`` written under the table. A cell is

* a string (written as is), a number, or a range ``[lo, hi]`` (``172-180 ms``);
* a list of pairs ``[[a, b], ...]``: ``a / b`` each, comma-separated (before/after,
  ``every=1`` / ``every=10``); ``null`` in a pair is written ``-``;
* an object ``{"value": ..., "paren": ..., "runs": n, "step_by_step": x}``: the value,
  then ``(paren)``, ``, n runs`` and ``; step by step x``.

Benchmarks add their measurements with :func:`append_row` (``overhead.py --results
FILE`` does); the figures kept from before the scripts wrote JSON were transcribed once
from the README they were reported in, with their command, machine and date in the
file's ``source``.

Usage::

    python benchmarks/tables.py           # (re)write docs/benchmarks/*.md
    python benchmarks/tables.py --check   # exit 1 if a written table is not the rendering
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "benchmarks"
HEADER = (
    "<!-- written by `python benchmarks/tables.py` from benchmarks/results/{name}.json:"
    " do not edit -->\n"
)


def _number(x: float | int | None, unit: str, decimals: int | None) -> str:
    """One number with its unit: ``1.30x``, ``3,521``, ``172 ms``; ``None`` is ``-``.
    ``decimals=None`` writes the number as the results file holds it."""
    if x is None:
        return "-"
    if unit == "ms" and x >= 1000:  # a second or more reads better in seconds
        return f"{x / 1000:.{max(decimals or 0, 2)}f} s"
    text = f"{x:,}" if decimals is None else f"{x:,.{decimals}f}"
    if unit == "x":
        return text + "x"
    return f"{text} {unit}" if unit else text


def _value(v: Any, unit: str, decimals: int | None) -> str:
    """A number, a range ``[lo, hi]`` or a list of pairs, written with ``unit``."""
    if isinstance(v, str):
        return v
    if isinstance(v, (int, float)) or v is None:
        return _number(v, unit, decimals)
    if isinstance(v, list) and len(v) == 2 and all(isinstance(e, (int, float)) for e in v):
        lo, hi = (_number(e, "" if unit in ("x", "MiB") else unit, decimals) for e in v)
        if unit in ("ms", "s"):  # the unit once, after the range
            lo = lo.rsplit(" ", 1)[0]
        elif unit == "x":
            hi += "x"
        elif unit:
            hi += f" {unit}"
        return f"{lo}-{hi}"
    if isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v):
        return ", ".join(" / ".join(_number(e, unit, decimals) for e in p) for p in v)
    raise ValueError(f"a cell must be a string, a number, a [lo, hi] range or pairs; got {v!r}")


def cell(v: Any, unit: str = "", decimals: int | None = None) -> str:
    """The Markdown text of one table cell (see the module docstring for the forms)."""
    if not isinstance(v, dict):
        return _value(v, unit, decimals)
    unknown = set(v) - {"value", "paren", "runs", "step_by_step"}
    if unknown or "value" not in v:
        raise ValueError(f"a cell object takes value, paren, runs, step_by_step; got {sorted(v)}")
    text = _value(v["value"], unit, decimals)
    if "paren" in v:
        text += f" ({_value(v['paren'], unit, decimals)})"
    if "runs" in v:
        text += f", {v['runs']} runs"
    if "step_by_step" in v:
        text += f"; step by step {_value(v['step_by_step'], unit, decimals)}"
    return text


def render(table: dict[str, Any], name: str) -> str:
    """The Markdown of one results file: header comment, table, caption."""
    columns = table["columns"]
    lines = [HEADER.format(name=name)]
    lines.append("| " + " | ".join(c["title"] for c in columns) + " |\n")
    lines.append("|" + "---|" * len(columns) + "\n")
    for row in table["rows"]:
        missing = [c["key"] for c in columns if c["key"] not in row]
        if missing:
            raise ValueError(f"{name}.json: a row lacks {missing}: {row}")
        cells = (cell(row[c["key"]], c.get("unit", ""), c.get("decimals")) for c in columns)
        lines.append("| " + " | ".join(cells) + " |\n")
    if table.get("caption"):
        lines.append("\n" + table["caption"].strip() + "\n")
    return "".join(lines)


def append_row(results: str | Path, row: dict[str, Any]) -> None:
    """Add one measured row to a results file (created by the benchmark's first run with
    the file's ``columns`` already in place); rerun this script to update the docs."""
    path = Path(results)
    table = json.loads(path.read_text())
    keys = {c["key"] for c in table["columns"]}
    if set(row) - keys - {"date", "command"}:
        raise ValueError(f"{path}: columns are {sorted(keys)}; the row has {sorted(row)}")
    table["rows"].append(row)
    path.write_text(json.dumps(table, indent=1) + "\n")


def rendered() -> dict[Path, str]:
    """``{docs table path: its Markdown}`` for every results file."""
    return {
        OUT / f"{p.stem}.md": render(json.loads(p.read_text()), p.stem)
        for p in sorted(RESULTS.glob("*.json"))
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for path, text in rendered().items():
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.relative_to(ROOT))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale tables (run python benchmarks/tables.py): {stale}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
