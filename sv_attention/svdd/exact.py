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
- **First feasible solve** (the admission that makes ``n * C >= 1``) is a walk too, independent of the
  SMO reference (:mod:`.reference`): a *slack key* with a zero kernel row and no upper bound starts with
  all the mass (a trivially optimal point), the stored keys are admitted one by one, then the slack key
  is deleted by the deletion walk.
- **Deletion** of key c: an exact duplicate of c (bitwise-equal key, so an identical Gram row) takes
  over as much of ``alpha_c`` as its box allows, with no walk (:meth:`IncrementalSVDD._absorb_into_twins`);
  what is left of ``alpha_c`` is swept down to 0 event by event, then the key is dropped. The result is the
  solution a refit without c reaches, with the same C.
- **Empty margin set** mid-walk (DESIGN §2.2): the swept variable becomes rho (every g moves with slope
  1) until the first key able to take up mass reaches ``g = 0`` and joins S; the walk resumes.
- **Degenerate keys** (exact or near duplicates, bandwidths far above the data scale): a key whose
  sensitivity ``gamma`` is below the rounding noise of its computation cannot move relative to S and
  raises no event; a join whose pivot (refined once against the bordered matrix, no refactorisation) is
  below :data:`PIVOT_FLOOR` is refused and the key stays on its bound while S is unchanged (exact tie
  rule: the key is a (near-)duplicate of the margin set, so the solution does not need it). Exploding
  ``max|R|`` and a periodic schedule refactor ``R``; the key that just left S may not re-enter on a
  near-zero step (anti-cycling). All of these are counted as guard events.
- **Fallback**: if a walk exceeds its event budget or ends with a KKT residual above :data:`CERT_TOL`, a
  from-scratch solve replaces it -- the slack-key walks on a fresh state, else the SMO reference -- and
  is *verified* (box, sum, every KKT condition within :data:`CERT_TOL`) before it replaces the state;
  the receipt says ``fallback=True`` and a ``RuntimeWarning`` is issued. A from-scratch solve that fails
  verification, or a second failed walk in the same call, raises :class:`SolverError` with the solver
  exactly as before the call (every public mutation is a transaction).
- **Reserve eviction with re-check**: :meth:`IncrementalSVDD.evict_reserve` drops reserve keys from the
  active set but keeps their keys; after every later admission or deletion their ``g`` is re-checked and
  a key with ``g < 0`` is re-admitted (listed in the receipt's ``readmitted``), so the solution stays
  optimal for the whole history. Kernels against evicted keys go through
  :func:`~sv_attention.svdd.readapi.rbf_cross` (centred keys, entries at risk recomputed by
  differences), so keys far from the origin certify correctly; a NaN anywhere makes a certificate fail.
"""

from __future__ import annotations

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
    SVAttentionError,
    UnknownIdError,
    WarmupError,
)
from sv_attention.svdd.blas import one_blas_thread
from sv_attention.svdd.box import feasible_size, warmup_size
from sv_attention.svdd.readapi import ReadAPI, as_float64_matrix, as_id_array, rbf_cross
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

SWEEP = 3    # status of the key whose coefficient is being swept
PENDING = 4  # first feasible solve: a stored key not admitted yet (ignored by the walk)

G_TOL = 1e-12          # admission: g_c >= -G_TOL -> reserve; evicted re-check threshold
PIVOT_FLOOR = 1e-9     # |pivot| (refined once) below this -> refuse the join (near-duplicate key)
R_EXPLODE = 1e11       # max|R| above this -> refactor
REFACTOR_EVERY = 200   # periodic refactor (R updates between full refactors)
STEP_EPS = 1e-12       # near-zero step for anti-cycling
GAMMA_NOISE = 8.0      # |gamma_i| below GAMMA_NOISE * eps * (|S| + 2) * (2 + |beta|_1): no event (frozen key)
CERT_TOL = 1e-8        # certificate tolerance
EPS = float(np.finfo(np.float64).eps)
FALLBACK_TOL = CERT_TOL  # KKT residual above this after a walk -> verified from-scratch solve (reported)
REPAIR_TOL = 1e-11     # a bound key violating its KKT sign by more than this after a walk is swept (repair)
REPAIR_ROUNDS = 8      # repair sweeps per walk at most


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
        self._ev_stack: np.ndarray | None = None  # cached evicted keys, stacked [m, d]
        self._guards: Counter[str] = Counter()
        self._updates_since_refactor = 0
        self._fallbacks = 0
        self._events = 0
        self._last_kkt = KKTResiduals()
        self._slack = -1                  # slot of the slack key during a first / from-scratch solve
        self._undo: list[tuple[int, int, np.ndarray, np.ndarray]] | None = None  # dropped slots (transaction)
        self._call_fallback = False       # a fallback already happened in the current public call

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
        return warmup_size(self.C)

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

        Raises :class:`UnknownIdError` for an id that is neither active nor evicted, and
        :class:`InvalidInputError` for ids that are not integers (``5.7`` is not read as 5) or not 1-D.
        """
        out = []
        for i in as_id_array(ids):
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
        elif not np.isfinite(kkt.max):
            bad = [k for k, v in kkt.as_dict().items() if k != "max" and not np.isfinite(v)]
            ok, reason = False, (f"non-finite KKT residual in {bad} (a NaN or an overflow in the solution or the "
                                 "evicted-key re-check): not certified")
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

        Raises
        ------
        InvalidInputError, DuplicateIdError : malformed keys or ids (decided before any change)
        SolverError : the walk and the verified from-scratch solve both failed; the solver is exactly as
            before the call
        """
        t0 = time.perf_counter()
        X = as_float64_matrix(keys, "keys", d=self._d)
        m = X.shape[0]
        new_ids = self._check_new_ids(ids, m)
        guards0, events0 = Counter(self._guards), self._events

        def body() -> tuple[bool, tuple[int, ...]]:
            fallback = False
            if self._d is None and m:
                self._d = X.shape[1]
            for k in range(m):
                fallback |= self._admit(X[k], new_ids[k])
            if new_ids:
                self._next_id = max(self._next_id, max(new_ids) + 1)
            readmitted, fb = self._recheck_evicted()
            if self._solved and not self._S:
                self._finalize()  # rho is not unique with an empty margin set: re-centre it on the new history
            return fallback or fb, readmitted

        fallback, readmitted = self._transaction(f"add({m} keys)", body)
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
        SolverError : the walk and the verified from-scratch solve both failed; the solver is exactly as
            before the call

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
            need = feasible_size(self.C)
            removing = set(id_list)
            ev_left = sum(1 for i in self._evicted if i not in removing)
            if not feasible(n_after + ev_left, self.C):
                raise InfeasibleBoxError(
                    f"removing {len(id_list)} keys leaves {n_after + ev_left} keys in the history, and "
                    f"{n_after + ev_left}*C = {(n_after + ev_left) * self.C:.6g} < 1 (C={self.C:.6g} is fixed): at "
                    f"least {need} keys are needed; remove fewer keys or add keys first")
            pre = need - n_after
        guards0, events0 = Counter(self._guards), self._events
        inert = [self._id_to_slot[i] for i in active]
        if pre == 0 and self._S and all(self._alpha[k] == 0.0 and self._status[k] == RESERVE for k in inert):
            # only keys with alpha = 0: the solution, rho and every gradient stay as they are (no walk, no
            # re-check, nothing that can fail)
            for i in id_list:
                if i in self._evicted:
                    del self._evicted[i]
                    self._ev_stack = None
                else:
                    self._drop_slot(self._id_to_slot[i])
            return self._receipt(DeletionReceipt, tuple(id_list), t0, guards0, events0, False, readmitted=())

        def body() -> tuple[bool, tuple[int, ...]]:
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
            return fallback, readmitted

        fallback, readmitted = self._transaction(f"remove({len(id_list)} ids)", body)
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
        arr = as_id_array(ids)
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
        arr = as_id_array(ids)
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
        """Remove a slot (alpha must be 0 and it must not be in S) by moving the last slot into it.

        Inside a transaction the slot's key and Gram row are logged first (:meth:`_undo_drop`)."""
        last = self._n - 1
        if self._undo is not None:
            self._undo.append((slot, last, self._X[slot].copy(), self._K[slot, : last + 1].copy()))
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

    def _undo_drop(self, entry: tuple[int, int, np.ndarray, np.ndarray]) -> None:
        """Reverse one logged :meth:`_drop_slot` on the key / Gram storage (bookkeeping is restored by
        :meth:`_restore`): the moved last slot goes back to ``last``, the dropped one to ``slot``."""
        slot, last, x, row = entry
        X, K = self._X, self._K
        if slot != last:
            X[last] = X[slot]
            K[last, :last] = K[slot, :last]
            K[:last, last] = K[:last, slot]
            K[last, last] = 1.0
        X[slot] = x
        K[slot, : last + 1] = row
        K[: last + 1, slot] = row

    # ------------------------------------------------------------------ transactions
    def _snapshot(self) -> dict[str, Any]:
        """The solution and bookkeeping a public mutation changes (O(n + |S|^2); keys and Gram rows are
        restored from the drop log instead of being copied)."""
        n = self._n
        # R is never written in place (expansion, contraction and refactorisation build a new array), so the
        # snapshot keeps a reference
        return {"n": n, "d": self._d, "alpha": self._alpha[:n].copy(), "g": self._g[:n].copy(),
                "status": self._status[:n].copy(), "slot_id": self._slot_id[:n].copy(), "S": list(self._S),
                "R": self._R, "rho": self._rho, "solved": self._solved,
                "next_id": self._next_id, "evicted": dict(self._evicted), "guards": Counter(self._guards),
                "updates": self._updates_since_refactor, "fallbacks": self._fallbacks, "events": self._events,
                "last_kkt": self._last_kkt}

    def _restore(self, snap: dict[str, Any]) -> None:
        """Return to ``snap`` (taken by :meth:`_snapshot` when the drop log was started)."""
        for entry in reversed(self._undo or []):
            self._undo_drop(entry)
        if self._undo is not None:
            self._undo.clear()
        n = snap["n"]
        self._n, self._d = n, snap["d"]
        for name in ("alpha", "g", "status", "slot_id"):
            getattr(self, "_" + name)[:n] = snap[name]
        self._id_to_slot = {int(i): k for k, i in enumerate(self._slot_id[:n])}
        self._S, self._R = list(snap["S"]), snap["R"]
        self._rho, self._solved, self._next_id = snap["rho"], snap["solved"], snap["next_id"]
        self._evicted = dict(snap["evicted"])
        self._ev_stack = None
        self._guards = Counter(snap["guards"])
        self._updates_since_refactor, self._fallbacks = snap["updates"], snap["fallbacks"]
        self._events, self._last_kkt, self._slack = snap["events"], snap["last_kkt"], -1
        if self._d is None:  # nothing was ever stored: start the storage afresh (the next keys fix d)
            self._cap, self._X, self._K = 0, np.zeros((0, 0)), np.zeros((0, 0))

    def _transaction(self, what: str, body: Any) -> Any:
        """Run ``body()``; on any exception put the solver back exactly as it was and raise.

        Typed errors pass through (after the restore); anything else becomes a :class:`SolverError`."""
        snap = self._snapshot()
        self._undo, self._call_fallback = [], False
        try:
            return body()
        except BaseException as exc:
            self._restore(snap)
            if isinstance(exc, SVAttentionError) or not isinstance(exc, Exception):
                raise
            raise SolverError(f"IncrementalSVDD.{what} failed ({type(exc).__name__}: {exc}); the solver was "
                              "restored to its state before the call") from exc
        finally:
            self._undo, self._call_fallback = None, False

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

    def _join_direction(self, k: int) -> tuple[np.ndarray, np.ndarray, float]:
        """For a key k outside a non-empty S: ``(s, beta, pivot)`` with ``beta = -R [1; 2 K_Sk]`` (the move of
        ``[rho; alpha_S]`` per unit of ``alpha_k`` that keeps the sum and ``g_S``) and the pivot
        ``2 K_kk + b^T beta`` (Schur complement of k). A pivot below :data:`PIVOT_FLOOR` is recomputed after
        one refinement step against the bordered matrix itself (drift in R can fake a tiny pivot);
        O(|S|^2), no refactorisation."""
        s = np.array(self._S, dtype=np.int64)
        b = np.empty(s.size + 1)
        b[0] = 1.0
        b[1:] = 2.0 * self._K[s, k]
        R = self._R
        assert R is not None
        beta = -R @ b
        piv = 2.0 * self._K[k, k] + b @ beta
        if abs(piv) < PIVOT_FLOOR:
            r = np.empty_like(b)
            r[0] = beta[1:].sum()
            r[1:] = beta[0] + 2.0 * (self._K[np.ix_(s, s)] @ beta[1:])
            beta -= R @ (r + b)
            piv = 2.0 * self._K[k, k] + b @ beta
        return s, beta, float(piv)

    def _expand(self, k: int) -> bool:
        """Add slot k to S (rank-one expansion of R). False (and S unchanged) if the pivot is degenerate."""
        if not self._S:
            a = 2.0 * self._K[k, k]
            self._S = [k]
            self._R = np.array([[-a, 1.0], [1.0, 0.0]])
            self._status[k] = MARGIN
            self._after_update()
            return True
        s, beta, piv = self._join_direction(k)
        if abs(piv) < PIVOT_FLOOR:
            # k is a (near-)duplicate of the margin set: the bordered matrix would be singular
            self._guards["refused_degenerate_join"] += 1
            return False
        R = self._R
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

    def _swap_in(self, k: int) -> int | None:
        """Degenerate join (pivoted rank-one update): k, on a bound with ``g_k = 0``, is (nearly) in the span
        of S, so moving ``alpha_k`` into the box together with ``alpha_S += beta * dalpha_k`` keeps the sum
        and every ``g_S`` and moves the centre only by O(sqrt(pivot)). Move along that direction until the
        first margin key j reaches a bound; j leaves S and k joins in its place (its pivot against
        ``S \\ {j}`` is ``pivot + beta_j^2 / R_jj``, checked first). When k would cross its whole box first it
        moves to its other bound instead. Returns the key that left S (k itself when it only changed bound),
        or None when neither is possible (nothing moved; the caller keeps k on its bound).
        """
        if not self._S:
            return None
        n, C = self._n, self.C
        alpha, g, st = self._alpha, self._g, self._status
        s, beta, piv = self._join_direction(k)
        up = 1.0 if alpha[k] <= 0.5 * C else -1.0
        db = beta[1:] * up
        room = C - alpha[s]
        if self._slack >= 0:
            room[s == self._slack] = np.inf
        with np.errstate(divide="ignore", invalid="ignore"):
            tS = np.maximum(np.where(db > 0, room / db, np.where(db < 0, -alpha[s] / db, np.inf)), 0.0)
        i = int(np.argmin(tS))
        t = float(tS[i])
        box_k = np.inf if k == self._slack else C
        crosses = box_k <= t
        if not crosses:
            R = self._R
            assert R is not None
            if abs(piv + beta[i + 1] ** 2 / R[i + 1, i + 1]) < PIVOT_FLOOR:
                return None
        else:
            t = C
        gam = 2.0 * self._K[k, :n] + beta[0] + 2.0 * (beta[1:] @ self._K[s, :n])
        dt = t * up
        alpha[k] += dt
        alpha[s] += beta[1:] * dt
        self._rho += beta[0] * dt
        g[:n] += gam * dt
        g[k] = 0.0
        self._guards["degenerate_swap"] += 1
        if crosses:
            alpha[k], st[k] = (C, ERROR) if up > 0 else (0.0, RESERVE)
            return k
        j = int(s[i])
        self._contract(j)
        alpha[j], st[j] = (C, ERROR) if db[i] > 0 else (0.0, RESERVE)
        g[j] = 0.0
        if not self._expand(k):  # cannot happen after the pivot check above, short of rounding
            raise _WalkFailed("degenerate join: the swapped key could not join the margin set")
        return j

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
    def _sweep(self, c: int, direction: int, join: bool | None = None) -> None:
        """Sweep alpha_c up (direction=+1, admission) or down (direction=-1, deletion: to 0).

        The swept key joins S when its ``g`` reaches 0 if ``join`` (default: when admitting); a repair sweep
        (:meth:`_repair`) of an error key with ``g > 0`` sweeps down with ``join=True``."""
        join = direction > 0 if join is None else join
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
            # rounding noise of gamma: a key below it cannot move relative to S (an exact duplicate of a
            # margin key has gamma = 0 in exact arithmetic) and raises no event
            noise = GAMMA_NOISE * EPS * (s.size + 2) * (2.0 + np.abs(beta).sum())
            db = beta[1:] * direction
            dg = gamma * direction
            stn = st[:n]
            an = alpha[:n]
            gn = g[:n]
            room = C - an[s]
            if self._slack >= 0:
                room[s == self._slack] = np.inf  # the slack key has no upper bound
            with np.errstate(divide="ignore", invalid="ignore"):
                # margin keys hitting a bound
                tS = np.where(db > 0, room / db, np.where(db < 0, -an[s] / db, np.inf))
                # error keys rising to g = 0 (dg > 0), reserve keys falling to g = 0 (dg < 0): step -g/dg
                moving = ((stn == ERROR) & (dg > noise)) | ((stn == RESERVE) & (dg < -noise))
                tB = np.where(moving, np.maximum(-gn / dg, 0.0), np.inf)
            for j in tabu:
                tB[j] = np.inf
            for j in left_at_zero | ({last_left} if last_left >= 0 else set()):
                if tB[j] <= STEP_EPS:  # anti-cycling: no re-entry on a zero step
                    tB[j] = np.inf
                    self._guards["anti_cycling_skip"] += 1
            tS = np.maximum(tS, 0.0)
            # the swept key itself
            t_end = C - alpha[c] if direction > 0 else alpha[c]
            # g_c moves with slope gamma_c * direction (gamma_c is c's pivot: it joins only when that is safe)
            t_join = -g[c] * direction / gamma[c] if join and gamma[c] > PIVOT_FLOOR else np.inf
            if t_join < 0.0:  # g_c is moving away from 0 (only a rounding-level g_c may join at once)
                t_join = 0.0 if abs(g[c]) <= G_TOL else np.inf
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
                left = self._swap_in(k)
                if left is None or left == k:
                    tabu.add(k)
                else:
                    last_left = left
                    if t <= STEP_EPS:
                        left_at_zero.add(left)
                    tabu.clear()
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
            # On an ill-conditioned margin block a residual at rounding level can ask for a large move of
            # alpha_S; never leave the box for it: take the largest fraction of the step that stays inside
            # (the residual shrinks by that fraction) and stop refining.
            a_s, da = alpha[s], dx[1:]
            with np.errstate(divide="ignore", invalid="ignore"):
                lim = np.where(da > 0, a_s / da, np.where(da < 0, (a_s - self.C) / da, np.inf))
            frac = min(1.0, float(lim.min())) if lim.size else 1.0
            if frac < 1.0:
                self._guards["refine_damped"] += 1
                frac = max(frac, 0.0)
            self._rho -= frac * dx[0]
            alpha[s] -= frac * da
            if frac < 1.0:
                alpha[s] = np.clip(alpha[s], 0.0, self.C)
                h = 2.0 * (alpha[: n] @ K[:n, :n]) - 1.0
                self._g[:n] = self._rho + h
                break
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
        """KKT gradients ``g`` of the evicted keys under the current solution (``rho`` overrides).

        Kernels by :func:`rbf_cross` (centred keys, entries at risk of cancellation recomputed by
        differences), so keys far from the origin are re-checked as accurately as the active ones."""
        if not self._evicted or not self._solved:
            return np.zeros(0)
        if self._ev_stack is None:
            self._ev_stack = np.stack(list(self._evicted.values()))
        E = self._ev_stack
        n = self._n
        sv = np.flatnonzero(self._alpha[:n] != 0.0)
        kx = rbf_cross(E, self._X[sv], self._inv_s2)
        return (self._rho if rho is None else rho) - 1.0 + 2.0 * kx @ self._alpha[sv]

    # ------------------------------------------------------------------ from-scratch solves
    def _from_scratch(self, first: bool = False) -> str:
        """Replace the solution by a verified from-scratch solve of the active keys; returns the method.

        Candidates, in order: ``"walks"`` (:meth:`_solve_by_walks`, the solver's own walk from a slack-key
        start on a fresh state; independent of the reference) and ``"smo"`` (the SMO reference of
        :mod:`.reference`, its margin set factored afresh). A candidate replaces the state only when the box,
        the sum and every KKT condition hold within :data:`CERT_TOL`; the first feasible solve
        (``first=True``) counts a guard event only when it needed the SMO candidate.

        Raises
        ------
        SolverError
            Neither candidate verified; the solution is restored to what it was before the call.
        """
        n = self._n
        snap = self._snapshot()
        why = []
        for name, method in (("walks", self._solve_by_walks), ("smo", self._solve_by_smo)):
            try:
                method()
                self._solved = True
                res = self._repair(self._finalize())
                if np.isfinite(res.max) and res.max <= CERT_TOL:
                    if not (first and name == "walks"):
                        self._guards[f"scratch_{name}"] += 1
                    return name
                why.append(f"{name}: KKT residual {res.max:.3e}")
            except (_WalkFailed, np.linalg.LinAlgError) as exc:
                why.append(f"{name}: {exc}")
            self._restore_solution(snap)
        raise SolverError(f"IncrementalSVDD: no from-scratch solve of the {n} active keys passed verification "
                          f"({'; '.join(why)}; tolerance {CERT_TOL:g}); the keys are degenerate beyond what the "
                          "exact solver handles (merge duplicate keys, or use a smaller bandwidth)")

    def _restore_solution(self, snap: dict[str, Any]) -> None:
        """Restore the solution part of ``snap`` (slots unchanged: a from-scratch candidate failed)."""
        n = self._n
        self._alpha[:n], self._g[:n], self._status[:n] = snap["alpha"], snap["g"], snap["status"]
        self._S, self._R = list(snap["S"]), snap["R"]
        self._rho, self._solved, self._updates_since_refactor = snap["rho"], snap["solved"], snap["updates"]
        self._slack = -1

    def _solve_by_walks(self) -> None:
        """Solve the active keys by walks: a slack key (zero kernel row, ``K_zz = 1``, no upper bound) holds
        all the mass -- the only feasible, hence optimal, point -- then each stored key is admitted by the
        admission walk, and the slack key is removed by the deletion walk (``n * C >= 1`` lets the real keys
        take all the mass). Exact, and independent of the SMO reference."""
        n = self._n
        self._grow(n + 1)
        z = n
        K, alpha, g, st = self._K, self._alpha, self._g, self._status
        self._X[z] = 0.0
        K[z, :n] = 0.0
        K[:n, z] = 0.0
        K[z, z] = 1.0
        alpha[:n] = 0.0
        g[: n + 1] = 0.0
        st[:n] = PENDING
        alpha[z], st[z], self._slot_id[z] = 1.0, MARGIN, -1
        self._n, self._slack = n + 1, z
        self._S, self._R, self._rho = [z], np.array([[-2.0, 1.0], [1.0, 0.0]]), -1.0  # g_z = rho + 1 = 0
        self._updates_since_refactor = 0
        try:
            for c in range(n):
                sv = np.flatnonzero(alpha[: n + 1] != 0.0)
                g[c] = self._rho - 1.0 + 2.0 * (K[c, sv] @ alpha[sv])
                if g[c] >= -G_TOL:
                    st[c] = RESERVE
                    continue
                st[c] = SWEEP
                self._sweep(c, +1)
            if st[z] == MARGIN:
                self._contract(z)
            if alpha[z] > 0.0:
                st[z] = SWEEP
                self._sweep(z, -1)
            alpha[z], st[z] = 0.0, RESERVE
        finally:
            if z in self._S:  # only when the walk failed part-way
                self._S.remove(z)
                self._R = None
            self._n, self._slack = n, -1

    def _solve_by_smo(self) -> None:
        """Solve the active keys with the SMO reference and factor its margin set afresh."""
        n = self._n
        alpha, rho, status, _ = solve_dual(self._K[:n, :n], self.C)
        self._alpha[:n] = alpha
        self._status[:n] = status
        self._rho = rho
        self._S = [int(i) for i in np.flatnonzero(status == MARGIN)]
        if not self._refactor(None):
            self._rebuild_margin_greedy()

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

    def _repair(self, res: KKTResiduals) -> KKTResiduals:
        """Continue the walk from a finished state whose bound keys violate their KKT sign by more than
        :data:`REPAIR_TOL` (a degenerate join that could be neither taken nor swapped, a key frozen below the
        rounding noise): the worst one is swept like an admission (reserve key, ``g < 0``: up) or a
        decrement that may join S (error key, ``g > 0``: down), then the state is finalized again; at most
        :data:`REPAIR_ROUNDS` rounds. Exact: these are the walk's own steps. Returns the final residuals."""
        n = self._n
        for _ in range(REPAIR_ROUNDS):
            if not (res.reserve > REPAIR_TOL or res.error > REPAIR_TOL) or not np.isfinite(res.max):
                break
            g, st = self._g[:n], self._status[:n]
            viol = np.where(st == RESERVE, -g, np.where(st == ERROR, g, -np.inf))
            k = int(np.argmax(viol))
            if viol[k] <= REPAIR_TOL:
                break
            self._guards["repair_sweep"] += 1
            direction = 1 if st[k] == RESERVE else -1
            st[k] = SWEEP
            self._sweep(k, direction, join=True)
            if st[k] == SWEEP:  # ended on its bound without joining (direction -1 reaches 0)
                self._alpha[k], st[k] = 0.0, RESERVE
            res = self._finalize()
        return res

    def _walk_guarded(self, action: Any, on_fail: Any) -> bool:
        """Run a walk and finalize; on failure or a residual above :data:`FALLBACK_TOL`, ``on_fail()`` then
        a verified from-scratch solve (warned and reported). True on fallback.

        At most one fallback per public call: a second failed walk raises :class:`SolverError` (the public
        call's transaction restores the state)."""
        try:
            action()
            res = self._repair(self._finalize())
            if res.max <= FALLBACK_TOL:
                return False
            why = f"KKT residual {res.max:.3e} after the active-set walk"
        except (_WalkFailed, np.linalg.LinAlgError) as exc:
            why = f"active-set walk failed ({exc})"
        if self._call_fallback:
            raise SolverError(f"IncrementalSVDD: {why}, after a from-scratch solve earlier in the same call; "
                              "no chain of fallbacks: the solver was restored to its state before the call")
        self._call_fallback = True
        self._fallbacks += 1
        self._guards["fallback_from_scratch"] += 1
        warnings.warn(f"IncrementalSVDD: {why}; replaced by a verified from-scratch solve (reported in the "
                      "receipt)", RuntimeWarning, stacklevel=5)
        on_fail()
        self._from_scratch()
        return True

    # ------------------------------------------------------------------ admission / deletion
    def _admit(self, x: np.ndarray, ident: int) -> bool:
        slot = self._append_slot(x, ident)
        if not self._solved:
            if feasible(self._n, self.C):
                return self._from_scratch(first=True) != "walks"
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
        if self._solved and self._alpha[slot] > 0.0:
            self._absorb_into_twins(slot)
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

    def _absorb_into_twins(self, c: int) -> None:
        """Exact tie rule for deletion: bitwise-equal keys of c (identical Gram rows, one feature-space
        point) take over ``alpha_c`` where their box allows, with no walk and no change of the solution.

        - c in E with a reserve twin r: r goes to E (``alpha_r = C``), c to R (``g = 0`` for both at an
          optimum, so both bounds are KKT points).
        - c in E with a margin twin m (no reserve twin): m goes to E, c takes m's mass and m's place in S.
        - c in S with a reserve twin r: r takes c's mass and c's place in S (the rows of R are unchanged).
        Whatever c still holds afterwards is removed by the deletion walk.
        """
        n = self._n
        cand = np.flatnonzero(self._K[c, :n] == 1.0)  # a twin's kernel is exactly 1 (cheap prefilter)
        if cand.size <= 1:
            return
        twins = cand[(cand != c) & (self._X[cand] == self._X[c]).all(axis=1)]
        if twins.size == 0:
            return
        st, alpha, g, C = self._status, self._alpha, self._g, self.C
        reserve = [int(k) for k in twins if st[k] == RESERVE and alpha[k] == 0.0]
        margin = [int(k) for k in twins if st[k] == MARGIN]
        if st[c] == ERROR:
            if reserve:
                r = reserve.pop()
                alpha[r], st[r], g[r] = C, ERROR, g[c]
                alpha[c], st[c] = 0.0, RESERVE
                self._guards["twin_absorbed"] += 1
                return
            if not margin:
                return
            m = margin[0]
            self._S[self._S.index(m)] = c
            alpha[c], st[c], g[c] = alpha[m], MARGIN, 0.0
            alpha[m], st[m] = C, ERROR
            self._guards["twin_swap"] += 1
        if st[c] == MARGIN and reserve:
            r = reserve.pop()
            self._S[self._S.index(c)] = r
            alpha[r], st[r], g[r] = alpha[c], MARGIN, 0.0
            alpha[c], st[c] = 0.0, RESERVE
            self._guards["twin_absorbed"] += 1

    def _recheck_evicted(self) -> tuple[tuple[int, ...], bool]:
        """Re-admit evicted keys whose g < 0 under the current solution. Returns (ids, fallback).

        A NaN gradient is never read as a violation to fix (re-admitting would not cure it); the
        certificate reports it (a NaN residual is never certified)."""
        readmitted: list[int] = []
        fallback = False
        while self._evicted and self._solved:
            ge = self._evicted_g()
            ge = np.where(np.isnan(ge), np.inf, ge)
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

