"""Attribute patches that can be undone: how ``devmode`` and ``ray_helpers`` change torch_xla's,
torch's and Ray's module attributes on a worker, and put them back at shutdown."""

from __future__ import annotations

from typing import Any

_MISSING = object()


class Patches:
    """A stack of replaced attributes; :meth:`undo` restores them in reverse order."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def __bool__(self) -> bool:
        return bool(self._saved)

    def set(self, owner: Any, name: str, value: Any, *, only_if_present: bool = False) -> None:
        """Replace ``owner.name`` with ``value`` (skipped where absent, with ``only_if_present``)."""
        old = getattr(owner, name, _MISSING)
        if old is _MISSING and only_if_present:
            return
        self._saved.append((owner, name, old))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self._saved:
            owner, name, old = self._saved.pop()
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)

