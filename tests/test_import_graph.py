"""The drawing of the house: tandv's import graph, read statically from every module's source.

Each ``import`` and ``from ... import`` statement of a module (at module level, inside
functions, under ``if TYPE_CHECKING:``: all of them, as they are arrows of the design even
when Python would not run them at import time) is an arrow from that module to the tandv
module it names. The tests check three rules of the house (issue 31):

* the rooms form layers (:data:`LAYERS`): a room imports only itself and rooms of lower
  layers, so there is no upward arrow and no circle between rooms;
* no circle among the modules inside a room;
* no module reads another package's private (``_``-prefixed) module or name;
* no module reads a private member of the torch tracker (:data:`TRACKER_CLASSES`) but the
  tracker's own: its extensions (compiled hooks, update capture) talk to it through the
  protocol of ``track/torch/_seams.py``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tandv"

#: The rooms, lowest layer first. A room is a top-level module (``analysis``), a package
#: (``schema``, ``viz``) or one of ``track``'s packages (``track.common``); ``""`` is the
#: package's own ``__init__``. A room may import its own modules and the rooms of lower
#: layers only; rooms of one layer do not import each other.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"stats", "schema"}),  # summaries and the log: framework-free foundations
    frozenset({"analysis", "quantities"}),  # reading logs; derived quantities (numpy)
    frozenset({"compare", "export"}),  # tools over logs
    frozenset({"track", "track.common"}),  # the framework-neutral tracker
    frozenset({"track.torch", "track.jax"}),  # the framework adapters
    frozenset({"snapshot", "taiyi"}),  # built on the trackers' naming and hooks
    frozenset({"integrations", "demos", "viz"}),  # users of trackers and logs
    frozenset({"cli", ""}),  # the command line and the public face
    frozenset({"__main__"}),  # `python -m tandv`: the command line
)


def _module_name(path: Path) -> str:
    """``tandv/track/torch/tracker.py`` -> ``track.torch.tracker``; a package's
    ``__init__.py`` is named after the package (``""`` for tandv's own)."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path) -> Iterator[tuple[str, str | None, int]]:
    """``(module, imported name or None, line)`` for each tandv module ``name`` imports;
    the module is given relative to tandv (``schema.io``)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = [p for p in package if p]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "tandv" or alias.name.startswith("tandv."):
                    yield alias.name.removeprefix("tandv").lstrip("."), None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module == "tandv" or (node.module or "").startswith("tandv."):
                target = (node.module or "").removeprefix("tandv").lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}".lstrip(".")
                if sub in MODULES:  # `from . import x` names the module x
                    yield sub, None, node.lineno
                else:
                    yield target, alias.name, node.lineno


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        for target, _, _ in _imports(name, path):
            assert target in MODULES, f"{path}: imports tandv.{target}, which does not exist"
            if target != name:
                graph[name].add(target)
    return graph


def _room(module: str) -> str:
    """The room of a module: its top-level module or package, or ``track.<package>``."""
    parts = module.split(".")
    if parts[0] == "track" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def _layer(room: str) -> int:
    for i, rooms in enumerate(LAYERS):
        if room in rooms:
            return i
    raise AssertionError(f"tandv.{room} is in no layer of LAYERS: add it where it belongs")


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_room_has_a_layer():
    for module in MODULES:
        _layer(_room(module))


def test_rooms_import_only_lower_layers():
    upward = []
    for name, targets in _graph().items():
        for target in targets:
            a, b = _room(name), _room(target)
            if a != b and _layer(b) >= _layer(a):
                upward.append(
                    f"tandv.{name} -> tandv.{target} ({a}: layer {_layer(a)}, "
                    f"{b}: layer {_layer(b)})"
                )
    assert not upward, "imports that are not downward:\n" + "\n".join(sorted(upward))


def test_no_circle_among_modules():
    circles = _circles(_graph())
    assert not circles, f"import circles: {[sorted(c) for c in circles]}"


def _private_part(dotted: str) -> int | None:
    """The index of the first ``_``-prefixed (not dunder) part of ``dotted``, if any."""
    for i, part in enumerate(dotted.split(".")):
        if part.startswith("_") and not part.startswith("__"):
            return i
    return None


def _private_reads(name: str, path: Path) -> list[str]:
    """The private modules or names of other packages that module ``name`` imports."""
    own = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    own = [p for p in own if p]
    found = []
    for target, imported, line in _imports(name, path):
        dotted = f"{target}.{imported}" if imported else target
        i = _private_part(dotted)
        if i is None:
            continue
        parts = dotted.split(".")
        # the package holding the private module, or the module holding the private name
        # (whose package may read it)
        holder = parts[: i - 1] if imported and i == len(parts) - 1 else parts[:i]
        if own[: len(holder)] != holder:
            found.append(f"{path.name}:{line} reads tandv.{dotted}")
    return found


def test_no_module_reads_another_package_s_privates():
    """A private module (``track/torch/_workspace.py``) or name (``_flatten``) is read only
    inside the package that holds it (and its sub-packages)."""
    found = [r for name, path in MODULES.items() for r in _private_reads(name, path)]
    assert not found, "private modules or names read from outside:\n" + "\n".join(found)


#: The tracker classes whose ``_``-prefixed members are read by no other module, by the
#: file that defines each: the torch ``Tracker`` and the ``TrackerCore`` it extends.
TRACKER_CLASSES: dict[str, str] = {
    "track.torch.tracker": "Tracker",
    "track.common.core": "TrackerCore",
}

#: The modules that may read those members besides their own: the JAX adapter, whose
#: ``JaxTracker`` extends ``TrackerCore`` too (its own privates are its business).
TRACKER_FRIENDS = ("track.jax",)


def _private_members(path: Path, cls: str) -> set[str]:
    """The ``_``-prefixed (not dunder) members of class ``cls`` in ``path``: its methods
    and the attributes it assigns on ``self``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.ClassDef) and node.name == cls):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.add(sub.name)
            elif (
                isinstance(sub, ast.Attribute)
                and isinstance(sub.ctx, ast.Store)
                and isinstance(sub.value, ast.Name)
                and sub.value.id == "self"
            ):
                found.add(sub.attr)
    return {n for n in found if n.startswith("_") and not n.startswith("__")}


def _tracker_reads(path: Path, members: set[str]) -> list[str]:
    """Where ``path`` reads one of ``members`` of an object other than its own ``self``
    (``tracker._active``, ``self._tracker()._observe``, ``tr._modules``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in members
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            found.append(f"{path.name}:{node.lineno} reads {ast.unparse(node)}")
    return found


def test_no_module_reads_the_torch_tracker_s_privates():
    """Only the tracker's own modules read its ``_``-prefixed members; an extension is
    given a ``TrackerSeam`` (``track/torch/_seams.py``) instead. (A module reading a
    same-named private member of another class, an ``nn.Module``'s ``_buffers`` say, is
    caught too: read it through a public name, or give the tracker's member another one.)"""
    members = set().union(*(_private_members(MODULES[m], c) for m, c in TRACKER_CLASSES.items()))
    assert {"_active", "_observe_site", "_summaries", "_selected", "_flights"} <= members
    found = [
        r
        for name, path in MODULES.items()
        if name not in TRACKER_CLASSES and _room(name) not in TRACKER_FRIENDS
        for r in _tracker_reads(path, members)
    ]
    assert not found, "the tracker's private members read from outside:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source, bad",
    [
        ("if tr._active:\n    pass\n", True),
        ("self._tracker()._observe('a', 'Activation', m, x)\n", True),
        ("for name, m in tracker._modules:\n    pass\n", True),
        ("self._active = False\n", False),  # its own member of that name
        ("if tr.recording:\n    tr.observe('a', 'Activation', m, x)\n", False),
        ("m._forward_hooks.clear()\n", False),  # not a member of the tracker
    ],
)
def test_the_tracker_privacy_rule_on_hand_written_code(tmp_path, source, bad):
    path = tmp_path / "x.py"
    path.write_text(source)
    members = {"_active", "_observe", "_modules"}
    assert bool(_tracker_reads(path, members)) == bad


@pytest.mark.parametrize(
    "source, bad",
    [
        ("from ..track.torch._workspace import Flight\n", True),  # another package's module
        ("from ..track.torch.tracker import _flatten\n", True),  # another module's name
        ("from tandv.schema.io import _ParquetLog\n", True),
        ("from ._core import Snapshot\n", False),  # its own package's private module
        ("from .tracker import _flatten\n", False),  # a private name of its own package
        ("from ..stats.summary import merge\n", False),
    ],
)
def test_the_privacy_rule_on_hand_written_imports(tmp_path, source, bad):
    """The rule for a module ``snapshot.x`` (as if it were ``tandv/snapshot/x.py``)."""
    path = tmp_path / "x.py"
    path.write_text(source)
    assert bool(_private_reads("snapshot.x", path)) == bad


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from .b import c\n", {("pkg.b", "c")}),
        ("from . import b\n", {("pkg.b", None)}),
        ("from .. import schema\n", {("schema", None)}),
        ("def f():\n    from tandv.stats import summary\n", {("stats.summary", None)}),
        ("import tandv.schema.io\n", {("schema.io", None)}),
        ("import numpy\nfrom os import path\n", set()),
    ],
)
def test_the_reader_sees_every_kind_of_import(tmp_path, monkeypatch, source, expected):
    """The graph's reader on hand-written modules (package ``pkg`` with modules ``a``, ``b``;
    ``stats.summary``, ``schema``, ``schema.io`` are real tandv modules)."""
    path = tmp_path / "a.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, "pkg.b", tmp_path / "b.py")
    got = {(t, n) for t, n, _ in _imports("pkg.a", path)}
    assert got == expected


def test_the_circle_finder_finds_a_circle_and_no_false_one():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        frozenset({"a", "b", "c"})
    ]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
