"""Selecting tensors by name (regular expressions) and by module type."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Selector", "Pattern"]

#: One selection entry: a regex searched in the tensor name, a class name, or a class.
Pattern = str | re.Pattern[str] | type


def _as_list(value: Pattern | Sequence[Pattern] | None, arg: str) -> tuple[Pattern, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, (str, re.Pattern, type)) else tuple(value)
    for item in items:
        if not isinstance(item, (str, re.Pattern, type)):
            raise TypeError(
                f"{arg}: expected regex strings, compiled patterns or classes; got {item!r}"
            )
        if isinstance(item, str):
            try:
                re.compile(item)
            except re.error as e:
                raise ValueError(
                    f"{arg}: {item!r} is not a valid regular expression ({e})"
                ) from None
    return items


@dataclass(frozen=True)
class Selector:
    """Which tensors to track.

    A tensor is tracked when it matches some ``include`` entry (or ``include`` is empty)
    and no ``exclude`` entry. An entry matches when it is

    - a string or compiled regex that ``re.search`` finds in the tensor's name, or a
      string equal to the name of its module's class or of one of that class's bases
      (``"Linear"``, as Taiyi does);
    - a class that the module is an instance of (``torch.nn.LayerNorm``).
    """

    include: tuple[Pattern, ...] = ()
    exclude: tuple[Pattern, ...] = ()

    @classmethod
    def build(
        cls,
        include: Pattern | Sequence[Pattern] | None = None,
        exclude: Pattern | Sequence[Pattern] | None = None,
    ) -> Selector:
        """A selector from the tracker's ``include`` / ``exclude`` arguments (checked)."""
        return cls(_as_list(include, "include"), _as_list(exclude, "exclude"))

    @staticmethod
    def _hit(entry: Pattern, name: str, types: Iterable[type]) -> bool:
        if isinstance(entry, type):
            return any(t is entry for t in types)
        if isinstance(entry, str) and any(t.__name__ == entry for t in types):
            return True
        return re.search(entry, name) is not None

    def __call__(self, name: str, types: Sequence[type] = ()) -> bool:
        """Whether the tensor ``name``, owned by a module whose class MRO is ``types``, is
        tracked."""
        if self.include and not any(self._hit(e, name, types) for e in self.include):
            return False
        return not any(self._hit(e, name, types) for e in self.exclude)
