"""The exact fp64 solvers of one cache layer: one :class:`IncrementalSVDD` per (batch row, kv-head).

Solver ids are token positions. The bank admits a chunk's keys into every solver, evicts reserve keys
at the solver level, decrements deleted positions, and reads the gate (alpha by position) out as a dense tensor.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from sv_attention.errors import InfeasibleBoxError
from sv_attention.kernels import median_bandwidth
from sv_attention.svdd.exact import IncrementalSVDD


@dataclass
class BankAdmission:
    """Result of admitting one chunk into every solver of a layer."""

    readmitted: set[int]
    elapsed_s: float
    kkt_max: float


class SolverBank:
    """Exact solvers of one layer, indexed ``[batch][kv_head]``.

    Parameters
    ----------
    C : float
        The fixed box.
    sigma : float64 array ``[b, h]``
        Bandwidth per solver.
    """

    def __init__(self, C: float, sigma: np.ndarray) -> None:
        self.C = float(C)
        self.sigma = np.asarray(sigma, dtype=np.float64)
        b, h = self.sigma.shape
        self.solvers = [[IncrementalSVDD(C=self.C, sigma=float(self.sigma[i, j])) for j in range(h)]
                        for i in range(b)]
        self.history: set[int] = set()
        """Positions admitted and not deleted (active or evicted at the solver level)."""

    @classmethod
    def from_first_chunk(cls, C: float, keys: torch.Tensor, sigma: float | None) -> SolverBank:
        """Bank with the bandwidth rule: ``sigma`` when given, else the median pairwise distance of the
        first chunk's keys per (batch row, kv-head).

        Parameters
        ----------
        keys : Tensor ``[b, h, m, d]`` (the keys at positions ``< chunk``)
        """
        b, h = keys.shape[0], keys.shape[1]
        if sigma is not None:
            sig = np.full((b, h), float(sigma))
        else:
            sig = median_bandwidth(keys.detach().to("cpu", torch.float64)).numpy().reshape(b, h)
        return cls(C, sig)

    @property
    def shape(self) -> tuple[int, int]:
        return self.sigma.shape

    def each(self):
        for i, row in enumerate(self.solvers):
            for j, s in enumerate(row):
                yield i, j, s

    @property
    def warmup_size(self) -> int:
        return int(math.ceil(1.0 / self.C - 1e-9)) + 2

    @property
    def gated(self) -> bool:
        """True when the admitted history reaches ``ceil(1/C) + 2`` keys (below: ungated warm-up)."""
        return len(self.history) >= self.warmup_size

    # ------------------------------------------------------------------ mutations
    def admit(self, keys: torch.Tensor, positions: np.ndarray) -> BankAdmission:
        """Admit keys ``[b, h, m, d]`` at ``positions [m]`` into every solver."""
        t0 = time.perf_counter()
        kd = keys.detach().to("cpu", torch.float64).numpy()
        readmitted: set[int] = set()
        kkt = 0.0
        for i, j, s in self.each():
            rec = s.add(kd[i, j], ids=positions)
            readmitted.update(int(p) for p in rec.readmitted)
            kkt = max(kkt, rec.kkt.max)
        self.history.update(int(p) for p in positions)
        return BankAdmission(readmitted, time.perf_counter() - t0, kkt)

    def check_removable(self, positions: list[int]) -> None:
        """Raise :class:`InfeasibleBoxError` when removing ``positions`` would leave some solver with
        ``n * C < 1`` active keys (mirrors the solver's own check, so nothing is mutated on refusal)."""
        ps = set(positions)
        for i, j, s in self.each():
            if not s.has_solution:
                continue
            ids = set(s.ids.tolist())
            active = [p for p in ps if p in ids]
            n_after = s.n - len(active)
            if active and n_after * self.C < 1.0 - 1e-12:
                need = int(math.ceil(1.0 / self.C - 1e-9))
                raise InfeasibleBoxError(
                    f"forgetting {sorted(ps)} leaves solver (batch {i}, kv-head {j}) with {n_after} active keys and "
                    f"{n_after}*C = {n_after * self.C:.4g} < 1 (C={self.C:.4g} is fixed; at least {need} keys are "
                    "needed): forget fewer tokens, or forget after more tokens were admitted")

    def remove(self, positions: list[int]):
        """Exact decrement of ``positions`` in every solver; yields ``(i, j, receipt, elapsed_s)``."""
        out = []
        for i, j, s in self.each():
            t0 = time.perf_counter()
            rec = s.remove(positions)
            out.append((i, j, rec, time.perf_counter() - t0))
        self.history.difference_update(positions)
        return out

    def evict_reserve(self) -> list[list[set[int]]]:
        """Solver-level eviction of every reserve key (alpha exactly 0).

        A solver whose *active* set is below ``ceil(1/C) + 2`` keys (possible after earlier evictions)
        is skipped: the exact solver refuses to evict there, and its reserve keys simply stay active (so
        they are not physically evicted either). Returns the per-solver set of positions evicted at the
        solver level (cumulative).
        """
        for _, _, s in self.each():
            if s.has_solution and not s.in_warmup:
                s.evict_reserve()
        return [[set(s.evicted_ids) for s in row] for row in self.solvers]

    # ------------------------------------------------------------------ reads
    def certified(self) -> tuple[bool, str, float]:
        """``(certified, reason, max KKT residual)`` of the whole layer.

        Certified means: the admitted history has at least ``ceil(1/C) + 2`` keys (out of warm-up), and
        every solver holds a feasible solution whose KKT residuals (evicted keys re-checked) are within
        the solver's certificate tolerance; then every reserve / evicted key has alpha exactly 0 at an
        optimum of the full history. (A solver's own ``certificate()`` also asks for ``ceil(1/C) + 2``
        *active* keys; after eviction the active set may be smaller while the problem, the history, is not.)
        """
        kkt, reason, ok = 0.0, "every solver is at a KKT point of its full history", True
        if not self.gated:
            return False, (f"warm-up: {len(self.history)} admitted keys < ceil(1/C)+2 = {self.warmup_size}; "
                           "no certificate"), 0.0
        for i, j, s in self.each():
            c = s.certificate()
            kkt = max(kkt, c.kkt.max)
            if ok and not s.has_solution:
                ok, reason = False, f"solver (batch {i}, kv-head {j}): {c.reason}"
            elif ok and c.kkt.max > c.tolerance:
                ok, reason = False, (f"solver (batch {i}, kv-head {j}): KKT residual {c.kkt.max:.3e} above "
                                     f"tolerance {c.tolerance:g}")
        return ok, reason, kkt

    def reserve_fraction(self) -> list[list[float]]:
        """Per solver: (reserve + solver-evicted) / admitted."""
        n = max(1, len(self.history))
        return [[(len(s.partition.reserve) + len(s.evicted_ids)) / n for s in row] for row in self.solvers]

    def support_positions(self) -> set[int]:
        """Positions with alpha > 0 in at least one solver."""
        out: set[int] = set()
        for _, _, s in self.each():
            a = s.alpha
            out.update(int(p) for p in s.ids[a > 0])
        return out

    def active_positions(self) -> set[int]:
        """Positions active (not evicted at the solver level) in at least one solver."""
        out: set[int] = set()
        for _, _, s in self.each():
            out.update(int(p) for p in s.ids)
        return out

    def alpha_dense(self, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Alpha by position: Tensor ``[b, h, length]`` (0 for reserve, evicted and absent positions)."""
        b, h = self.shape
        out = np.zeros((b, h, length))
        for i, j, s in self.each():
            ids = s.ids
            if ids.size:
                out[i, j, ids] = s.alpha
        return torch.from_numpy(out).to(device=device, dtype=dtype)

    def nbytes(self) -> int:
        """Approximate bytes held by the solvers (keys, Gram, bordered inverse, evicted key store)."""
        total = 0
        for _, _, s in self.each():
            st = s.state_dict()
            for v in (st["X"], st["K"], st["R"], st["alpha"], st["g"]):
                if v is not None:
                    total += v.nbytes
            total += sum(v.nbytes for v in st["evicted"].values())
        return total
