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

    Rows start independently (:meth:`start_row`): a batch row's solvers exist once the row has its first
    chunk of real (non-padding) keys; before that the row is not gated. Each row keeps its own admitted
    history (padding positions never enter a row's solvers). Without padding every row starts at the
    first chunk boundary and all rows hold the same positions.

    Parameters
    ----------
    C : float
        The fixed box.
    sigma : float64 array ``[b, h]``
        Bandwidth per solver; NaN for rows not started yet.
    """

    def __init__(self, C: float, sigma: np.ndarray) -> None:
        self.C = float(C)
        self.sigma = np.array(sigma, dtype=np.float64)
        b, h = self.sigma.shape
        self.solvers: list[list[IncrementalSVDD] | None] = [None] * b
        self.row_history: list[set[int]] = [set() for _ in range(b)]
        """Per row: positions admitted and not deleted (active or evicted at the solver level)."""
        self.row_start: list[int | None] = [None] * b
        """Per row: the chunk boundary at which its solvers were created (None: not started)."""
        for i in range(b):
            if np.isfinite(self.sigma[i]).all():
                self.solvers[i] = [IncrementalSVDD(C=self.C, sigma=float(x)) for x in self.sigma[i]]

    @classmethod
    def empty(cls, C: float, b: int, h: int) -> SolverBank:
        """A bank whose rows are all waiting for :meth:`start_row`."""
        return cls(C, np.full((b, h), np.nan))

    @staticmethod
    def bandwidth(keys: torch.Tensor, sigma: float | None) -> np.ndarray:
        """The bandwidth rule: ``sigma`` when given, else the median pairwise distance of ``keys``.

        Parameters
        ----------
        keys : Tensor ``[h, m, d]`` (one row's first chunk of real keys)

        Returns
        -------
        float64 ``[h]``
        """
        h = keys.shape[0]
        if sigma is not None:
            return np.full(h, float(sigma))
        return median_bandwidth(keys.detach().to("cpu", torch.float64)).numpy().reshape(h)

    def start_row(self, i: int, sigma: np.ndarray, boundary: int) -> None:
        """Create row ``i``'s solvers with bandwidths ``sigma [h]`` (at chunk boundary ``boundary``)."""
        self.sigma[i] = np.asarray(sigma, dtype=np.float64)
        self.solvers[i] = [IncrementalSVDD(C=self.C, sigma=float(x)) for x in self.sigma[i]]
        self.row_start[i] = int(boundary)

    def started(self, i: int) -> bool:
        return self.solvers[i] is not None

    @property
    def shape(self) -> tuple[int, int]:
        return self.sigma.shape

    @property
    def history(self) -> set[int]:
        """Positions admitted (and not deleted) in at least one row."""
        return set().union(*self.row_history)

    def each(self):
        """Yield ``(row, kv_head, solver)`` over the started rows."""
        for i, row in enumerate(self.solvers):
            if row is None:
                continue
            for j, s in enumerate(row):
                yield i, j, s

    @property
    def warmup_size(self) -> int:
        return int(math.ceil(1.0 / self.C - 1e-9)) + 2

    def row_gated(self, i: int) -> bool:
        """Row ``i`` is gated: started, with at least ``ceil(1/C) + 2`` admitted keys."""
        return self.started(i) and len(self.row_history[i]) >= self.warmup_size

    @property
    def gated(self) -> bool:
        """True when some row is gated (rows below ``ceil(1/C) + 2`` admitted keys are ungated warm-up)."""
        return any(self.row_gated(i) for i in range(len(self.solvers)))

    def min_row_history(self) -> int:
        """Fewest admitted keys over the rows (0 for a row not started)."""
        return min(len(h) if self.started(i) else 0 for i, h in enumerate(self.row_history))

    # ------------------------------------------------------------------ mutations
    def admit(self, keys: torch.Tensor, positions: np.ndarray, valid: np.ndarray | None = None,
              rows: list[int] | None = None) -> BankAdmission:
        """Admit keys ``[b, h, m, d]`` at ``positions [m]`` into the solvers of ``rows`` (default: every
        started row), skipping the entries where ``valid [b, m]`` is False (padding)."""
        t0 = time.perf_counter()
        kd = keys.detach().to("cpu", torch.float64).numpy()
        positions = np.asarray(positions, dtype=np.int64)
        readmitted: set[int] = set()
        kkt = 0.0
        rows = [i for i in range(len(self.solvers)) if self.started(i)] if rows is None else rows
        for i in rows:
            sel = np.ones(positions.size, dtype=bool) if valid is None else np.asarray(valid[i], dtype=bool)
            if not sel.any():
                continue
            for s, kij in zip(self.solvers[i], kd[i], strict=True):
                rec = s.add(kij[sel], ids=positions[sel])
                readmitted.update(int(p) for p in rec.readmitted)
                kkt = max(kkt, rec.kkt.max)
            self.row_history[i].update(int(p) for p in positions[sel])
        return BankAdmission(readmitted, time.perf_counter() - t0, kkt)

    @staticmethod
    def held(s: IncrementalSVDD, positions) -> list[int]:
        """The ``positions`` a solver holds (active or evicted)."""
        ids = set(s.ids.tolist()) | set(s.evicted_ids)
        return [int(p) for p in positions if int(p) in ids]

    def check_removable(self, positions: list[int]) -> None:
        """Raise :class:`InfeasibleBoxError` when removing ``positions`` would leave some solver with a
        history of ``n * C < 1`` keys.

        The history is what the solver itself counts: its active keys *and* the keys evicted at the solver
        level (a deletion that the active keys alone cannot absorb re-admits evicted keys first), so an
        earlier certified eviction never changes what can be deleted. Mirrors
        :meth:`IncrementalSVDD.remove`'s own check, so nothing is mutated on refusal.
        """
        ps = set(int(p) for p in positions)
        for i, j, s in self.each():
            if not s.has_solution:
                continue
            held = set(s.ids.tolist()) | set(s.evicted_ids)
            n_hist = len(held)
            n_after = n_hist - len(ps & held)
            if n_after < n_hist and n_after * self.C < 1.0 - 1e-12:
                need = int(math.ceil(1.0 / self.C - 1e-9))
                raise InfeasibleBoxError(
                    f"forgetting {sorted(ps)} leaves solver (batch {i}, kv-head {j}) with a history of {n_after} keys "
                    f"(active + evicted) and {n_after}*C = {n_after * self.C:.4g} < 1 (C={self.C:.4g} is fixed; at "
                    f"least {need} keys are needed): forget fewer tokens, or forget after more tokens were admitted")

    def remove(self, positions: list[int]):
        """Exact decrement of ``positions`` in every solver holding them; yields ``(i, j, receipt, elapsed_s)``."""
        out = []
        for i, j, s in self.each():
            mine = [p for p in positions if p in self.row_history[i]]
            if not mine:
                continue
            t0 = time.perf_counter()
            rec = s.remove(mine)
            out.append((i, j, rec, time.perf_counter() - t0))
        for h in self.row_history:
            h.difference_update(positions)
        return out

    def evict_reserve(self) -> list[list[set[int]]]:
        """Solver-level eviction of every reserve key (alpha exactly 0) in the gated rows.

        A solver whose *active* set is below ``ceil(1/C) + 2`` keys (possible after earlier evictions)
        is skipped: the exact solver refuses to evict there, and its reserve keys simply stay active (so
        they are not physically evicted either). Returns the per-solver set of positions evicted at the
        solver level (cumulative; empty lists for rows not started).
        """
        for i, _, s in self.each():
            if self.row_gated(i) and s.has_solution and not s.in_warmup:
                s.evict_reserve()
        return [[set(s.evicted_ids) for s in row] if row is not None else [] for row in self.solvers]

    # ------------------------------------------------------------------ reads
    def certified(self) -> tuple[bool, str, float]:
        """``(certified, reason, max KKT residual)`` of the layer.

        Certified means: some row is gated (at least ``ceil(1/C) + 2`` admitted keys), and every solver
        of the gated rows holds a feasible solution whose KKT residuals (evicted keys re-checked) are
        within the solver's certificate tolerance; then every reserve / evicted key has alpha exactly 0 at
        an optimum of the full history. Rows in warm-up (or not started) evict nothing: their real keys
        stay. (A solver's own ``certificate()`` also asks for ``ceil(1/C) + 2`` *active* keys; after
        eviction the active set may be smaller while the problem, the history, is not.)
        """
        kkt, reason, ok = 0.0, "every solver is at a KKT point of its full history", True
        if not self.gated:
            return False, (f"warm-up: {self.min_row_history()} admitted keys < ceil(1/C)+2 = {self.warmup_size}; "
                           "no certificate"), 0.0
        for i, j, s in self.each():
            if not self.row_gated(i):
                continue
            c = s.certificate()
            kkt = max(kkt, c.kkt.max)
            if ok and not s.has_solution:
                ok, reason = False, f"solver (batch {i}, kv-head {j}): {c.reason}"
            elif ok and c.kkt.max > c.tolerance:
                ok, reason = False, (f"solver (batch {i}, kv-head {j}): KKT residual {c.kkt.max:.3e} above "
                                     f"tolerance {c.tolerance:g}")
        if ok and not all(self.row_gated(i) for i in range(len(self.solvers))):
            reason += "; rows in warm-up keep every real key"
        return ok, reason, kkt

    def reserve_fraction(self) -> list[list[float]]:
        """Per solver ``[b][h]``: (reserve + solver-evicted) / the row's admitted keys (0 for rows not started)."""
        b, h = self.shape
        out = [[0.0] * h for _ in range(b)]
        for i, j, s in self.each():
            out[i][j] = (len(s.partition.reserve) + len(s.evicted_ids)) / max(1, len(self.row_history[i]))
        return out

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
        """Gate weights by position: Tensor ``[b, h, length]``. Gated rows: alpha (0 for reserve, evicted,
        padding and absent positions); rows in warm-up or not started: 1 (ungated)."""
        b, h = self.shape
        out = np.ones((b, h, length))
        for i in range(b):
            if self.row_gated(i):
                out[i] = 0.0
                for j, s in enumerate(self.solvers[i]):
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
