"""The documentation read as a new engineer would, against the code: the map of the code in
docs/development.md (every room of ``tandv/`` is named there, every file it names is where
it says), the API reference in docs/api.md (each module's exports) and the option tables in
docs/options.md (each argument of both ``track`` functions)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tandv"
DOCS = ROOT / "docs"


def _rooms() -> dict[str, str]:
    """``{room: its description}`` from the first code block of the Development page."""
    section = (DOCS / "development.md").read_text()
    block = section[section.index("```\n") + 4 :]
    block = block[: block.index("```")]
    lines = block.splitlines()
    assert lines[0] == "tandv/", f"the map should start at tandv/, starts with {lines[0]!r}"
    rooms: dict[str, str] = {}
    current = None
    for line in lines[1:]:
        m = re.match(r"^  (\S+)\s+(.*)$", line)
        if m:  # a room of tandv/, two spaces in
            current = m.group(1)
            rooms[current] = m.group(2)
        elif line.startswith("   ") and current is not None:  # its description goes on
            rooms[current] += " " + line.strip()
        else:  # tests/, benchmarks/: outside the package
            current = None
    return rooms


def test_every_room_of_the_package_is_named():
    rooms = _rooms()
    named = {r.rstrip("/") for r in rooms}
    present = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    present.discard("track")  # a namespace of the three tracker rooms below
    present |= {
        f"track/{p.name}" for p in (PACKAGE / "track").iterdir() if (p / "__init__.py").exists()
    }
    present |= {
        p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")
    }
    assert present - named == set(), (
        f"rooms missing from docs/development.md's map: {present - named}"
    )
    assert named - present == set(), (
        f"docs/development.md's map names rooms that are gone: {named - present}"
    )


def test_every_file_the_map_names_is_in_its_room():
    for room, text in _rooms().items():
        where = PACKAGE / room.rstrip("/")
        if not where.is_dir():
            continue
        for name in set(re.findall(r"\b(_?[a-z][a-z0-9_]*\.py)\b", text)):
            assert (where / name).is_file(), (
                f"docs/development.md's map says {room} holds {name}, but tandv/{room}{name} "
                f"does not exist"
            )


def test_rooms_with_kernels_keep_a_design_note():
    for room in ("stats", "schema", "track/torch", "track/jax"):
        note = PACKAGE / room / "DESIGN.md"
        assert note.is_file(), f"tandv/{room}/DESIGN.md is missing"
        text = note.read_text()
        for name in set(re.findall(r"`(_?[a-z][a-z0-9_]*\.py)`", text)):
            assert (PACKAGE / room / name).is_file() or list(PACKAGE.rglob(name)), (
                f"tandv/{room}/DESIGN.md names {name}, which does not exist"
            )


def test_the_public_api_table_lists_each_module_s_exports():
    """docs/api.md's table names every name a public module exports, in that module's
    row, and no name the module does not export."""
    import importlib

    section = (DOCS / "api.md").read_text()
    rows = dict(re.findall(r"^\| `(tandv[\w.]*)` \| (.*) \|$", section, flags=re.M))
    for module in ("tandv", "tandv.track.torch", "tandv.track.jax", "tandv.viz", "tandv.schema"):
        assert module in rows, f"docs/api.md has no row for {module}"
        exported = set(importlib.import_module(module).__all__)
        named = set(re.findall(r"`(\w+)(?:\(\w*\))?`", rows[module]))
        assert exported - named == set(), (
            f"{module} exports names its row omits: {exported - named}"
        )
        assert named - exported == set(), (
            f"{module}'s row names what it does not export: {named - exported}"
        )


def _option_table(heading: str) -> tuple[str, set[str]]:
    """The text between ``heading`` and the end of the table after it, and the backticked
    names in the first column of that table."""
    text = (DOCS / "options.md").read_text()
    start = text.index(heading)
    table_start = text.index("\n|", start)
    end = text.index("\n\n", table_start)
    first_cells = re.findall(r"^\| ([^|]*) \|", text[table_start:end], flags=re.M)
    return text[start:end], {n for cell in first_cells for n in re.findall(r"`(\w+)`", cell)}


def test_the_option_tables_list_every_argument_of_track():
    """Each ``track()`` argument (the shared options and the framework's own) has a row in
    its table on docs/options.md, and each row names an argument that exists: the tables are
    what users read instead of the docstrings, so they must not drift from the signatures."""
    import inspect

    from tandv.track.jax import track as jax_track
    from tandv.track.torch import track as torch_track

    for heading, track in (
        ("\n## PyTorch\n", torch_track),
        ("\nArguments of `track` (`tandv.track.jax.track`)", jax_track),
    ):
        section, rows = _option_table(heading)
        params = set(inspect.signature(track).parameters)
        # the arguments the heading's call shows, as in `track(module, optimizer=None, *, ...)`
        shown = {
            n
            for call in re.findall(r"`track\(([^)]*)\)`", section)
            for n in re.findall(r"\w+", call)
        }
        missing = params - rows - shown
        where = f"{track.__module__}.track"
        assert missing == set(), f"{where}: no docs/options.md row for {sorted(missing)}"
        assert rows - params == set(), f"docs/options.md rows for no argument: {rows - params}"
