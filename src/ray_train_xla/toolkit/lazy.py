"""Names a package of the toolkit imports on first use (``toolkit``, ``checkpoint``,
``checkpoint/memory``): importing one of its modules loads only what that module needs."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any],
                                                                 Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` of ``package``, whose ``exports`` (name -> the module of
    the package that defines it) are imported when first used."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
