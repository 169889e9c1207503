"""``track()``'s signature is its tracker class's: a tracker declares its framework's own
options on its ``__init__`` and takes the shared ones as ``**options: Unpack[TrackKwargs]``
(:mod:`.options`); ``track`` shows them all, by name and with their defaults, and its
documentation ends with the shared options' (written once, on :class:`TrackOptions`)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from .options import TrackOptions

__all__ = ["signature_of"]

P = ParamSpec("P")
T = TypeVar("T")


def _expanded(sig: inspect.Signature) -> inspect.Signature:
    """``sig`` with its ``**options`` replaced by the shared options, as keywords."""
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    if len(params) == len(sig.parameters):
        return sig
    params += [
        inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type
        )
        for f in dataclasses.fields(TrackOptions)
        if f.init
    ]
    return sig.replace(parameters=params)


def signature_of(cls: Callable[P, T]) -> Callable[[Callable[..., T]], Callable[P, T]]:
    """Decorate a factory ``f(*args, **kwargs) -> cls(...)`` so that type checkers, IDEs and
    ``help()`` see every parameter of ``cls`` by name (not ``**options``): the type comes
    from ``cls`` through the ParamSpec, and ``__signature__`` serves runtime introspection.
    The factory's docstring gets the shared options' documentation appended."""

    def decorate(factory: Callable[..., T]) -> Callable[P, T]:
        sig = _expanded(inspect.signature(cls))
        setattr(factory, "__signature__", sig.replace(return_annotation=cls))  # noqa: B010
        doc = inspect.cleandoc(factory.__doc__ or "")
        factory.__doc__ = f"{doc}\n\n{TrackOptions.documentation()}"
        return factory

    return decorate
