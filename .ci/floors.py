"""Print pip constraints pinning every dependency tandv declares to its floor.

`make test-lowest` installs the test environment under these constraints, so the
floors in pyproject.toml are versions that were actually tested, not guesses.
Reads the `dependencies` and the optional extras named on the command line
(default: the ones `make test` installs).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

FLOOR = re.compile(r"^\s*([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)")


def floors(pyproject: Path, extras: list[str]) -> dict[str, str]:
    """``{package: floor}`` for the base dependencies and ``extras``; a requirement
    without a ``>=`` floor (a self-reference such as ``tandv[...]``) is skipped."""
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"floors.py: no extra {unknown} in {pyproject}; known: {sorted(optional)}")
    out: dict[str, str] = {}
    for req in [*project["dependencies"], *(r for e in extras for r in optional[e])]:
        m = FLOOR.match(req)
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    wanted = sys.argv[1:] or ["torch", "jax", "plot", "test"]
    for name, version in sorted(floors(root / "pyproject.toml", wanted).items()):
        print(f"{name}=={version}")
