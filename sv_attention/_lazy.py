"""Lazy attribute resolution for packages (PEP 562 ``__getattr__`` / ``__dir__``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, namespace: dict[str, Any], table: dict[str, str],
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Build ``__getattr__`` and ``__dir__`` resolving ``table`` (name -> defining module) on first use.

    Parameters
    ----------
    package : str
        The package's ``__name__`` (used in the AttributeError message).
    namespace : dict
        The package's ``globals()``; a resolved name is cached there.
    table : dict
        Public name -> fully qualified module that defines it.
    """

    def __getattr__(name: str) -> Any:
        mod = table.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(mod), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(list(namespace) + list(table))

    return __getattr__, __dir__
