"""The one way this package changes other code: set an attribute (or a mapping's item),
remember what was there, put it back.

``Patches`` records every change it makes and undoes them last first, so a value
set twice comes back to the first one. It is usable as a context manager (the
changes hold inside the ``with`` block only) or held by an owner that restores it
later (the patch layer while installed, the CPU backend while enabled). Every place
that patches megatron, torch or ``sys.modules`` goes through it, so "what did we
change, and is it back" has one answer.

Restoring puts back what the owner itself held: the value in its own ``__dict__``,
or nothing (the attribute is deleted again) when the value was inherited from a
class or did not exist. A missing attribute is refused unless ``must_exist=False``:
a name that is not there means the code to patch is not the code we know
(``PatchTargetMissing``).
"""
from __future__ import annotations

import sys
from typing import Any, Callable, List, MutableMapping, Tuple

__all__ = ["Patches", "PatchTargetMissing"]

_ABSENT = object()
"""Held where the owner had no value of its own: restoring deletes the name again."""


class PatchTargetMissing(RuntimeError):
    """What was to be patched is not there: the code is not the release we know."""


def _own_value(owner: Any, name: str) -> Any:
    return getattr(owner, "__dict__", {}).get(name, _ABSENT)


def _put_attribute(owner: Any, name: str, value: Any) -> None:
    if value is _ABSENT:
        if name in getattr(owner, "__dict__", {}):
            delattr(owner, name)
    else:
        setattr(owner, name, value)


def _put_item(mapping: MutableMapping, key: Any, value: Any) -> None:
    if value is _ABSENT:
        mapping.pop(key, None)
    else:
        mapping[key] = value


class Patches:
    """Changes made to other code, undone in reverse order by ``restore()``.

    ``label`` and ``hint`` make the refusal of a missing attribute one line a user
    can act on: ``"<label>: 'module' has no attribute 'name'; <hint>"``.
    """

    def __init__(self, label: str = "patch", hint: str = "") -> None:
        self.label = label
        self.hint = hint
        self._undo: List[Tuple[Callable[[Any, Any, Any], None], Any, Any, Any]] = []

    def __len__(self) -> int:
        """How many changes are in place."""
        return len(self._undo)

    def __enter__(self) -> "Patches":
        return self

    def __exit__(self, *exc_info) -> None:
        self.restore()

    def set(self, owner: Any, name: str, value: Any, must_exist: bool = True) -> Any:
        """``owner.name = value``; returns the value ``owner.name`` had (None if none)."""
        if must_exist and not hasattr(owner, name):
            owner_name = getattr(owner, "__name__", owner)
            raise PatchTargetMissing(f"{self.label}: {owner_name!r} has no attribute {name!r}"
                                 + (f"; {self.hint}" if self.hint else ""))
        previous = getattr(owner, name, None)
        self._undo.append((_put_attribute, owner, name, _own_value(owner, name)))
        setattr(owner, name, value)
        return previous

    def set_item(self, mapping: MutableMapping, key: Any, value: Any) -> None:
        """``mapping[key] = value`` (e.g. a module in ``sys.modules``)."""
        self._undo.append((_put_item, mapping, key, mapping.get(key, _ABSENT)))
        mapping[key] = value

    def keep(self, owner: Any, name: str) -> None:
        """Change nothing now, but put ``owner.name`` back as it is now on restore (e.g.
        before an import that will bind it)."""
        self._undo.append((_put_attribute, owner, name, _own_value(owner, name)))

    def keep_item(self, mapping: MutableMapping, key: Any) -> None:
        """``keep`` for a mapping's item."""
        self._undo.append((_put_item, mapping, key, mapping.get(key, _ABSENT)))

    def set_everywhere(self, original: Any, replacement: Any, package: str) -> int:
        """Replace every binding of ``original`` in the loaded modules of ``package``
        (``from x import f`` copies the name into the importer); returns how many.
        Raises when no module binds it."""
        found = 0
        for module_name, module in list(sys.modules.items()):
            if module is None or not (module_name == package or module_name.startswith(package + ".")):
                continue
            for attribute, value in list(vars(module).items()):
                if value is original:
                    self.set(module, attribute, replacement)
                    found += 1
        if not found:
            raise PatchTargetMissing(f"{self.label}: no {package} module binds "
                                 f"{getattr(original, '__qualname__', original)!r}"
                                 + (f"; {self.hint}" if self.hint else ""))
        return found

    def restore(self) -> None:
        """Undo every change, the last one first (safe to call again)."""
        while self._undo:
            put, owner, key, value = self._undo.pop()
            put(owner, key, value)
