"""The complexity limits of the house hold everywhere (issue 31): ruff checks every
function's complexity, branches and statements against ``pyproject.toml``'s limits, and no
function opts out with a ``# noqa`` for those rules (a long function is split instead)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: ruff's rules for a function's complexity, branches and statements
LIMIT_RULES = ("C901", "PLR0912", "PLR0915")
_NOQA = re.compile(r"#\s*noqa\s*:\s*([A-Z0-9, ]+)", re.IGNORECASE)


def _exemptions(source: str) -> list[tuple[int, str]]:
    """``(line, rule)`` of each ``# noqa`` comment in ``source`` that names a limit rule
    (comments only: a string that mentions one is not an exemption)."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            for match in _NOQA.finditer(tok.string):
                for rule in re.split(r"[,\s]+", match.group(1).strip()):
                    if rule.upper() in LIMIT_RULES:
                        found.append((tok.start[0], rule.upper()))
    return found


def test_the_limits_are_checked():
    """pyproject selects the three rules and sets their limits."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert set(LIMIT_RULES) <= set(config["select"])
    assert config["mccabe"]["max-complexity"] <= 15
    assert config["pylint"]["max-branches"] <= 15
    assert config["pylint"]["max-statements"] <= 60


def test_no_function_is_exempt_from_the_limits():
    files = [
        p for d in ("tandv", "benchmarks", "tests", "examples") for p in (ROOT / d).rglob("*.py")
    ]
    assert len(files) > 100
    exempt = [
        f"{path.relative_to(ROOT)}:{line} {rule}"
        for path in files
        for line, rule in _exemptions(path.read_text())
    ]
    assert not exempt, "split these functions instead of exempting them:\n" + "\n".join(exempt)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f():  # noqa: PLR0915\n    pass\n", [(1, "PLR0915")]),
        ("def f():  # noqa: C901, PLR0912\n    pass\n", [(1, "C901"), (1, "PLR0912")]),
        ("x = 1  # noqa: E501\n", []),
        ('s = "# noqa: PLR0915"\n', []),
        ("import os  # NOQA:plr0915\n", [(1, "PLR0915")]),
    ],
)
def test_the_exemption_finder(source, expected):
    assert _exemptions(source) == expected
