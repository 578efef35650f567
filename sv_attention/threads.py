"""Scoped torch intra-op thread settings (process-wide while active, always restored)."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator

import torch

from sv_attention.errors import InvalidHyperparameterError

_LOCK = threading.Lock()
_ACTIVE: dict[int, int] = {}  # scope id -> its thread count, in entry order
_BEFORE: list[int] = []  # torch's setting when the first active scope entered
_IDS = itertools.count()


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)`` (None: leave torch's setting), restoring it after.

    For work made of many small operations (the language-model probe's tiny models, the SV gate's boundary
    fits): one intra-op thread is about as fast as two on an idle 2-core machine, and on a shared one two
    threads that wait for each other at every small op were measured 3-20x slower.

    torch's setting is process-wide, so scopes are shared across Python threads: while any scope is
    active the setting is that of the most recently entered active scope, and when the last one exits
    the setting from before the first one is restored (overlapping scopes of two threads do not leave
    the process at the inner value).

    Raises
    ------
    InvalidHyperparameterError
        ``n`` is not a positive integer (nor None).
    """
    if n is None:
        yield
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidHyperparameterError(f"threads must be a positive integer or None, got {n!r}")
    scope = next(_IDS)
    with _LOCK:
        if not _ACTIVE:
            _BEFORE[:] = [torch.get_num_threads()]
        _ACTIVE[scope] = n
        torch.set_num_threads(n)
    try:
        yield
    finally:
        with _LOCK:
            del _ACTIVE[scope]
            torch.set_num_threads(next(reversed(_ACTIVE.values())) if _ACTIVE else _BEFORE[0])


def outer_threads() -> int:
    """torch's intra-op thread count outside every active :func:`torch_threads` scope (the caller's setting):
    what a kernel that schedules its own threads (the native active-set fit, one parallel region per call)
    may use inside a scope that lowered torch's count for chains of small torch operations."""
    with _LOCK:
        return _BEFORE[0] if _ACTIVE else torch.get_num_threads()
