"""Finding Flax nnx modules' outputs: nnx has no method interception (linen's
``nn.intercept_methods``), so while a tracker is open, ``__call__`` of every nnx module
class is wrapped; the wrapper does nothing outside an intercepted step (:func:`nnx_scope`).

Names: the outermost module called names every module below it by its graph path; copies
that nnx transforms (``nnx.scan``, ``nnx.vmap``, ``nnx.remat``) make inside a traced
function are named by the path the tracker tagged on the original (:func:`tag_nnx_paths`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from ._sink import ROOT_NAME

__all__ = [
    "NNX_PATH_ATTR",
    "acquire_nnx",
    "release_nnx",
    "tag_nnx_paths",
    "untag_nnx_paths",
    "nnx_scope",
]


_nnx_local = threading.local()
_nnx_originals: dict[type, Callable] = {}  # patched class -> its own __call__
_nnx_users = 0  # open trackers; the patches stay while there is one


def _nnx_call_owners() -> list[type]:
    """Every nnx module class that defines ``__call__`` itself (subclasses inherit the wrap)."""
    from flax import nnx

    seen: set[type] = set()
    owners = []
    stack = [nnx.Module]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
                if "__call__" in sub.__dict__:
                    owners.append(sub)
    return owners


#: Attribute naming an nnx module's path in the tracked model (set by the tracker while it
#: is open): plain attributes are static data of the module's graph, so the copies nnx
#: transforms merge inside a traced function carry it too.
NNX_PATH_ATTR = "_tandv_path"
_warned_classes: set[type] = set()


def _warn_untracked(cls: type) -> None:
    if cls not in _warned_classes:
        _warned_classes.add(cls)
        warnings.warn(
            f"tandv: an nnx {cls.__name__} module called inside intercept() is not part of the "
            f"tracked model (track(model_state=...)) nor of the outermost module called; its "
            f"outputs are not tracked",
            RuntimeWarning,
            stacklevel=4,
        )


def tag_nnx_paths(model: Any) -> list[Any]:
    """Tag every module of the nnx ``model`` with its path (see :data:`NNX_PATH_ATTR`);
    returns the tagged modules, for :func:`untag_nnx_paths`."""
    from flax import nnx

    tagged = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            object.__setattr__(node, NNX_PATH_ATTR, ".".join(map(str, path)) or ROOT_NAME)
            tagged.append(node)
    return tagged


def untag_nnx_paths(modules: list[Any]) -> None:
    """Remove the tags :func:`tag_nnx_paths` set."""
    for node in modules:
        if NNX_PATH_ATTR in vars(node):
            object.__delattr__(node, NNX_PATH_ATTR)


def _wrap_nnx_call(original: Callable) -> Callable:
    from flax import nnx

    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _nnx_local
        on_output = getattr(state, "on_output", None)
        if on_output is None:  # no intercepted step running: the module's own call
            return original(self, *args, **kwargs)
        depth = getattr(state, "depth", 0)
        if depth == 0:
            # The outermost call names every module below it by its graph path.
            state.paths = {
                id(node): path
                for path, node in nnx.iter_graph(self)
                if isinstance(node, nnx.Module)
            }
        state.depth = depth + 1
        try:
            out = original(self, *args, **kwargs)
        finally:
            state.depth = depth
        path = state.paths.get(id(self))
        if path is not None:
            name = ".".join(str(p) for p in path) or ROOT_NAME
        else:
            # A copy made by an nnx transform (nnx.scan, nnx.vmap, nnx.remat split the
            # module and merge a new one inside): its tag says where the original lies.
            tag: str | None = getattr(self, NNX_PATH_ATTR, None)
            if tag is None:
                _warn_untracked(type(self))
                return out
            name = tag
        return on_output(name, type(self), out)

    return __call__


def _patch_nnx_classes() -> None:
    """Wrap ``__call__`` of every nnx module class not wrapped yet (idempotent and cheap when
    nothing is new: setting class attributes is what costs, so it is done once per class)."""
    for cls in _nnx_call_owners():
        if cls not in _nnx_originals:
            original = cls.__dict__["__call__"]
            _nnx_originals[cls] = original
            cls.__call__ = _wrap_nnx_call(original)  # type: ignore[method-assign]  # on purpose


def acquire_nnx() -> None:
    """A tracker opens: nnx module calls become interceptable (wrapped until the last closes)."""
    global _nnx_users
    _nnx_users += 1
    _patch_nnx_classes()


def release_nnx() -> None:
    """A tracker closes: when it was the last, restore every wrapped ``__call__``."""
    global _nnx_users
    _nnx_users = max(0, _nnx_users - 1)
    if _nnx_users == 0:
        for cls, original in _nnx_originals.items():
            cls.__call__ = original  # type: ignore[method-assign]  # restoring the patch
        _nnx_originals.clear()


@contextlib.contextmanager
def nnx_scope(on_output: Callable[[str, type, Any], Any]) -> Iterator[None]:
    """While active (one intercepted call), every wrapped nnx ``__call__`` hands its output
    to ``on_output(name, module_class, output)`` and returns what that returns."""
    _patch_nnx_classes()  # nnx classes defined after the tracker opened
    previous = getattr(_nnx_local, "on_output", None)
    _nnx_local.on_output = on_output
    try:
        yield
    finally:
        _nnx_local.on_output = previous
