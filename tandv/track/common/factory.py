"""``track()``'s signature is its tracker class's: the options are declared once, on the
class's ``__init__``, and documented once, on ``track``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["signature_of"]

P = ParamSpec("P")
T = TypeVar("T")


def signature_of(cls: Callable[P, T]) -> Callable[[Callable[..., T]], Callable[P, T]]:
    """Decorate a factory ``f(*args, **kwargs) -> cls(...)`` so that type checkers, IDEs and
    ``help()`` see every parameter of ``cls`` by name (not ``**options``): the type comes
    from ``cls`` through the ParamSpec, and ``__signature__`` serves runtime introspection."""

    def decorate(factory: Callable[..., T]) -> Callable[P, T]:
        sig = inspect.signature(cls)
        setattr(factory, "__signature__", sig.replace(return_annotation=cls))  # noqa: B010
        return factory

    return decorate
