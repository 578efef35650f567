"""RBF Gram rows on demand: what the warm active-set fits read, without the ``[n, n]`` matrix.

The warm boundary fits (:func:`sv_attention.svdd.warm_fit.active_set_fit`) read only the rows of ``K``
of the keys in the margin and error sets (a few hundred of ``n``) and its diagonal. :class:`LazyRBFGram`
computes a key's row ``exp(-||k_j - k_i||^2 / sigma^2)`` against all keys the first time a fit asks for it
and keeps it, so a chain of boundary fits costs ``O(|U| n d)`` time and ``O(|U| n)`` memory, ``U`` the
keys that were ever on the margin or at the bound, instead of ``O(n^2 d)`` and ``O(n^2)`` for the full
Gram. :meth:`LazyRBFGram.prefix` restricts it to the first ``s`` keys (the problem of boundary ``s``); the
rows it returns are the same stored rows, cut at ``s`` columns. Values equal :func:`~sv_attention.kernels.rbf_gram`
to rounding (the diagonal is exactly 1).
"""

from __future__ import annotations

import torch

from sv_attention.kernels import rbf_gram
from sv_attention.svdd.polish import gather_rows, pack_members


class LazyRBFGram:
    """RBF Gram of a batch of key sets, rows computed on demand and kept (no autograd).

    Parameters
    ----------
    keys : Tensor ``[G, N, d]``
    sigma : Tensor ``[G]`` (or broadcastable to it)  bandwidth per problem
    capacity : int  rows per problem the store holds before it first grows (it doubles when full)

    Attributes
    ----------
    rows_computed : int  rows computed so far (all problems), for accounting
    """

    def __init__(self, keys: torch.Tensor, sigma: torch.Tensor, capacity: int = 256) -> None:
        self.keys = keys.detach()
        G, N, _ = self.keys.shape
        self.sigma = sigma.detach().reshape(-1).to(keys.dtype).expand(G).contiguous()
        self.slot = torch.full((G, N), -1, dtype=torch.long, device=keys.device)
        self.filled = torch.zeros(G, dtype=torch.long, device=keys.device)
        self.store = self.keys.new_empty(G, min(max(int(capacity), 0), N), N)
        self.rows_computed = 0

    def reserve(self, capacity: int) -> None:
        """Grow the store to at least ``capacity`` rows per problem (kept rows and slots unchanged)."""
        G, N, _ = self.keys.shape
        capacity = min(int(capacity), N)
        if capacity > self.store.shape[1]:
            grown = self.keys.new_empty(G, capacity, N)
            grown[:, : self.store.shape[1]] = self.store
            self.store = grown

    def prefix(self, s: int) -> LazyPrefix:
        """The Gram of the first ``s`` keys of every problem (sharing this object's stored rows)."""
        if not 0 < s <= self.keys.shape[1]:
            raise ValueError(f"prefix length {s} outside 1..{self.keys.shape[1]}")
        return LazyPrefix(self, s)

    def _ensure(self, index: torch.Tensor) -> torch.Tensor:
        """Store every requested row that is missing; returns the slots of ``index`` ``[G, m]``."""
        slots = self.slot.gather(1, index)
        missing = slots < 0
        if bool(missing.any()):
            G, N, d = self.keys.shape
            # the distinct missing keys per problem, packed to the front of [G, mm]
            flag = torch.zeros(G, N, dtype=torch.bool, device=index.device)
            flag.scatter_(1, index, missing)
            order, used, count = pack_members(flag)
            mm = order.shape[1]
            kj = self.keys.gather(1, order[:, :, None].expand(G, mm, d))  # [G, mm, d]
            with torch.no_grad():
                rows = rbf_gram(kj, self.keys, sigma=self.sigma[:, None, None])  # [G, mm, N]
            rows.scatter_(2, order[:, :, None], 1.0)  # a key against itself: exactly 1, as rbf_gram's diagonal
            need = int((self.filled + count).max())
            if need > self.store.shape[1]:
                self.reserve(max(need, 2 * self.store.shape[1], 16))
            dest = self.filled[:, None] + torch.arange(mm, device=index.device)[None, :]  # [G, mm]
            g_idx, i_idx = used.nonzero(as_tuple=True)  # only the packed slots that hold a missing key
            # whole rows moved by index_select / index_copy_ on the flattened [problems * rows, N] views (row
            # copies; advanced indexing of [G, m, N] costs ~20x more on CPU)
            cap = self.store.shape[1]
            picked = rows.reshape(G * mm, N).index_select(0, g_idx * mm + i_idx)
            self.store.view(G * cap, N).index_copy_(0, g_idx * cap + dest[g_idx, i_idx], picked)
            self.slot[g_idx, order[g_idx, i_idx]] = dest[g_idx, i_idx]
            self.filled += count
            self.rows_computed += int(count.sum())
            slots = self.slot.gather(1, index)
        return slots


class LazyPrefix:
    """The Gram of the first ``s`` keys of a :class:`LazyRBFGram` (what a boundary-``s`` fit reads)."""

    def __init__(self, parent: LazyRBFGram, s: int) -> None:
        self.parent = parent
        self.s = int(s)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.parent.keys.shape[0], self.s, self.s))

    @property
    def dtype(self) -> torch.dtype:
        return self.parent.keys.dtype

    @property
    def device(self) -> torch.device:
        return self.parent.keys.device

    def diagonal(self) -> torch.Tensor:
        """``K_ii`` ``[G, s]`` (exactly 1 for the RBF kernel)."""
        return torch.ones(self.parent.keys.shape[0], self.s, dtype=self.dtype, device=self.device)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``K[g, index[g, i], :s]`` ``[G, m, s]`` (indices must be ``< s``)."""
        if index.numel() and int(index.max()) >= self.s:
            raise IndexError(f"row index {int(index.max())} outside the prefix of {self.s} keys")
        slots = self.parent._ensure(index)
        return gather_rows(self.parent.store, slots)[:, :, : self.s]

    def dense(self, problems: torch.Tensor | None = None) -> torch.Tensor:
        """The full ``[G', s, s]`` Gram (of ``problems`` only, when given): for fallback solvers."""
        keys, sigma = self.parent.keys[:, : self.s], self.parent.sigma
        if problems is not None:
            keys, sigma = keys[problems], sigma[problems]
        return rbf_gram(keys, sigma=sigma[:, None, None])
