"""Scoped torch intra-op thread settings (process-wide while active, always restored)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from sv_attention.errors import InvalidHyperparameterError


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)`` (None: leave torch's setting), restoring it after.

    For work made of many small operations (the language-model probe's tiny models, the SV gate's boundary
    fits): one intra-op thread is about as fast as two on an idle 2-core machine, and on a shared one two
    threads that wait for each other at every small op were measured 3-20x slower.

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
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
