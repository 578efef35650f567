"""The incremental exact path of the gate: fp64 maintained solvers fed by position.

:class:`SolverBank` holds one exact incremental/decremental solver
(:class:`~sv_attention.svdd.exact.IncrementalSVDD`) per (sequence, kv-head); solver ids are positions. It is
the exact path of both doors that need it:

- ``solver="exact"`` (:func:`exact_gates`): the keys of each sequence are streamed, in position order, into
  the bank; the gate of boundary ``s`` is read off the solvers once they hold exactly the keys at positions
  ``[0, s)``. No gradient.
- :class:`~sv_attention.hf.cache.CertifiedCache`: one bank per layer, admitted chunk by chunk (per batch row,
  at the row's own boundaries), with certified eviction of reserve keys and exact deletion.

Boundaries, warm-up and bandwidth follow :mod:`sv_attention.ops.sv_gate.schedule`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from sv_attention.errors import InfeasibleBoxError
from sv_attention.ops.settings import warmup_size
from sv_attention.ops.sv_gate.schedule import bandwidth
from sv_attention.svdd.box import feasible_size
from sv_attention.svdd.exact import IncrementalSVDD

__all__ = ["BankAdmission", "BankCertificate", "ExactSolvers", "SolverBank", "exact_gates"]

@dataclass
class BankAdmission:
    """Result of admitting keys into the solvers of a bank.

    Attributes
    ----------
    readmitted : set[int]  solver-evicted positions the admission made support vectors again
    elapsed_s : float
    kkt_max : float  largest KKT residual after the admission
    """

    readmitted: set[int]
    elapsed_s: float
    kkt_max: float


@dataclass(frozen=True)
class BankCertificate:
    """Whether a bank certifies its reserve keys as inert (:meth:`SolverBank.certified`).

    Attributes
    ----------
    certified : bool
        Some row is gated and every solver of the gated rows is at a KKT point of its full history
        (evicted keys re-checked) within the solver's tolerance.
    reason : str
        Why (or why not), in words.
    kkt_max : float
        Largest KKT residual over the solvers of the gated rows.
    """

    certified: bool
    reason: str
    kkt_max: float


class SolverBank:
    """Exact solvers of one layer, indexed ``[batch][kv_head]``.

    Rows are independent (:meth:`start_row`, :meth:`admit_row`, :meth:`clear_row`): a batch row's solvers
    exist once the row has its first chunk of real (non-padding) keys; before that the row is not gated.
    Each row keeps its own admitted history (padding positions never enter a row's solvers), so rows may
    stand at different boundaries (a left-padded row counts its own real tokens).

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
    def bandwidth(keys: torch.Tensor, sigma: float | None, chunk: int | None = None) -> np.ndarray:
        """The bandwidth of one batch row's solvers: ``sigma`` when given, else the schedule's median rule
        (:func:`~sv_attention.ops.sv_gate.schedule.bandwidth`) on the row's keys at positions ``< chunk``.

        Parameters
        ----------
        keys : Tensor ``[h, m, d]``  one row's (real) keys in position order
        sigma : float or None
        chunk : int or None  only the first ``chunk`` keys count (None: all ``m``)

        Returns
        -------
        float64 ``[h]``
        """
        h, m = keys.shape[0], keys.shape[1]
        if sigma is not None:
            return np.full(h, float(sigma))
        kd = keys.detach().to("cpu", torch.float64)[None]
        return bandwidth(kd, torch.tensor([m]), chunk).numpy().reshape(h)

    def start_row(self, i: int, sigma: np.ndarray, boundary: int) -> None:
        """Create row ``i``'s solvers with bandwidths ``sigma [h]`` (at chunk boundary ``boundary``)."""
        self.sigma[i] = np.asarray(sigma, dtype=np.float64)
        self.solvers[i] = [IncrementalSVDD(C=self.C, sigma=float(x)) for x in self.sigma[i]]
        self.row_start[i] = int(boundary)

    def clear_row(self, i: int) -> None:
        """Return row ``i`` to "not started": no solvers, no history, bandwidth unknown."""
        self.sigma[i] = np.nan
        self.solvers[i] = None
        self.row_history[i] = set()
        self.row_start[i] = None

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
        """Fewest admitted keys for which a row is gated (:func:`~sv_attention.ops.settings.warmup_size`)."""
        return warmup_size(self.C)

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

    def admit_row(self, i: int, keys: np.ndarray, positions: np.ndarray) -> BankAdmission:
        """Admit keys ``[h, m, d]`` (float64) at ``positions [m]`` into row ``i``'s solvers (one per kv-head)."""
        t0 = time.perf_counter()
        positions = np.asarray(positions, dtype=np.int64)
        readmitted: set[int] = set()
        kkt = 0.0
        if positions.size:
            for s, kij in zip(self.solvers[i], keys, strict=True):
                rec = s.add(kij, ids=positions)
                readmitted.update(int(p) for p in rec.readmitted)
                kkt = max(kkt, rec.kkt.max)
            self.row_history[i].update(int(p) for p in positions)
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
                need = feasible_size(self.C)
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

    def evict_reserve(self, rows: list[int] | None = None) -> list[list[set[int]]]:
        """Solver-level eviction of every reserve key (alpha exactly 0) in the gated rows (of ``rows``; None:
        every row).

        A solver whose *active* set is below ``ceil(1/C) + 2`` keys (possible after earlier evictions)
        is skipped: the exact solver refuses to evict there, and its reserve keys simply stay active (so
        they are not physically evicted either). Returns the per-solver set of positions evicted at the
        solver level (cumulative; empty lists for rows not started).
        """
        for i, _, s in self.each():
            if (rows is None or i in rows) and self.row_gated(i) and s.has_solution and not s.in_warmup:
                s.evict_reserve()
        return [[set(s.evicted_ids) for s in row] if row is not None else [] for row in self.solvers]

    # ------------------------------------------------------------------ reads
    def certified(self) -> BankCertificate:
        """Whether the layer's solvers certify their reserve keys as inert (:class:`BankCertificate`).

        Certified means: some row is gated (at least ``ceil(1/C) + 2`` admitted keys), and every solver
        of the gated rows holds a feasible solution whose KKT residuals (evicted keys re-checked) are
        within the solver's certificate tolerance; then every reserve / evicted key has alpha exactly 0 at
        an optimum of the full history. Rows in warm-up (or not started) evict nothing: their real keys
        stay. (A solver's own ``certificate()`` also asks for ``ceil(1/C) + 2`` *active* keys; after
        eviction the active set may be smaller while the problem, the history, is not.)
        """
        kkt, reason, ok = 0.0, "every solver is at a KKT point of its full history", True
        if not self.gated:
            return BankCertificate(False, f"warm-up: {self.min_row_history()} admitted keys < ceil(1/C)+2 = "
                                          f"{self.warmup_size}; no certificate", 0.0)
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
        return BankCertificate(ok, reason, kkt)

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

    def active_row(self, i: int) -> set[int]:
        """Positions active in at least one of row ``i``'s solvers (empty for a row not started)."""
        return set() if self.solvers[i] is None else {int(p) for s in self.solvers[i] for p in s.ids}

    def alpha_row(self, i: int, length: int) -> np.ndarray:
        """Row ``i``'s gate by position, float64 ``[h, length]``: alpha when the row is gated (0 for reserve,
        evicted, padding and absent positions), else 1 (warm-up or not started: ungated)."""
        h = self.shape[1]
        if not self.row_gated(i):
            return np.ones((h, length))
        out = np.zeros((h, length))
        for j, s in enumerate(self.solvers[i]):
            ids = s.ids
            if ids.size:
                keep = ids < length
                out[j, ids[keep]] = s.alpha[keep]
        return out

    def alpha_dense(self, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Gate weights by position: Tensor ``[b, h, length]``. Gated rows: alpha (0 for reserve, evicted,
        padding and absent positions); rows in warm-up or not started: 1 (ungated)."""
        out = np.stack([self.alpha_row(i, length) for i in range(self.shape[0])])
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


ExactSolvers = tuple[object, list[int]]  # (SolverBank, keys ingested per sequence)


def exact_gates(keys_by_position: torch.Tensor, lengths: torch.Tensor, sigma: torch.Tensor, C: float,
                todo: list[tuple[int, int, torch.Tensor]], state=None,
                ) -> tuple[dict[tuple[int, int], torch.Tensor], ExactSolvers]:
    """Gates of the (boundary, sequences) pairs of ``todo`` from fp64 maintained solvers.

    Parameters
    ----------
    keys_by_position : Tensor ``[b, g, P, d]``
    lengths : long Tensor ``[b]``  keys per sequence (a sequence shorter than ``s`` never requests ``s``)
    sigma : Tensor ``[b, g]``  bandwidth
    C : float  the fixed box
    todo : list of ``(boundary index, s, sequences [m])``
    state : GateState or None  holds the solvers between calls (decoding); ``state.exact`` is reused when
        it has not streamed past a requested boundary

    Returns
    -------
    fitted : dict ``(index, s) -> Tensor [m, g, s]`` (float64)
    solvers : the bank and the number of keys streamed into each sequence's solvers (for the state)
    """
    b, g = keys_by_position.shape[:2]
    sig = sigma.detach().to("cpu", torch.float64).numpy()
    if state is not None and state.exact is not None:
        bank, ingested = state.exact, list(state.exact_ingested)
    else:
        bank, ingested = SolverBank.empty(C, b, g), [0] * b
    fitted: dict[tuple[int, int], torch.Tensor] = {}
    for i, s, rows in sorted(todo, key=lambda t: t[1]):
        out = torch.zeros(len(rows), g, s, dtype=torch.float64)
        for r, row in enumerate(rows.tolist()):
            if ingested[row] > s or not bank.started(row):  # restart the sequence's solvers
                bank.start_row(row, sig[row], s)
                bank.row_history[row] = set()
                ingested[row] = 0
            lo = ingested[row]
            if s > lo:
                bank.admit(keys_by_position[:, :, lo:s], list(range(lo, s)), rows=[row])
                ingested[row] = s
            for j, solver in enumerate(bank.solvers[row]):
                ids = torch.as_tensor(solver.ids, dtype=torch.long)
                out[r, j, ids] = torch.as_tensor(solver.alpha, dtype=torch.float64)
        fitted[(i, s)] = out.to(keys_by_position.device)
    return fitted, (bank, ingested)
