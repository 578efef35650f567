"""The exact fp64 maintained SVDD solver (DESIGN §2.2): incremental admission, exact deletion.

Cauwenberghs–Poggio active-set walk on

    min_alpha  alpha^T K alpha - diag(K)^T alpha   s.t.  sum(alpha) = 1,  0 <= alpha <= C

with a fixed box ``C`` for the solver's whole life. The solver keeps the Gram of its active keys (grown
and shrunk by one row/column per key, in a capacity buffer), the KKT gradients
``g_i = rho - K_ii + 2 (K alpha)_i`` and the inverse ``R`` of the bordered margin matrix
``M = [[0, 1^T], [1, 2 K_SS]]`` (rank-one expansion when a key joins S, Schur contraction when it leaves).

- **Admission** of key c: it enters with ``alpha_c = 0``; if ``g_c >= 0`` it is reserve and nothing
  moves; otherwise ``alpha_c`` is swept up, event by event, until ``g_c = 0`` (c joins S) or
  ``alpha_c = C`` (c joins E).
- **Deletion** of key c: ``alpha_c`` is swept down to 0 event by event, then the key is dropped. The
  result is the solution a refit without c reaches, with the same C.
- **Empty margin set** mid-walk (DESIGN §2.2): the swept variable becomes rho (every g moves with slope
  1) until the first key able to take up mass reaches ``g = 0`` and joins S; the walk resumes.
- **Guards**: tiny pivots, exploding ``max|R|`` and a periodic schedule refactor ``R`` from scratch;
  a join whose bordered matrix is singular to working precision (a duplicate key) is refused and the
  key stays on its bound for the rest of the walk; the key that just left S may not re-enter on a
  near-zero step (anti-cycling). All of these are counted as guard events.
- **Fallback**: if a walk exceeds its event budget or ends with a KKT residual above ``1e-7``, a
  from-scratch solve (:mod:`.reference`) replaces it; the receipt says ``fallback=True`` and a
  ``RuntimeWarning`` is issued. Never silent.
- **Reserve eviction with re-check**: :meth:`IncrementalSVDD.evict_reserve` drops reserve keys from the
  active set but keeps their keys; after every later admission or deletion their ``g`` is re-checked and
  a key with ``g < 0`` is re-admitted (listed in the receipt's ``readmitted``), so the solution stays
  optimal for the whole history.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import Counter
from typing import Any

import numpy as np

from sv_attention.errors import (
    DuplicateIdError,
    InfeasibleBoxError,
    InvalidHyperparameterError,
    InvalidInputError,
    SolverError,
    UnknownIdError,
    WarmupError,
)
from sv_attention.svdd.blas import one_blas_thread
from sv_attention.svdd.readapi import ReadAPI, as_float64_matrix
from sv_attention.svdd.receipts import (
    ERROR,
    MARGIN,
    RESERVE,
    AdmissionReceipt,
    Certificate,
    DeletionReceipt,
    EvictionReceipt,
    KKTResiduals,
    Partition,
    kkt_residuals,
)
from sv_attention.svdd.reference import (
    DEGENERATE_GAP,
    canonical_rho,
    check_hyper,
    feasible,
    rho_interval,
    solve_dual,
)
from sv_attention.svdd.reference import refit as refit  # re-exported: the from-scratch reference

SWEEP = 3  # status of the key whose coefficient is being swept

G_TOL = 1e-12          # admission: g_c >= -G_TOL -> reserve; evicted re-check threshold
PIVOT_FLOOR = 1e-9     # |pivot| below this -> refactor, then refuse the join (near-duplicate key)
R_EXPLODE = 1e11       # max|R| above this -> refactor
REFACTOR_EVERY = 200   # periodic refactor (R updates between full refactors)
STEP_EPS = 1e-12       # near-zero step for anti-cycling
FALLBACK_TOL = 1e-7    # KKT residual above this after a walk -> from-scratch solve (reported)
CERT_TOL = 1e-8        # certificate tolerance


class _WalkFailed(Exception):
    """Internal: the active-set walk could not finish (budget, infeasible step)."""


class IncrementalSVDD(ReadAPI):
    """Exact maintained SVDD solver with certified reserve eviction and exact deletion.

    Parameters
    ----------
    C : float
        Box constraint, fixed for the solver's life (``> 0``). Feasibility needs ``n * C >= 1``.
    sigma : float
        RBF bandwidth, ``k(a, b) = exp(-||a - b||^2 / sigma^2)``.

    Notes
    -----
    While ``n * C < 1`` no solution exists: the solver stores keys, ``alpha`` reads as the uniform
    warm-up weights ``1/n`` and ``decision_function`` raises :class:`WarmupError`. Below
    ``ceil(1/C) + 2`` keys the solver is in warm-up and issues no certificate.

    Examples
    --------
    >>> import numpy as np
    >>> s = IncrementalSVDD.from_nu(nu=0.4, n0=24, sigma=2.0)
    >>> rec = s.add(1.5 * np.random.default_rng(0).standard_normal((24, 6)))
    >>> rec = s.remove([3])
    >>> abs(s.alpha.sum() - 1) < 1e-12
    True
    """

    def __init__(self, C: float, sigma: float) -> None:
        self.C, self.sigma = check_hyper(C, sigma)
        self.nu_calibration: dict[str, float] | None = None
        self._inv_s2 = 1.0 / (self.sigma * self.sigma)
        self._d: int | None = None
        self._cap = 0
        self._n = 0
        self._X = np.zeros((0, 0))
        self._K = np.zeros((0, 0))
        self._alpha = np.zeros(0)
        self._g = np.zeros(0)
        self._status = np.zeros(0, dtype=np.int8)
        self._slot_id = np.zeros(0, dtype=np.int64)
        self._id_to_slot: dict[int, int] = {}
        self._S: list[int] = []          # margin slots, aligned with R[1:, 1:]
        self._R: np.ndarray | None = None
        self._rho = 0.0
        self._solved = False
        self._next_id = 0
        self._evicted: dict[int, np.ndarray] = {}
        self._ev_stack: tuple[np.ndarray, np.ndarray] | None = None  # cached (keys [m, d], sq norms [m])
        self._guards: Counter[str] = Counter()
        self._updates_since_refactor = 0
        self._fallbacks = 0
        self._events = 0
        self._last_kkt = KKTResiduals()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_nu(cls, nu: float, n0: int, sigma: float) -> IncrementalSVDD:
        """Calibrate ``C = 1 / (nu * n0)`` once at the reference size ``n0``; C then stays fixed.

        Parameters
        ----------
        nu : float in (0, 1]
        n0 : int >= 1, the declared reference size
        sigma : RBF bandwidth
        """
        try:
            nu_f = float(nu)
        except (TypeError, ValueError) as exc:
            raise InvalidHyperparameterError(f"nu must be a number in (0, 1], got {nu!r}") from exc
        if not (0.0 < nu_f <= 1.0):
            raise InvalidHyperparameterError(f"nu must be in (0, 1], got {nu}; nu is the target fraction of SVs")
        if isinstance(n0, bool) or not isinstance(n0, (int, np.integer)) or n0 < 1:
            raise InvalidHyperparameterError(f"n0 must be a positive integer (the reference size), got {n0!r}")
        s = cls(C=1.0 / (nu_f * int(n0)), sigma=sigma)
        s.nu_calibration = {"nu": nu_f, "n0": int(n0)}
        return s

    # ------------------------------------------------------------------ read API
    @property
    def n(self) -> int:
        """Number of active keys (evicted keys excluded)."""
        return self._n

    @property
    def d(self) -> int | None:
        """Key dimension (None before the first key)."""
        return self._d

    @property
    def warmup_size(self) -> int:
        """``ceil(1/C) + 2``: below this many active keys the solver is in warm-up."""
        return int(math.ceil(1.0 / self.C - 1e-9)) + 2

    @property
    def in_warmup(self) -> bool:
        """True while the history (active + evicted keys) has fewer than ``ceil(1/C) + 2`` keys."""
        return self._n + len(self._evicted) < self.warmup_size

    @property
    def has_solution(self) -> bool:
        """True once ``n * C >= 1`` (a feasible optimum exists and is maintained)."""
        return self._solved

    def _order(self) -> np.ndarray:
        return np.argsort(self._slot_id[: self._n], kind="stable")

    @property
    def ids(self) -> np.ndarray:
        """Active ids, int64 ``[n]``, ascending."""
        return self._slot_id[: self._n][self._order()].copy()

    @property
    def keys(self) -> np.ndarray:
        """Active keys, float64 ``[n, d]``, aligned with :attr:`ids`."""
        return self._X[: self._n][self._order()].copy()

    @property
    def alpha(self) -> np.ndarray:
        """Coefficients, float64 ``[n]``, aligned with :attr:`ids` (uniform ``1/n`` while infeasible)."""
        if not self._solved:
            return np.full(self._n, 1.0 / self._n) if self._n else np.zeros(0)
        return self._alpha[: self._n][self._order()].copy()

    @property
    def gradients(self) -> np.ndarray:
        """KKT gradients ``g``, float64 ``[n]``, aligned with :attr:`ids`."""
        return self._g[: self._n][self._order()].copy()

    @property
    def rho(self) -> float:
        return float(self._rho)

    @property
    def partition(self) -> Partition:
        """Margin / error / reserve ids of the active keys (all empty while infeasible)."""
        if not self._solved:
            return Partition((), (), ())
        st = self._status[: self._n]
        ids = self._slot_id[: self._n]

        def pick(code: int) -> tuple[int, ...]:
            return tuple(int(i) for i in np.sort(ids[st == code]))

        return Partition(margin=pick(MARGIN), error=pick(ERROR), reserve=pick(RESERVE))

    @property
    def evicted_ids(self) -> tuple[int, ...]:
        """Ids evicted as reserve (their keys are stored and re-checked), ascending."""
        return tuple(sorted(self._evicted))

    @property
    def margin_inverse(self) -> tuple[np.ndarray, np.ndarray | None]:
        """``(margin_ids [|S|], R [|S|+1, |S|+1])``: the maintained bordered inverse, rows/cols in the
        order ``[rho, margin_ids...]`` (R is None when S is empty)."""
        ids = self._slot_id[np.array(self._S, dtype=np.int64)] if self._S else np.zeros(0, dtype=np.int64)
        return ids.copy(), None if self._R is None else self._R.copy()

    def alpha_of(self, ids: Any) -> np.ndarray:
        """Coefficients of the given ids: float64 ``[len(ids)]``; 0 for reserve and evicted ids.

        Raises :class:`UnknownIdError` for an id that is neither active nor evicted.
        """
        out = []
        for i in np.atleast_1d(np.asarray(ids)).reshape(-1):
            i = int(i)
            if i in self._id_to_slot:
                out.append(self._alpha[self._id_to_slot[i]] if self._solved else 1.0 / self._n)
            elif i in self._evicted:
                out.append(0.0)
            else:
                raise UnknownIdError(f"id {i} is neither active nor evicted (never added, or removed)")
        return np.array(out, dtype=np.float64)

    def decision_function(self, X: Any) -> Any:
        if not self._solved:
            raise WarmupError(f"no solution yet: {self._n} keys with C={self.C:.6g} give n*C < 1; "
                              f"add at least {self.warmup_size - 2 - self._n} more keys")
        return super().decision_function(X)

    decision_function.__doc__ = ReadAPI.decision_function.__doc__

    def readout(self, Q: Any, values_by_id: Any) -> Any:
        if not self._solved:
            raise WarmupError(f"no solution yet: {self._n} keys with C={self.C:.6g} give n*C < 1; the gate is "
                              "ungated in warm-up (use plain attention weights)")
        return super().readout(Q, values_by_id)

    readout.__doc__ = ReadAPI.readout.__doc__

    @one_blas_thread
    def certificate(self) -> Certificate:
        """KKT residuals (evicted keys re-checked now), partition sizes, guard events, warm-up flag."""
        kkt = self._residuals(with_evicted=True) if self._solved else KKTResiduals()
        if not self._solved:
            ok, reason = False, f"no feasible solution yet (n*C = {self._n * self.C:.4g} < 1)"
        elif self.in_warmup:
            hist = self._n + len(self._evicted)
            ok, reason = False, f"warm-up: {hist} < ceil(1/C)+2 = {self.warmup_size} keys (active + evicted)"
        elif kkt.max > CERT_TOL:
            ok, reason = False, f"KKT residual {kkt.max:.3e} above tolerance {CERT_TOL:g}"
        else:
            ok, reason = True, "KKT point: reserve and evicted keys are inert (alpha = 0 at the optimum)"
        return Certificate(certified=ok, in_warmup=self.in_warmup, n=self._n, n_evicted=len(self._evicted),
                           C=self.C, sigma=self.sigma, partition_sizes=self.partition.sizes, kkt=kkt,
                           tolerance=CERT_TOL, guard_events=sum(self._guards.values()),
                           guard_detail=dict(self._guards), fallbacks=self._fallbacks, reason=reason)

    def state_dict(self) -> dict[str, Any]:
        """A deep copy of the complete solver state (for snapshots / equality checks)."""
        n = self._n
        return {
            "C": self.C, "sigma": self.sigma, "n": n, "d": self._d, "rho": self._rho, "solved": self._solved,
            "X": self._X[:n].copy(), "K": self._K[:n, :n].copy(), "alpha": self._alpha[:n].copy(),
            "g": self._g[:n].copy(), "status": self._status[:n].copy(), "slot_id": self._slot_id[:n].copy(),
            "id_to_slot": dict(self._id_to_slot), "S": list(self._S),
            "R": None if self._R is None else self._R.copy(), "next_id": self._next_id,
            "evicted": {k: v.copy() for k, v in self._evicted.items()}, "guards": dict(self._guards),
            "fallbacks": self._fallbacks, "updates_since_refactor": self._updates_since_refactor,
        }

    def __repr__(self) -> str:
        return (f"IncrementalSVDD(C={self.C:.6g}, sigma={self.sigma:.6g}, n={self._n}, "
                f"evicted={len(self._evicted)}, partition={self.partition.sizes}, warmup={self.in_warmup})")

    # ------------------------------------------------------------------ public mutations
    @one_blas_thread
    def add(self, keys: Any, ids: Any | None = None) -> AdmissionReceipt:
        """Admit keys one by one (exact incremental solve).

        Parameters
        ----------
        keys : float64 ``[m, d]`` (numpy or torch)
        ids : optional int ``[m]`` new, unique ids (e.g. token positions); default: consecutive ids after
            the largest id ever used

        Returns
        -------
        AdmissionReceipt with the new ``ids`` in order and the ``readmitted`` evicted ids.
        """
        t0 = time.perf_counter()
        X = as_float64_matrix(keys, "keys", d=self._d)
        m = X.shape[0]
        new_ids = self._check_new_ids(ids, m)
        guards0, events0 = Counter(self._guards), self._events
        fallback = False
        if self._d is None and m:
            self._d = X.shape[1]
        for k in range(m):
            fallback |= self._admit(X[k], new_ids[k])
        if new_ids:
            self._next_id = max(self._next_id, max(new_ids) + 1)
        readmitted, fb = self._recheck_evicted()
        fallback |= fb
        if self._solved and not self._S:
            self._finalize()  # rho is not unique with an empty margin set: re-centre it on the new history
        return self._receipt(AdmissionReceipt, tuple(new_ids), t0, guards0, events0, fallback,
                             readmitted=readmitted)

    @one_blas_thread
    def remove(self, ids: Any) -> DeletionReceipt:
        """Exact deletion (decrement) of active or evicted ids.

        Raises
        ------
        UnknownIdError : an id is neither active nor evicted
        DuplicateIdError : an id is repeated
        InfeasibleBoxError : the deletion would leave fewer than ``1/C`` keys in the history (active +
            evicted), so ``n * C < 1`` and no feasible solution exists

        Notes
        -----
        When the active keys alone could not absorb the deletion (``n_active * C < 1`` afterwards) but
        evicted keys can, the evicted keys with the smallest ``g`` are re-admitted first (as reserve keys;
        listed in ``readmitted``). The result is still the refit of the whole remaining history.
        """
        t0 = time.perf_counter()
        id_list = self._check_existing_ids(ids)
        active = [i for i in id_list if i in self._id_to_slot]
        n_after = self._n - len(active)
        pre = 0
        if self._solved and active and not feasible(n_after, self.C):
            need = int(math.ceil(1.0 / self.C - 1e-9))
            removing = set(id_list)
            ev_left = sum(1 for i in self._evicted if i not in removing)
            if not feasible(n_after + ev_left, self.C):
                raise InfeasibleBoxError(
                    f"removing {len(id_list)} keys leaves {n_after + ev_left} keys in the history, and "
                    f"{n_after + ev_left}*C = {(n_after + ev_left) * self.C:.6g} < 1 (C={self.C:.6g} is fixed): at "
                    f"least {need} keys are needed; remove fewer keys or add keys first")
            pre = need - n_after
        guards0, events0 = Counter(self._guards), self._events
        fallback = False
        pre_readmitted: list[int] = []
        if pre > 0:  # let evicted keys take up the mass (they join as reserve keys first)
            ev_ids = list(self._evicted)
            ge = self._evicted_g()
            removing = set(id_list)
            for k in np.argsort(ge, kind="stable"):
                if len(pre_readmitted) == pre:
                    break
                ident = ev_ids[int(k)]
                if ident in removing:
                    continue
                x = self._evicted.pop(ident)
                self._ev_stack = None
                fallback |= self._admit(x, ident)
                pre_readmitted.append(ident)
        for i in id_list:
            if i in self._evicted:
                del self._evicted[i]
                self._ev_stack = None
            else:
                fallback |= self._delete(self._id_to_slot[i])
        if self._solved and not self._S:
            self._finalize()  # rho is not unique with an empty margin set: re-centre it on the new history
        readmitted: tuple[int, ...] = tuple(pre_readmitted)
        if active and self._solved:
            more, fb = self._recheck_evicted()
            readmitted += more
            fallback |= fb
        return self._receipt(DeletionReceipt, tuple(id_list), t0, guards0, events0, fallback,
                             readmitted=readmitted)

    @one_blas_thread
    def evict_reserve(self, max_keep: int | None = None) -> EvictionReceipt:
        """Drop reserve keys (``alpha = 0``) from the active set; every readout is unchanged.

        Their keys are kept and re-checked (``g >= 0``) after every later admission / deletion.

        Parameters
        ----------
        max_keep : keep at most this many reserve keys active (those with the smallest ``g``, the
            closest to becoming support vectors); None evicts every reserve key.

        Raises
        ------
        WarmupError : in warm-up no certificate exists, so nothing may be evicted.
        """
        t0 = time.perf_counter()
        if max_keep is not None and (isinstance(max_keep, bool) or not isinstance(max_keep, (int, np.integer))
                                     or max_keep < 0):
            raise InvalidInputError(f"max_keep must be None or an integer >= 0, got {max_keep!r}")
        if not self._solved or self.in_warmup:
            raise WarmupError(f"cannot evict in warm-up ({self._n + len(self._evicted)} < {self.warmup_size} keys): no "
                              "certificate "
                              "is issued yet; add keys first")
        guards0, events0 = Counter(self._guards), self._events
        n = self._n
        res = np.flatnonzero(self._status[:n] == RESERVE)
        if max_keep is not None and max_keep > 0:
            order = np.argsort(self._g[res], kind="stable")
            res = res[order[max_keep:]] if res.size > max_keep else res[:0]
        evicted_ids = sorted(int(self._slot_id[s]) for s in res)
        for i in evicted_ids:
            slot = self._id_to_slot[i]
            self._evicted[i] = self._X[slot].copy()
            self._ev_stack = None
            self._drop_slot(slot)
        return self._receipt(EvictionReceipt, tuple(evicted_ids), t0, guards0, events0, False)

    # ------------------------------------------------------------------ validation
    def _check_new_ids(self, ids: Any, m: int) -> list[int]:
        if ids is None:
            return list(range(self._next_id, self._next_id + m))
        arr = _as_id_array(ids)
        if arr.size != m:
            raise InvalidInputError(f"got {arr.size} ids for {m} keys; pass one id per key")
        lst = [int(i) for i in arr]
        if len(set(lst)) != m:
            dup = sorted({i for i in lst if lst.count(i) > 1})
            raise DuplicateIdError(f"ids repeated in one call: {dup[:10]}; pass unique ids")
        taken = [i for i in lst if i in self._id_to_slot or i in self._evicted]
        if taken:
            raise DuplicateIdError(f"ids already present (active or evicted): {taken[:10]}; new keys need new ids")
        return lst

    def _check_existing_ids(self, ids: Any) -> list[int]:
        arr = _as_id_array(ids)
        lst = [int(i) for i in arr]
        if len(set(lst)) != len(lst):
            dup = sorted({i for i in lst if lst.count(i) > 1})
            raise DuplicateIdError(f"ids repeated in one call: {dup[:10]}; pass each id once")
        unknown = [i for i in lst if i not in self._id_to_slot and i not in self._evicted]
        if unknown:
            raise UnknownIdError(f"unknown ids {unknown[:10]}: never added or already removed; see .ids and "
                                 ".evicted_ids")
        return lst

    # ------------------------------------------------------------------ storage
    def _grow(self, need: int) -> None:
        if need <= self._cap:
            return
        cap = max(16, 2 * self._cap, need)
        d = self._d or 0
        n = self._n
        X = np.zeros((cap, d))
        if n:
            X[:n] = self._X[:n]
        K = np.zeros((cap, cap))
        K[:n, :n] = self._K[:n, :n]
        for name, dtype in (("_alpha", np.float64), ("_g", np.float64), ("_status", np.int8),
                            ("_slot_id", np.int64)):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=dtype)
            new[:n] = old[:n]
            setattr(self, name, new)
        self._X, self._K, self._cap = X, K, cap

    def _kernel_row(self, x: np.ndarray) -> np.ndarray:
        diff = self._X[: self._n] - x
        return np.exp(-np.einsum("nd,nd->n", diff, diff) * self._inv_s2)

    def _append_slot(self, x: np.ndarray, ident: int) -> int:
        self._grow(self._n + 1)
        slot = self._n
        row = self._kernel_row(x)
        self._X[slot] = x
        self._K[slot, :slot] = row
        self._K[:slot, slot] = row
        self._K[slot, slot] = 1.0
        self._alpha[slot] = 0.0
        self._g[slot] = 0.0
        self._status[slot] = RESERVE
        self._slot_id[slot] = ident
        self._id_to_slot[ident] = slot
        self._n += 1
        return slot

    def _drop_slot(self, slot: int) -> None:
        """Remove a slot (alpha must be 0 and it must not be in S) by moving the last slot into it."""
        last = self._n - 1
        ident = int(self._slot_id[slot])
        del self._id_to_slot[ident]
        if slot in self._S:  # only on a fallback path; S and R are rebuilt right after
            self._S.remove(slot)
            self._R = None
        if slot != last:
            self._X[slot] = self._X[last]
            self._K[slot, :last] = self._K[last, :last]
            self._K[:last, slot] = self._K[:last, last]
            self._K[slot, slot] = 1.0
            for arr in (self._alpha, self._g, self._status, self._slot_id):
                arr[slot] = arr[last]
            moved = int(self._slot_id[slot])
            self._id_to_slot[moved] = slot
            if self._status[slot] == MARGIN:
                self._S[self._S.index(last)] = slot
        self._n -= 1

    # ------------------------------------------------------------------ bordered inverse
    def _build_M(self, S: list[int]) -> np.ndarray:
        s = np.array(S, dtype=np.int64)
        M = np.zeros((s.size + 1, s.size + 1))
        M[0, 1:] = 1.0
        M[1:, 0] = 1.0
        M[1:, 1:] = 2.0 * self._K[np.ix_(s, s)]
        return M

    def _refactor(self, reason: str | None) -> bool:
        """Recompute R from scratch for the current S (a guard event named ``reason`` unless None);
        False when M is singular to working precision."""
        if reason is not None:
            self._guards[reason] += 1
        self._updates_since_refactor = 0
        if not self._S:
            self._R = None
            return True
        M = self._build_M(self._S)
        try:
            R = np.linalg.inv(M)
        except np.linalg.LinAlgError:
            return False
        if not np.isfinite(R).all() or np.abs(R).max() > R_EXPLODE:
            return False
        self._R = R
        return True

    def _after_update(self) -> None:
        self._updates_since_refactor += 1
        if self._R is not None and (self._updates_since_refactor >= REFACTOR_EVERY):
            self._refactor("refactor_periodic")
        elif self._R is not None and np.abs(self._R).max() > R_EXPLODE:
            self._refactor("refactor_explode")

    def _expand(self, k: int) -> bool:
        """Add slot k to S (rank-one expansion of R). False (and S unchanged) if the pivot is degenerate."""
        if not self._S:
            a = 2.0 * self._K[k, k]
            self._S = [k]
            self._R = np.array([[-a, 1.0], [1.0, 0.0]])
            self._status[k] = MARGIN
            self._after_update()
            return True
        s = np.array(self._S, dtype=np.int64)
        b = np.empty(s.size + 1)
        b[0] = 1.0
        b[1:] = 2.0 * self._K[s, k]
        R = self._R
        assert R is not None
        beta = -R @ b
        piv = 2.0 * self._K[k, k] + b @ beta
        if abs(piv) < PIVOT_FLOOR:
            # recompute the pivot from a fresh inverse before deciding (drift can fake a tiny pivot)
            if self._refactor("refactor_tiny_pivot") and self._R is not None:
                R = self._R
                beta = -R @ b
                piv = 2.0 * self._K[k, k] + b @ beta
            if abs(piv) < PIVOT_FLOOR:
                # k is a (near-)duplicate of the margin set: the bordered matrix would be singular
                self._guards["refused_degenerate_join"] += 1
                return False
        m = s.size + 1
        Rn = np.empty((m + 1, m + 1))
        Rn[:m, :m] = R + np.outer(beta, beta) / piv
        Rn[:m, m] = beta / piv
        Rn[m, :m] = beta / piv
        Rn[m, m] = 1.0 / piv
        self._R = Rn
        self._S.append(k)
        self._status[k] = MARGIN
        self._after_update()
        return True

    def _contract(self, k: int) -> None:
        """Remove slot k from S (Schur contraction of R). The caller sets its new status."""
        pos = self._S.index(k)
        p = pos + 1
        R = self._R
        assert R is not None
        self._S.pop(pos)
        if not self._S:
            self._R = None
            return
        rpp = R[p, p]
        if abs(rpp) < PIVOT_FLOOR:
            self._refactor("refactor_tiny_pivot")
            return
        Rn = R - np.outer(R[:, p], R[p, :]) / rpp
        last = Rn.shape[0] - 1
        if p != last:  # move the last margin key into position p (a symmetric permutation of R and S)
            Rn[[p, last], :] = Rn[[last, p], :]
            Rn[:, [p, last]] = Rn[:, [last, p]]
            self._S.insert(pos, self._S.pop())
        self._R = np.ascontiguousarray(Rn[:last, :last])
        self._after_update()

    # ------------------------------------------------------------------ the walk
    def _sweep(self, c: int, direction: int) -> None:
        """Sweep alpha_c up (direction=+1, admission) or down to 0 (direction=-1, deletion)."""
        n = self._n
        K, alpha, g, st = self._K, self._alpha, self._g, self._status
        C = self.C
        tabu: set[int] = set()
        left_at_zero: set[int] = set()  # keys that left S on a zero step since the last positive step
        last_left = -1
        budget = 50 + 8 * n
        for _ in range(budget):
            self._events += 1
            if not self._S:
                if self._rho_sweep(c, direction, tabu):
                    return
                continue
            s = np.array(self._S, dtype=np.int64)
            R = self._R
            assert R is not None
            b = np.empty(s.size + 1)
            b[0] = 1.0
            b[1:] = 2.0 * K[s, c]
            beta = -R @ b
            gamma = 2.0 * K[c, :n] + beta[0] + 2.0 * (beta[1:] @ K[s, :n])  # K is symmetric
            gamma[s] = 0.0
            db = beta[1:] * direction
            dg = gamma * direction
            stn = st[:n]
            an = alpha[:n]
            gn = g[:n]
            with np.errstate(divide="ignore", invalid="ignore"):
                # margin keys hitting a bound
                tS = np.where(db > 0, (C - an[s]) / db, np.where(db < 0, -an[s] / db, np.inf))
                # error keys rising to g = 0 (dg > 0), reserve keys falling to g = 0 (dg < 0): step -g/dg
                moving = ((stn == ERROR) & (dg > 0)) | ((stn == RESERVE) & (dg < 0))
                tB = np.where(moving, np.maximum(-gn / dg, 0.0), np.inf)
            for j in tabu:
                tB[j] = np.inf
            for j in left_at_zero | ({last_left} if last_left >= 0 else set()):
                if tB[j] <= STEP_EPS:  # anti-cycling: no re-entry on a zero step
                    tB[j] = np.inf
                    self._guards["anti_cycling_skip"] += 1
            tS = np.maximum(tS, 0.0)
            # the swept key itself
            if direction > 0:
                t_end = C - alpha[c]
                t_join = -g[c] / gamma[c] if gamma[c] > PIVOT_FLOOR else np.inf
                t_join = max(t_join, 0.0)
            else:
                t_end = alpha[c]
                t_join = np.inf
            iS = int(np.argmin(tS)) if tS.size else -1
            iB = int(np.argmin(tB))
            cands = (t_end, t_join, tS[iS] if iS >= 0 else np.inf, tB[iB])
            kind = int(np.argmin(cands))
            t = float(cands[kind])
            if kind != 0 and t_end <= t + 1e-13 * C:
                kind, t = 0, float(t_end)  # a tie with the end of the sweep ends it (no spurious empty S)
            if not np.isfinite(t):
                raise _WalkFailed("no event bounds the sweep")
            if t > STEP_EPS:
                left_at_zero.clear()
            dt = t * direction
            alpha[c] += dt
            alpha[s] += beta[1:] * dt
            self._rho += beta[0] * dt
            gn += gamma * dt
            if kind == 0:  # the swept key reaches its end bound
                if direction > 0:
                    alpha[c] = C
                    st[c] = ERROR
                else:
                    alpha[c] = 0.0
                    st[c] = RESERVE
                return
            if kind == 1:  # c joins S (only when admitting)
                g[c] = 0.0
                if self._expand(c):
                    return
                tabu.add(c)  # unreachable in practice: gamma_c > PIVOT_FLOOR is the pivot
                continue
            if kind == 2:
                k = int(s[iS])
                self._contract(k)
                if db[iS] > 0:
                    alpha[k] = C
                    st[k] = ERROR
                else:
                    alpha[k] = 0.0
                    st[k] = RESERVE
                g[k] = 0.0
                last_left = k
                if t <= STEP_EPS:
                    left_at_zero.add(k)
                tabu.clear()  # a refused (degenerate) join may be possible against the smaller S
                continue
            k = iB
            g[k] = 0.0
            if not self._expand(k):
                tabu.add(k)
        raise _WalkFailed(f"event budget {budget} exhausted")

    def _rho_sweep(self, c: int, direction: int, tabu: set[int]) -> bool:
        """Empty margin set: move rho until a key joins S (DESIGN §2.2). True when the walk is finished."""
        self._guards["empty_margin_rho_sweep"] += 1
        n = self._n
        st, g = self._status[:n], self._g[:n]
        mask_tabu = np.zeros(n, dtype=bool)
        if tabu:
            mask_tabu[list(tabu)] = True
        if direction > 0:
            # raise rho: error keys (g <= 0) rise to 0 and can give up mass; or c itself reaches g = 0
            cand = (st == ERROR) & ~mask_tabu
            steps = np.where(cand, np.maximum(-g, 0.0), np.inf)
            k = int(np.argmin(steps))
            t_c = max(-g[c], 0.0)
            if t_c <= steps[k]:
                self._rho += t_c
                g += t_c
                g[c] = 0.0
                if self._alpha[c] <= 0.0:
                    self._status[c] = RESERVE
                    return True
                if self._expand(c):
                    return True
                raise _WalkFailed("swept key could not join an empty margin set")
            dr = steps[k]
        else:
            if self._alpha[c] <= 1e-13 * self.C:  # rounding residue of a tie: the sweep is over
                self._alpha[c] = 0.0
                return True
            # lower rho: the first reserve key reaches g = 0 and can take up mass
            cand = (st == RESERVE) & ~mask_tabu
            cand[c] = False
            steps = np.where(cand, np.maximum(g, 0.0), np.inf)
            k = int(np.argmin(steps))
            dr = -steps[k]
            if not np.isfinite(dr) and self._alpha[c] <= 1e-9 * self.C:
                self._alpha[c] = 0.0  # every other key is on the box: a tie blurred by rounding
                return True
        if not np.isfinite(dr):
            raise _WalkFailed("empty margin set and no key can join it")
        self._rho += dr
        g += dr
        g[k] = 0.0
        if not self._expand(k):
            raise _WalkFailed("key could not join an empty margin set")
        return False

    # ------------------------------------------------------------------ finishing a walk
    def _finalize(self) -> KKTResiduals:
        """Snap bound coefficients, recompute g exactly, and refine [rho; alpha_S] on the fixed partition.

        The bordered-system residual is exactly ``[sum(alpha) - 1; g_S]``, so one refinement step is
        ``[rho; alpha_S] -= R [sum(alpha) - 1; g_S]`` (no second factorisation).
        """
        n = self._n
        st = self._status[:n]
        alpha = self._alpha[:n]
        alpha[st == ERROR] = self.C
        alpha[st == RESERVE] = 0.0
        K = self._K
        for attempt in range(6):  # at most one degenerate-margin pass + refinement steps
            sv = np.flatnonzero(alpha != 0.0)
            # K alpha over the support (a dense product beats a row gather once the support is large)
            h = 2.0 * ((alpha @ K[:n, :n]) if 3 * sv.size > n else (alpha[sv] @ K[sv, :n])) - 1.0
            if not self._S:
                self._rho = self._canonical_rho(alpha, h)
                self._g[:n] = self._rho + h
                break
            lo, hi = rho_interval(alpha, h, self.C)
            if hi - lo > DEGENERATE_GAP:
                # no key strictly inside the box: the margin keys sit on bounds and rho is not unique
                for k in list(self._S):
                    self._contract(k)
                    at_c = alpha[k] >= 0.5 * self.C
                    alpha[k] = self.C if at_c else 0.0
                    st[k] = ERROR if at_c else RESERVE
                self._guards["degenerate_margin_to_bounds"] += 1
                continue
            self._g[:n] = self._rho + h
            s = np.array(self._S, dtype=np.int64)
            r = np.empty(s.size + 1)
            r[0] = alpha.sum() - 1.0
            r[1:] = self._g[s]
            if np.abs(r).max() <= 1e-14 or attempt >= 4:
                break
            if attempt == 1 and np.abs(r).max() > 1e-9:
                self._refactor("refactor_residual")
            R = self._R
            if R is None:
                break
            dx = R @ r
            self._rho -= dx[0]
            alpha[s] -= dx[1:]
        return self._residuals(with_evicted=False)

    def _canonical_rho(self, alpha: np.ndarray, h: np.ndarray) -> float:
        """Canonical rho for an empty margin set over the full history (evicted reserve keys included,
        since they bound rho from below like active reserve keys)."""
        if not self._evicted:
            return canonical_rho(alpha, h, self.C)
        lo, hi = rho_interval(alpha, h, self.C)
        lo_ev = float((-self._evicted_g(rho=0.0)).max())  # evicted keys: g = rho + h_ev >= 0
        if lo_ev <= hi:  # otherwise an evicted key is violated and the re-check re-admits it
            lo = max(lo, lo_ev)
        if not np.isfinite(lo):
            return hi if np.isfinite(hi) else 0.0
        return 0.5 * (lo + hi) if np.isfinite(hi) else lo

    def _residuals(self, with_evicted: bool) -> KKTResiduals:
        n = self._n
        ge = self._evicted_g() if with_evicted else None
        return kkt_residuals(self._alpha[:n], self._g[:n], self._status[:n], self.C, ge)

    def _evicted_g(self, rho: float | None = None) -> np.ndarray:
        """KKT gradients ``g`` of the evicted keys under the current solution (``rho`` overrides)."""
        if not self._evicted or not self._solved:
            return np.zeros(0)
        if self._ev_stack is None:
            E = np.stack(list(self._evicted.values()))
            self._ev_stack = (E, np.einsum("md,md->m", E, E))
        E, e2 = self._ev_stack
        n = self._n
        sv = np.flatnonzero(self._alpha[:n] != 0.0)
        Xs = self._X[sv]
        # expanded distances (one matmul): accurate to ~1e-15 * ||x||^2, far below the re-check tolerance
        d2 = np.maximum(e2[:, None] + np.einsum("nd,nd->n", Xs, Xs)[None, :] - 2.0 * (E @ Xs.T), 0.0)
        kx = np.exp(-d2 * self._inv_s2)
        return (self._rho if rho is None else rho) - 1.0 + 2.0 * kx @ self._alpha[sv]

    def _from_scratch(self) -> None:
        """Replace the maintained solution by a from-scratch solve of the active keys (first feasible
        admission, or a reported fallback)."""
        n = self._n
        K = self._K[:n, :n]
        alpha, rho, status, _ = solve_dual(K, self.C)
        self._alpha[:n] = alpha
        self._status[:n] = status
        self._rho = rho
        self._S = [int(i) for i in np.flatnonzero(status == MARGIN)]
        if not self._refactor(None):
            try:
                self._rebuild_margin_greedy()
            except _WalkFailed as exc:
                raise SolverError(f"from-scratch solve: {exc}; the keys are degenerate beyond what the exact "
                                  "solver handles (merge duplicate keys before admitting them)") from exc
        self._solved = True
        res = self._finalize()
        if res.max > FALLBACK_TOL:
            warnings.warn(f"IncrementalSVDD: the from-scratch solve ended with KKT residual {res.max:.3e} "
                          "(degenerate keys); see certificate()", RuntimeWarning, stacklevel=4)

    def _rebuild_margin_greedy(self) -> None:
        """Build S key by key when the from-scratch margin block is singular (duplicate keys).

        A key refused as a (near-)duplicate of an accepted margin key j pools its mass with j: if the
        pooled mass fits in the box, j carries it and the key becomes reserve; otherwise j moves to the
        error set at C and the key carries the rest (exact duplicates share one feature-space point, so the
        centre and the decision function are unchanged).
        """
        S = sorted(self._S, key=lambda k: -self._alpha[k])
        self._S, self._R = [], None
        C = self.C
        for k in S:
            if self._expand(k):
                continue
            acc = np.array(self._S, dtype=np.int64)
            j = int(acc[np.argmax(self._K[k, acc])])
            mass = self._alpha[j] + self._alpha[k]
            if mass <= C:
                self._alpha[j], self._alpha[k] = mass, 0.0
                self._status[k] = RESERVE
                continue
            self._contract(j)
            self._alpha[j], self._status[j] = C, ERROR
            self._alpha[k] = mass - C
            if not self._expand(k):
                raise _WalkFailed("degenerate margin set could not be rebuilt")
        self._refactor("refactor_rebuild")

    def _walk_guarded(self, action: Any, on_fail: Any) -> bool:
        """Run a walk and finalize; on failure or a large residual, ``on_fail()`` then a from-scratch solve
        (warned and reported). True on fallback."""
        try:
            action()
            res = self._finalize()
            if res.max <= FALLBACK_TOL:
                return False
            why = f"KKT residual {res.max:.3e} after the active-set walk"
        except (_WalkFailed, np.linalg.LinAlgError) as exc:
            why = f"active-set walk failed ({exc})"
        self._fallbacks += 1
        self._guards["fallback_from_scratch"] += 1
        warnings.warn(f"IncrementalSVDD: {why}; replaced by a from-scratch solve (reported in the receipt)",
                      RuntimeWarning, stacklevel=4)
        on_fail()
        self._from_scratch()
        return True

    # ------------------------------------------------------------------ admission / deletion
    def _admit(self, x: np.ndarray, ident: int) -> bool:
        slot = self._append_slot(x, ident)
        if not self._solved:
            if feasible(self._n, self.C):
                self._from_scratch()
            return False
        n = self._n
        sv = np.flatnonzero(self._alpha[: n - 1] != 0.0)
        gc = self._rho - 1.0 + 2.0 * (self._K[slot, sv] @ self._alpha[sv])
        self._g[slot] = gc
        if gc >= -G_TOL:
            return False
        self._status[slot] = SWEEP
        return self._walk_guarded(lambda: self._sweep(slot, +1), lambda: None)

    def _delete(self, slot: int) -> bool:
        ident = int(self._slot_id[slot])
        if not self._solved or (self._alpha[slot] == 0.0 and self._status[slot] == RESERVE):
            self._drop_slot(slot)  # alpha = 0: nothing else moves
            return False

        def walk() -> None:
            if self._status[slot] == MARGIN:
                self._contract(slot)
            self._status[slot] = SWEEP
            self._sweep(slot, -1)
            self._alpha[slot] = 0.0
            self._status[slot] = RESERVE
            self._drop_slot(slot)

        def on_fail() -> None:
            if ident in self._id_to_slot:
                sl = self._id_to_slot[ident]
                self._alpha[sl] = 0.0
                self._status[sl] = RESERVE
                self._drop_slot(sl)

        return self._walk_guarded(walk, on_fail)

    def _recheck_evicted(self) -> tuple[tuple[int, ...], bool]:
        """Re-admit evicted keys whose g < 0 under the current solution. Returns (ids, fallback)."""
        readmitted: list[int] = []
        fallback = False
        while self._evicted and self._solved:
            ge = self._evicted_g()
            k = int(np.argmin(ge))
            if ge[k] >= -G_TOL:
                break
            ident = list(self._evicted)[k]
            x = self._evicted.pop(ident)
            self._ev_stack = None
            fallback |= self._admit(x, ident)
            readmitted.append(ident)
        return tuple(readmitted), fallback

    def _receipt(self, cls: Any, ids: tuple[int, ...], t0: float, guards0: Counter[str], events0: int,
                 fallback: bool, **extra: Any) -> Any:
        kkt = self._residuals(with_evicted=True) if self._solved else KKTResiduals()
        self._last_kkt = kkt
        detail = {k: v - guards0.get(k, 0) for k, v in self._guards.items() if v - guards0.get(k, 0)}
        st = self._status[: self._n]
        sizes = ({"margin": int(np.count_nonzero(st == MARGIN)), "error": int(np.count_nonzero(st == ERROR)),
                  "reserve": int(np.count_nonzero(st == RESERVE))} if self._solved
                 else {"margin": 0, "error": 0, "reserve": 0})
        return cls(ids=ids, n=self._n, partition_sizes=sizes, kkt=kkt,
                   guard_events=sum(detail.values()), guard_detail=detail,
                   elapsed_s=time.perf_counter() - t0, in_warmup=self.in_warmup, fallback=fallback,
                   events=self._events - events0, **extra)


def _as_id_array(ids: Any) -> np.ndarray:
    if type(ids).__module__.startswith("torch"):
        ids = ids.detach().cpu().numpy()
    if isinstance(ids, (int, np.integer)) and not isinstance(ids, bool):
        ids = [ids]
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim > 1 or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidInputError(f"ids must be a 1-D sequence of integers, got dtype {arr.dtype} shape {arr.shape}")
    return arr.astype(np.int64).reshape(-1)
