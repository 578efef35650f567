"""Run the solver's small dense linear algebra on one BLAS thread.

The exact solver works on small matrices (the bordered margin block, a few hundred rows at most). On a
loaded machine a multi-threaded OpenBLAS spends far longer synchronising its threads than computing:
measured here, ``np.linalg.inv`` of a 132 x 132 matrix took ~300 ms with 2 threads under load and
~0.3 ms with one. :func:`single_blas_thread` limits numpy's BLAS to one thread for the duration of a
solver call when ``threadpoolctl`` is importable (a speed measure only; results are identical either
way, and without threadpoolctl nothing changes). torch's thread settings are not touched.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_CONTROLLER: Any = None
_AVAILABLE: bool | None = None


def single_blas_thread() -> contextlib.AbstractContextManager[Any]:
    """Context manager limiting numpy's BLAS to one thread (a no-op without threadpoolctl)."""
    global _CONTROLLER, _AVAILABLE
    if _AVAILABLE is None:
        try:
            from threadpoolctl import ThreadpoolController

            _CONTROLLER = ThreadpoolController()
            _AVAILABLE = True
        except Exception:  # noqa: BLE001 - optional speed measure only
            _AVAILABLE = False
    if not _AVAILABLE:
        return contextlib.nullcontext()
    return _CONTROLLER.limit(limits=1, user_api="blas")


def one_blas_thread(fn: F) -> F:
    """Decorator form of :func:`single_blas_thread`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with single_blas_thread():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
