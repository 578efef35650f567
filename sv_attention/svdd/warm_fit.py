"""Warm-started SVDD fits: the partition at a chunk boundary found from the solution at an earlier one.

The chunk-frozen gate (DESIGN §2.5) solves the SVDD problem of the keys ``[0, s)`` at every boundary
``s``. The problem at ``s`` is the one at an earlier boundary ``s' < s`` plus the keys ``[s', s)``, so
its partition (margin ``S``: ``0 < alpha < C``, error ``E``: ``alpha = C``, reserve ``R``: ``alpha = 0``)
is usually a few moves away from the earlier one. Starting the primal-dual active-set iteration
(:func:`active_set_fit`: one exact bordered solve on the margin block plus one pass over the margin rows
of ``K`` per step; the move rule of :func:`sv_attention.svdd.polish.active_set_polish`) from the earlier
partition, with the new keys in ``R``, settles a chunk of new keys in a few steps (2-4 on well-spread keys,
up to a few dozen on the flat Grams of nearly collinear keys); no FISTA finder runs. Moving every violator
at once can cycle on flat Grams; the iteration is safeguarded by block principal pivoting (see
:func:`active_set_fit`).

A partition is accepted only when it is a KKT point of the new problem within the polish tolerance
(``converged`` and violation ``<= 10 tol``, the criterion of :func:`sv_attention.svdd.batched.solve_batched`'s
``"ok"`` status). Problems that do not settle within the step budget are *not*
returned from an unconverged iterate but handed to a fallback chosen by the caller and counted
(:func:`fit_warm`: a warm-started full solve on a dense Gram, the working-set fit
:func:`fit_working_set` on Gram rows computed on demand, the cold solve for a cold start).

Callers:

* :mod:`sv_attention.ops.sv_gate.fit` (every door into the SV gate: plug-in, model, training module):
  :func:`fit_warm` returns the exact optimum of the found partition
  (:func:`~sv_attention.svdd.polish.polish_ridge`); a trainable gate re-solves that partition on a Gram
  with the keys' autograd graph, so gate and gradients do not depend on how the partition was found.

Counters: the functions take ``count(key, n)``, a callback that receives every event (``pdas_problems``,
``warm_pdas_fallback``, ``working_set_grown``, ``working_set_full`` and the caller's ``stat``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: Primal-dual active-set steps of a warm fit before unsettled problems go to the fallback (the torch loop).
WARM_PDAS_STEPS = 64
#: The same budget when the C kernel runs the steps (:mod:`sv_attention.svdd.active_set_native`): a step costs
#: microseconds there, so the slow tail of single pivots on flat Grams (up to ~100 steps at the published
#: shape at initialisation) finishes instead of paying for a full solve.
NATIVE_PDAS_STEPS = 256
#: Block-pivoting steps a problem may take after its number of KKT violators last reached a new minimum
#: before :func:`active_set_fit` falls back to single principal pivots (the anti-cycling safeguard).
PIVOT_BACKUP = 3
#: Rounds of the working-set fit (solve on a subset, add the keys that violate the KKT conditions).
WS_ROUNDS = 4
#: A key outside the working set violates the KKT conditions when ``K_jj - 2 (K alpha)_j > rho + WS_TOL``.
WS_TOL = 1e-6
#: Acceptance of a partition: KKT violation at most this many times the polish tolerance.
SETTLED_FACTOR = 10.0

#: ``count(key, n)``: receives the events of a fit (see the module docstring).
Counter = Callable[[str, int], None]
#: ``solve(gram [G, m, m], mask [G, m], C, init [G, m] or None)`` -> a ``BatchedSolution``-like object
#: with ``alpha`` and ``rho`` (the caller's counting wrapper of :func:`solve_batched`).
Solver = Callable[..., Any]


def _no_count(key: str, n: int = 1) -> None:
    return None


def polish_tol(dtype: torch.dtype) -> float:
    """Tolerance of the active-set move rules, ``64 * finfo(dtype).eps`` (as :func:`solve_batched`)."""
    return 64.0 * torch.finfo(dtype).eps


def partition_from_alpha(alpha: torch.Tensor, C: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Partition read off a gate ``alpha [G, n]``: margin ``0 < alpha < C``, error ``alpha >= C (1 - 1e-6)``.

    Returns
    -------
    (margin, error) : bool Tensors ``[G, n]`` (every other key is reserve)
    """
    error = alpha >= C * (1.0 - 1e-6)
    return (alpha > 0) & ~error, error


@dataclass
class ActiveSetFit:
    """Result of :func:`active_set_fit` (all tensors batched over problems).

    Attributes
    ----------
    alpha : Tensor ``[G, n]``  exact solution of the final partition (margin values, C on E, 0 elsewhere)
    rho : Tensor ``[G]``
    margin, error : bool Tensor ``[G, n]``  the final partition (the one ``alpha`` solves)
    settled : bool Tensor ``[G]``  no key violates the KKT conditions by more than ``tol`` (the move
        rules found nothing to move), the margin set is not empty and the solve was regular
    violation : Tensor ``[G]``  largest KKT violation of ``alpha`` (:func:`~sv_attention.svdd.polish.kkt_violation`)
    steps : int  bordered solves run (the most any problem ran)
    engine : str  ``"native"`` (the C kernel of :mod:`sv_attention.svdd.active_set_native`) or ``"torch"``
    """

    alpha: torch.Tensor
    rho: torch.Tensor
    margin: torch.Tensor
    error: torch.Tensor
    settled: torch.Tensor
    violation: torch.Tensor
    steps: int
    engine: str = "torch"


#: A Gram the fits can read: a dense Tensor ``[G, n, n]`` or a lazy row provider
#: (:class:`sv_attention.svdd.gram_rows.LazyPrefix`: ``shape``, ``dtype``, ``device``, ``diagonal()``,
#: ``rows(index)``, ``dense(problems)``).
GramLike = Any


def _diagonal(gram: GramLike) -> torch.Tensor:
    return torch.diagonal(gram, dim1=-2, dim2=-1) if isinstance(gram, torch.Tensor) else gram.diagonal()


def _dense(gram: GramLike, problems: torch.Tensor) -> torch.Tensor:
    return gram[problems] if isinstance(gram, torch.Tensor) else gram.dense(problems)


@dataclass
class _FitRecord:
    """The per-problem results of :func:`active_set_fit`, written as problems leave the iteration."""

    alpha: torch.Tensor
    g: torch.Tensor
    rho: torch.Tensor
    margin: torch.Tensor
    error: torch.Tensor
    settled: torch.Tensor

    @classmethod
    def empty(cls, G: int, n: int, dtype: torch.dtype, margin: torch.Tensor, error: torch.Tensor) -> _FitRecord:
        z = torch.zeros(G, n, dtype=dtype, device=margin.device)
        return cls(alpha=z, g=z.clone(), rho=z[:, 0].clone(), margin=margin.clone(), error=error.clone(),
                   settled=torch.zeros(G, dtype=torch.bool, device=margin.device))

    def write(self, ids: torch.Tensor, alpha: torch.Tensor, g: torch.Tensor, rho: torch.Tensor,
              margin: torch.Tensor, error: torch.Tensor, settled: torch.Tensor) -> None:
        self.alpha[ids], self.g[ids], self.rho[ids] = alpha, g, rho
        self.margin[ids], self.error[ids], self.settled[ids] = margin, error, settled


def active_set_fit(gram: torch.Tensor, mask: torch.Tensor, margin: torch.Tensor, error: torch.Tensor, C: float,
                   steps: int, tol: float, ridge: float, start_alpha: torch.Tensor | None = None,
                   engine: str = "auto") -> ActiveSetFit:
    """Primal-dual active-set iteration from a starting partition, lean (no autograd), safeguarded.

    Each step solves every problem's bordered KKT system for its partition (compacted margin block, ridge
    ``ridge`` on its diagonal; :mod:`sv_attention.svdd.polish` documents the system) through a Cholesky
    factor of ``2 K_SS + ridge I`` (a factor that fails marks the problem unsettled), computes the KKT
    gradient ``g = rho - K_ii + 2 (K alpha)_i`` from the gathered margin rows, and moves the violators
    (margin keys with ``alpha < -tol C`` to R and ``alpha > C (1 + tol)`` to E, reserve keys with
    ``g < -tol`` and error keys with ``g > tol`` to S). It stops when nothing moves; the last solve is
    then the exact optimum of the final partition, so no further solve is needed.

    Moving every violator at once (the primal-dual rule) can cycle when ``K`` is far from an M-matrix
    (flat Grams: a large bandwidth). The safeguard is the block principal pivoting rule of Judice & Pires
    (as in Kim & Park's NNLS): a problem moves all its violators while their number keeps reaching a new
    minimum, and for :data:`PIVOT_BACKUP` more steps after it last did; then it moves only its largest
    violator (a single principal pivot, Murty's safeguard with the largest violation instead of the
    highest index: fewer steps on the Grams of the bench) until the count drops again. Problems that stop moving leave the batch (the remaining ones are compacted once at most half
    of them are still moving), so the last steps cost only what the slowest problems need.

    Parameters
    ----------
    gram : Tensor ``[G, n, n]`` (no autograd; entries of masked keys are ignored), or a lazy row provider
        (:class:`sv_attention.svdd.gram_rows.LazyPrefix`): only the margin and error rows are read
    mask : bool Tensor ``[G, n]``  valid keys
    margin, error : bool Tensor ``[G, n]``  starting partition
    C : float  box
    steps : int  maximum number of moves (solves = moves + 1)
    tol : float  move tolerance
    ridge : float  added to the diagonal of ``2 K_SS``
    start_alpha : Tensor ``[G, n]`` or None
        The exact solution of the starting partition when the caller has it (the previous boundary's gate,
        zero on the new keys: the same bordered system, since the Grams agree on the old keys). The first
        step then reads its gradient off it instead of solving (``rho`` = the mean of
        ``K_ii - 2 (K alpha)_i - ridge alpha_i`` over the margin keys), after checking that it is that
        solution (these values agree on the margin keys and ``sum alpha = 1``, within
        ``10 tol sqrt(n)``); otherwise the first step solves as usual.
    engine : ``"auto"`` (default), ``"native"`` or ``"torch"``
        ``"auto"`` runs the C kernel (:mod:`sv_attention.svdd.active_set_native`: the same steps, per problem,
        in float64) on a dense CPU Gram when it is available, else this function's torch loop (the
        reference); ``"native"`` requires the kernel (``RuntimeError`` where it cannot run).

    Returns
    -------
    ActiveSetFit
    """
    from sv_attention.svdd.polish import gram_rows_of, kkt_violation

    G, n, _ = gram.shape
    dt, dev = gram.dtype, gram.device
    if G == 0:
        empty = torch.zeros(0, n, dtype=dt, device=dev)
        none = torch.zeros(0, dtype=torch.bool, device=dev)
        return ActiveSetFit(alpha=empty, rho=empty[:, 0], margin=margin, error=error, settled=none,
                            violation=empty[:, 0], steps=0)
    lib = _native_kernel(gram, engine)
    if lib is not None:
        from sv_attention.svdd.active_set_native import run_active_set

        r = run_active_set(lib, gram, mask, margin & mask, error & mask, C, steps, tol, ridge, SETTLED_FACTOR,
                           PIVOT_BACKUP, start_alpha)
        alpha, g = r["alpha"].to(dt), r["g"].to(dt)
        violation = kkt_violation(alpha, g, mask, r["margin"], r["error"],
                                  torch.full((G,), float(C), dtype=dt, device=dev))
        return ActiveSetFit(alpha=alpha, rho=r["rho"].to(dt), margin=r["margin"], error=r["error"],
                            settled=r["settled"], violation=violation, steps=int(r["solves"].max()), engine="native")
    margin, error = margin & mask, error & mask
    out = _FitRecord.empty(G, n, dt, margin, error)
    # the problems still iterating (global ids) and their data
    ids = torch.arange(G, device=dev)
    cmask, diag = mask, _diagonal(gram)
    compacted = False  # True once ids is a strict subset: rows are then read for those problems only
    start = start_alpha
    best = torch.full((G,), n + 1, dtype=torch.long, device=dev)  # fewest violators seen
    backup = torch.full((G,), PIVOT_BACKUP, dtype=torch.long, device=dev)
    positions = torch.arange(n, device=dev)
    run = solves = 0
    while True:
        Gc = ids.shape[0]
        # the rows of K for the margin keys (slots [0, |S|)) and then the error keys (next |E| slots), one gather
        ns, ne = margin.sum(-1), error.sum(-1)
        w = max(int((ns + ne).max()), 1)
        m = max(int(ns.max()), 1)
        rank = torch.where(margin, 0, torch.where(error, 1, 2)).to(torch.int8)
        order = torch.argsort(rank, dim=-1, stable=True)[:, :w]
        slot = torch.arange(w, device=dev)[None, :]
        s_slot, e_slot = slot < ns[:, None], (slot >= ns[:, None]) & (slot < (ns + ne)[:, None])
        rows = gram_rows_of(gram, order, ids if compacted else None, checked=False)  # [Gc, w, n] (order: a sort)
        order_s, vcf = order[:, :m], s_slot[:, :m].to(dt)
        sub = rows.gather(2, order_s[:, None, :].expand(Gc, w, m))  # K between every support slot and S: [Gc, w, m]
        e_f = e_slot.to(dt)
        k_e_s = (e_f[:, None, :] @ sub)[:, 0]  # (K 1_E) on the margin keys, [Gc, m]
        known = False
        if run == 0 and start is not None:  # the starting partition's solution may be known: no solve
            alpha_c = start.to(dt).gather(1, order_s) * vcf
            coef = torch.nn.functional.pad(alpha_c, (0, w - m)) + C * e_f
            h = diag - 2.0 * (coef[:, None, :] @ rows)[:, 0]
            # at the solution, h_i - ridge alpha_i = rho on every margin key and sum alpha = 1: verify both
            # (a start that is not the exact solution of its partition is solved like any other)
            r = (h.gather(1, order_s) - ridge * alpha_c) * vcf
            rho = r.sum(-1) / ns.clamp_min(1).to(dt)
            spread = ((r - rho[:, None]) * vcf).abs().amax(-1)
            mass = (alpha_c.sum(-1) + C * ne.to(dt) - 1.0).abs()
            bound = SETTLED_FACTOR * tol * max(1.0, float(n) ** 0.5)
            known = bool(((spread <= bound) & (mass <= bound) & (ns > 0)).all())
            if known:
                finite, info = torch.isfinite(rho) & torch.isfinite(alpha_c).all(-1), torch.zeros_like(ns)
                g = rho[:, None] - h
        if not known:
            # Bordered system [[0, 1^T], [1, M]] [rho; a] = [b0; h_S] with M = 2 K_SS + ridge I (SPD, identity
            # rows on unused slots): a = M^-1 (h_S - rho 1), rho = (1^T M^-1 h_S - b0) / (1^T M^-1 1); one
            # Cholesky factor, two right-hand sides (half the work of an LU of the bordered matrix).
            M = torch.mul(sub[:, :m], 2.0 * vcf[:, :, None] * vcf[:, None, :])
            M.diagonal(dim1=-2, dim2=-1).add_(1.0 - vcf + ridge * vcf)
            L, info = torch.linalg.cholesky_ex(M)
            hs = (diag.gather(1, order_s) - 2.0 * C * k_e_s) * vcf
            z = torch.cholesky_solve(torch.stack([hs, vcf], dim=-1), L)  # [Gc, m, 2]: M^-1 h_S, M^-1 1
            b0 = 1.0 - C * ne.to(dt)
            rho = ((vcf * z[..., 0]).sum(-1) - b0) / (vcf * z[..., 1]).sum(-1)
            solves += 1
            alpha_c = (z[..., 0] - rho[:, None] * z[..., 1]) * vcf
            finite = torch.isfinite(rho) & torch.isfinite(alpha_c).all(-1)
            coef = torch.nn.functional.pad(alpha_c, (0, w - m)) + C * e_f
            g = rho[:, None] - diag + 2.0 * (coef[:, None, :] @ rows)[:, 0]  # K alpha = K_S alpha_S + C K 1_E
        a_margin = torch.zeros(Gc, n, dtype=dt, device=dev).scatter_add_(1, order_s, alpha_c)
        # each key's KKT violation in the units of its move rule: alpha / C outside [0, 1] on the margin,
        # g > 0 on E, g < 0 on R; a key violates when its size exceeds tol
        a_rel = a_margin / C
        size = torch.where(margin, torch.maximum(-a_rel, a_rel - 1.0), torch.where(error, g, -g))
        violators = (size > tol) & cmask
        n_viol = violators.sum(-1)
        finished = n_viol == 0
        settled = finished & (ns > 0) & (info == 0) & finite
        if run >= steps or bool(finished.all()):
            out.write(ids, a_margin + C * error.to(dt), g, rho, margin, error, settled)
            break
        # block principal pivoting: all violators while their count reaches a new minimum (or backups are
        # left), else only the largest one
        improved = n_viol < best
        block = improved | (backup > 0)
        backup = torch.where(improved, torch.full_like(backup, PIVOT_BACKUP), backup - (~improved).long()).clamp_min(0)
        best = torch.minimum(best, n_viol)
        move = violators & (block[:, None] | (positions == size.masked_fill(~cmask, -1.0).argmax(-1, keepdim=True)))
        # margin keys leave (to E above C, to R below 0), reserve and error keys join the margin
        error = (error & ~move) | (move & margin & (a_rel > 1.0))
        margin = margin ^ move
        run += 1
        if isinstance(gram, torch.Tensor) and 2 * int((~finished).sum()) <= Gc:
            # compact (a dense Gram; no copy of it: rows are read for the remaining problems by index): the
            # finished problems (nothing moved: their partition and solution are final) are recorded and leave;
            # only the problems still moving iterate. A lazy row provider keeps its batch (a finished problem
            # re-solves its unchanged partition to the same result).
            done, keep = finished.nonzero().flatten(), (~finished).nonzero().flatten()
            out.write(ids[done], (a_margin + C * error.to(dt))[done], g[done], rho[done], margin[done], error[done],
                      settled[done])
            ids, margin, error, best, backup = ids[keep], margin[keep], error[keep], best[keep], backup[keep]
            cmask, diag, compacted = cmask[keep], diag[keep], True
            start = None
    violation = kkt_violation(out.alpha, out.g, mask, out.margin, out.error,
                              torch.full((G,), float(C), dtype=dt, device=dev))
    return ActiveSetFit(alpha=out.alpha, rho=out.rho, margin=out.margin, error=out.error, settled=out.settled,
                        violation=violation, steps=solves)


def _native_kernel(gram: GramLike, engine: str) -> Any:
    """The C kernel for :func:`active_set_fit` under ``engine``, or None for the torch loop."""
    if engine not in ("auto", "native", "torch"):
        raise ValueError(f"active_set_fit: engine must be 'auto', 'native' or 'torch', got {engine!r}")
    if engine == "torch":
        return None
    from sv_attention.svdd.active_set_native import kernel, supports

    if not supports(gram):
        if engine == "native":
            raise RuntimeError("active_set_fit: the native kernel needs a dense CPU float32/float64 Gram "
                               "without autograd")
        return None
    lib = kernel()
    if lib is None and engine == "native":
        from sv_attention.svdd.native_build import unavailable_reason

        raise RuntimeError(f"active_set_fit: the native kernel is not available ({unavailable_reason('sv_active_set')})")
    return lib


def fit_working_set(gram: torch.Tensor, init: torch.Tensor, C: float, new: int, *, solve: Solver,
                    count: Counter = _no_count) -> torch.Tensor:
    """Warm fit of full problems ``gram [G, n, n]`` on a working set of keys (all keys valid; no autograd).

    The working set starts as the support of ``init [G, n]`` (the previous boundary's gate, zero on the
    ``new`` last keys) plus the ``new`` keys; the problem restricted to it is solved by ``solve``
    (warm-started), then every key outside it is checked against the KKT condition of a reserve key
    (``K_jj - 2 (K alpha)_j <= rho``); violators join the set and the solve repeats (counted as
    ``working_set_grown``). The restricted optimum that passes the check is the optimum of the full
    problem (a convex QP), so this equals a full solve, at the cost of a few small solves plus one
    ``n x |W|`` product per round. After :data:`WS_ROUNDS` rounds the full problem is solved instead
    (counted as ``working_set_full``).

    Returns
    -------
    Tensor ``[G, n]``  alpha (``>= 0``)
    """
    from sv_attention.svdd.polish import gather_rows, pack_members

    G, n, _ = gram.shape
    dev = gram.device
    inw = init > 0
    inw[:, n - new:] = True
    diag = torch.diagonal(gram, dim1=-2, dim2=-1)
    for _ in range(WS_ROUNDS):
        order, wmask, _ = pack_members(inw)  # set members, increasing
        m = order.shape[1]
        order = torch.where(wmask, order, torch.zeros_like(order))
        rows = gather_rows(gram, order)  # [G, m, n]
        sub = rows.gather(2, order[:, None, :].expand(G, m, m))
        sol = solve(sub, wmask, C, init=torch.where(wmask, init.gather(1, order), torch.zeros_like(sub[:, 0])))
        aw = torch.where(wmask, sol.alpha.clamp_min(0.0), torch.zeros_like(sub[:, 0]))
        h = diag - 2.0 * (aw[:, None, :] @ rows)[:, 0]  # [G, n]
        viol = ~inw & (h > sol.rho.detach()[:, None] + WS_TOL)
        if not bool(viol.any()):
            return torch.zeros(G, n, dtype=gram.dtype, device=dev).scatter_add(1, order, aw)
        count("working_set_grown", int(viol.any(-1).sum()))
        inw = inw | viol
    count("working_set_full", G)
    return solve(gram, torch.ones(G, n, dtype=torch.bool, device=dev), C, init=init).alpha.clamp_min(0.0)


def refit_unsettled(gram: GramLike, alpha: torch.Tensor, init: torch.Tensor, unsettled: torch.Tensor, C: float,
                    new: int, *, solve: Solver, count: Counter = _no_count) -> torch.Tensor:
    """``alpha [G, n]`` with the problems of ``unsettled`` (bool ``[G]``) refitted by the fallbacks of
    :func:`fit_warm` (see there; counted as ``warm_pdas_fallback`` and by route), warm from ``init [G, n]``
    (the previous boundary's gate, zero on the ``new`` last keys) when ``new > 0``."""
    G, n, _ = gram.shape
    bad = unsettled.nonzero().flatten()
    count("warm_pdas_fallback", len(bad))
    g_bad = _dense(gram, bad)  # the fallbacks solve the full problem
    all_keys = torch.ones(len(bad), n, dtype=torch.bool, device=gram.device)
    if new > 0 and isinstance(gram, torch.Tensor):
        # a dense Gram (training, prefill): one warm-started full solve (finder from the previous gate,
        # then the polish) costs less than the working-set rounds and needs no extra Gram rows
        count("warm_full_fallback", len(bad))
        refit = solve(g_bad, all_keys, C, init=init[bad]).alpha.clamp_min(0.0)
    elif new > 0:  # Gram rows on demand (decoding, long contexts): solve on a working set of keys
        refit = fit_working_set(g_bad, init[bad], C, new, solve=solve, count=count)
        invalid = ((refit.sum(-1) - 1.0).abs() > 1e-4) | (refit.amax(-1) > C * (1.0 + 1e-4))
        if bool(invalid.any()):
            worse = invalid.nonzero().flatten()
            count("warm_fallback_cold", len(worse))
            cold = solve(g_bad[worse], all_keys[worse], C, init=None).alpha.clamp_min(0.0)
            refit = refit.index_copy(0, worse, cold)
    else:
        refit = solve(g_bad, all_keys, C, init=None).alpha.clamp_min(0.0)
    return alpha.index_copy(0, bad, refit.to(alpha.dtype))


def fit_warm(gram: torch.Tensor, init: torch.Tensor, C: float, new: int, *, solve: Solver,
             count: Counter = _no_count, stat: str = "warm_fits") -> torch.Tensor:
    """Warm fit of full problems ``gram [G, n, n]`` (all keys valid; no autograd) from a previous gate.

    The previous boundary's gate ``init [G, n]`` (zero on the ``new`` last keys) gives the starting
    partition (:func:`partition_from_alpha`); :func:`active_set_fit` moves every KKT violator. A problem
    whose partition settled is returned as the exact optimum of that partition (ridge
    :data:`~sv_attention.svdd.polish.POLISH_RIDGE`, the polish's own); problems that did not settle
    within :data:`WARM_PDAS_STEPS` steps (:data:`NATIVE_PDAS_STEPS` on the C kernel), or whose Cholesky
    factor failed, are refitted (counted as ``warm_pdas_fallback``): a warm start (``new > 0``) by :func:`fit_working_set`, a cold start
    (``new == 0``, e.g. uniform ``init``) by the cold ``solve``; a refit that is not a valid gate
    (``sum alpha != 1`` or ``alpha > C`` beyond 1e-4) is replaced by the cold ``solve`` as well (counted
    as ``warm_fallback_cold``), so the result never depends on an unconverged warm iterate. ``stat``
    names the counter of this call; ``pdas_problems`` counts the problems.

    Returns
    -------
    Tensor ``[G, n]``  alpha (``>= 0``)
    """
    from sv_attention.svdd.polish import polish_ridge

    G, n, _ = gram.shape
    mask = torch.ones(G, n, dtype=torch.bool, device=gram.device)
    margin, error = partition_from_alpha(init, C)
    tol = polish_tol(gram.dtype)
    budget = NATIVE_PDAS_STEPS if _native_kernel(gram, "auto") is not None else WARM_PDAS_STEPS
    # a warm start (new > 0) is the previous boundary's exact solution: its first step needs no solve
    with torch.profiler.record_function("sv.active_set"):
        fit = active_set_fit(gram, mask, margin, error, float(C), budget, tol, polish_ridge(gram.dtype),
                             start_alpha=init if new > 0 else None)
    count(stat, 1)
    count("pdas_problems", G)
    count(f"active_set_{fit.engine}", G)
    alpha = fit.alpha.clamp_min(0.0)
    ok = fit.settled & (fit.violation <= SETTLED_FACTOR * tol)
    if not bool(ok.all()):
        alpha = refit_unsettled(gram, alpha, init, ~ok, C, new, solve=solve, count=count)
    return alpha


def prefix_of(gram: GramLike, s: int) -> GramLike:
    """The Gram of the first ``s`` keys: a view of a dense ``[G, N, N]`` Gram, or the lazy provider's prefix."""
    return gram[:, :s, :s] if isinstance(gram, torch.Tensor) else gram.parent.prefix(s)


def _problems_of(gram: GramLike, problems: torch.Tensor) -> GramLike:
    """The Gram of some problems only (a lazy provider: a new row store over their keys)."""
    if isinstance(gram, torch.Tensor):
        return gram[problems]
    from sv_attention.svdd.gram_rows import LazyRBFGram

    parent = gram.parent
    return LazyRBFGram(parent.keys[problems], parent.sigma[problems]).prefix(gram.s)


def fit_chain(gram: torch.Tensor, bounds: list[int], init: torch.Tensor | None, C: float, *, solve: Solver,
              count: Counter = _no_count) -> list[torch.Tensor] | None:
    """The warm fits of consecutive boundaries in one native call, or None where the C kernel cannot run.

    Boundary ``bounds[b]`` is the problem of the first ``bounds[b]`` keys of ``gram [G, N, N]`` (dense, or a
    :class:`~sv_attention.svdd.gram_rows.LazyPrefix` of ``N`` keys whose rows the kernel computes);
    it starts from the previous boundary's gate (its partition, the new keys in reserve, its solution as the
    known start: what :func:`fit_warm` does boundary by boundary, without a Python round trip per boundary).
    The first boundary starts from ``init [G, p]`` (the gate of ``p < bounds[0]`` keys) or, with ``init``
    None, from every key on the margin (the cold start of :func:`sv_attention.ops.sv_gate.fit.fit_cold`).
    Every boundary's result is accepted on the criterion of :func:`fit_warm` (settled, KKT violation
    ``<= 10 tol``); a problem that fails it at a boundary is refitted there by :func:`refit_unsettled`, and
    the rest of its chain is redone from the refitted gate (as the boundary-by-boundary path would).

    Returns
    -------
    list of Tensor ``[G, bounds[b]]`` (the gram's dtype, ``>= 0``), or None (no native kernel for ``gram``)
    """
    from sv_attention.svdd.active_set_native import run_active_set_chain
    from sv_attention.svdd.polish import kkt_violation, polish_ridge

    lib = _native_kernel(gram, "auto")
    if lib is None:
        return None
    G, N, _ = gram.shape
    B, dt, dev = len(bounds), gram.dtype, gram.device
    tol = polish_tol(dt)
    if init is None:
        start = None
        margin, error = torch.ones(G, N, dtype=torch.bool, device=dev), torch.zeros(G, N, dtype=torch.bool, device=dev)
    else:
        start = torch.nn.functional.pad(init.to(dt), (0, N - init.shape[1]))
        margin, error = partition_from_alpha(start, C)
    with torch.profiler.record_function("sv.active_set"):
        r = run_active_set_chain(lib, gram, list(bounds), margin, error, float(C), NATIVE_PDAS_STEPS, tol,
                                 polish_ridge(dt), SETTLED_FACTOR, PIVOT_BACKUP, start)
    count("chain_fits", 1)
    count("cold_pdas_fits" if init is None else "warm_fits", 1)
    count("warm_fits", B - 1)
    count("pdas_problems", G * B)
    count("active_set_native", G * B)
    alpha, g = r["alpha"].to(dt), r["g"].to(dt)
    valid = (torch.arange(N, device=dev)[None, :] < torch.tensor(bounds, device=dev)[:, None]).expand(G, B, N)
    violation = kkt_violation(alpha.reshape(G * B, N), g.reshape(G * B, N), valid.reshape(G * B, N),
                              r["margin"].reshape(G * B, N), r["error"].reshape(G * B, N),
                              torch.full((G * B,), float(C), dtype=dt, device=dev)).view(G, B)
    ok = r["settled"] & (violation <= SETTLED_FACTOR * tol)
    clamped = alpha.clamp_min(0.0)  # one pass; each boundary's gate is a view
    fitted = [clamped[:, b, :s] for b, s in enumerate(bounds)]
    for b, s in enumerate(bounds):
        if bool(ok[:, b].all()):
            continue
        bad = (~ok[:, b]).nonzero().flatten()
        prev = init if b == 0 else fitted[b - 1]
        new = 0 if prev is None else s - prev.shape[1]
        init_b = fitted[b] if prev is None else torch.nn.functional.pad(prev.to(dt), (0, new))
        fitted[b] = refit_unsettled(prefix_of(gram, s), fitted[b], init_b, ~ok[:, b], C, new, solve=solve,
                                    count=count)
        if b + 1 < len(bounds):
            # the chain went on from the unsettled partition: the rest of it is redone from the refitted gate
            rest = fit_chain(_problems_of(gram, bad), bounds[b + 1:], fitted[b][bad], C, solve=solve, count=count)
            for j, a in enumerate(rest):
                fitted[b + 1 + j] = fitted[b + 1 + j].index_copy(0, bad, a)
            ok[bad, b + 1:] = True
    for b, s in enumerate(bounds):  # refitted gates back into the one [G, B, N] tensor (see stacked_gates)
        if fitted[b]._base is not clamped:
            clamped[:, b, :s] = fitted[b]
            fitted[b] = clamped[:, b, :s]
    return fitted


def stacked_gates(fitted: list[torch.Tensor], N: int) -> torch.Tensor:
    """The gates of a chain, ``fitted[b] [G, s_b]``, as one ``[G, B, N]`` tensor zero past each boundary:
    the tensor :func:`fit_chain`'s gates are views of (no copy), or a padded stack of other gates."""
    base = fitted[0]._base if fitted else None
    B = len(fitted)
    if base is not None and base.dim() == 3 and base.shape[1:] == (B, N) and all(
            a._base is base and a.storage_offset() == base.storage_offset() + b * N and a.stride() == (B * N, 1)
            for b, a in enumerate(fitted)):
        return base
    return torch.stack([torch.nn.functional.pad(a, (0, N - a.shape[1])) for a in fitted], 1)
