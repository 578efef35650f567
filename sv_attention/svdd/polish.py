"""Fixed-partition bordered solves and the batched active-set polish of the batched SVDD path.

Given a partition of every problem's keys into margin ``S``, error ``E`` (alpha = C) and reserve ``R``
(alpha = 0), the SVDD optimum restricted to that partition solves the bordered KKT system (DESIGN §2.2)

    [[0, 1_S^T], [1_S, 2 K_SS + ridge I]] [rho; alpha_S] = [1 - |E| C; diag(K)_S - 2 C K_SE 1].

All problems are solved in one batched ``torch.linalg.solve_ex`` on compacted ``[G, m+1, m+1]`` matrices
(``m = max |S|``, typically far below n: the margin set of an RBF SVDD is small): each problem's margin
keys are gathered to the front and the unused slots are identity rows with a zero right-hand side, so
they neither mix with the margin block nor receive gradient; padded and non-margin keys enter only
through ``K_SE 1`` and ``diag(K)``. The solve is differentiable (autograd goes
through ``solve_ex``); it is guarded: a problem whose LU reports a zero pivot or whose solution is not
finite is re-solved with a larger ridge and counted as a fallback.

:func:`active_set_polish` refines a partition by a primal-dual active-set iteration (move margin points
whose alpha left the box, reserve points with negative and error points with positive KKT gradient),
keeping per problem the partition with the smallest KKT violation seen (anti-cycling by selection: the
iteration can oscillate on clustered keys, the best iterate never gets worse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: Ridge of the fallback re-solve for problems whose guarded solve failed.
FALLBACK_RIDGE = 1e-2
#: Ridge of the polish solves: keeps 2 K_SS non-singular when duplicate keys sit in S together (they then
#: split their mass equally, one of the optima) at a KKT error of ~1e-6 * alpha on S.
POLISH_RIDGE = 1e-6
#: The same ridge for float64 problems: fp64 keeps duplicates solvable with a far smaller one, so the gate is
#: the partition's optimum to ~1e-10 * alpha even where near-duplicate keys make 2 K_SS ill-conditioned.
POLISH_RIDGE_FP64 = 1e-10


def polish_ridge(dtype: torch.dtype) -> float:
    """The polish ridge for problems of ``dtype`` (:data:`POLISH_RIDGE`, or :data:`POLISH_RIDGE_FP64`)."""
    return POLISH_RIDGE_FP64 if dtype == torch.float64 else POLISH_RIDGE


@dataclass
class FixedPartitionSolve:
    """Result of :func:`fixed_partition_solve` (all tensors batched over problems).

    Attributes
    ----------
    alpha : Tensor ``[G, n]``  (alpha_S from the solve, C on E, 0 elsewhere)
    rho : Tensor ``[G]``
    ok : bool Tensor ``[G]``  False where the guarded solve failed and the fallback ridge was used
    empty : bool Tensor ``[G]``  True where the margin set is empty (rho then from the KKT interval)
    k_alpha : Tensor ``[G, n]``  ``K @ alpha`` (from the gathered margin rows, no extra pass over K)
    """

    alpha: torch.Tensor
    rho: torch.Tensor
    ok: torch.Tensor
    empty: torch.Tensor
    k_alpha: torch.Tensor

    def gradient(self, gram: torch.Tensor) -> torch.Tensor:
        """KKT gradient ``g = rho - diag(K) + 2 K alpha``, ``[G, n]``."""
        return self.rho[:, None] - torch.diagonal(gram, dim1=-2, dim2=-1) + 2.0 * self.k_alpha


def kkt_gradient(gram: torch.Tensor, alpha: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """KKT gradient ``g_i = rho - K_ii + 2 (K alpha)_i`` for every problem, ``[G, n]``."""
    diag = torch.diagonal(gram, dim1=-2, dim2=-1)
    return rho[:, None] - diag + 2.0 * (gram @ alpha[..., None])[..., 0]


def _c_column(C: torch.Tensor) -> torch.Tensor:
    return C[:, None]


def gather_rows(mat: torch.Tensor, index: torch.Tensor, problems: torch.Tensor | None = None, *,
                checked: bool = True) -> torch.Tensor:
    """Rows ``mat[g, index[g, i], :]`` of a batch of matrices: ``mat [G, r, c]``, ``index [G, m]`` -> ``[G, m, c]``
    (with ``problems`` (long ``[G']``): rows ``mat[problems[k], index[k, i], :]``, ``index [G', m]`` -> ``[G', m, c]``,
    without copying the selected matrices first). ``checked=False`` skips the range check of ``index`` (two
    reductions and host reads; for callers whose indices come from a sort of ``range(r)``).

    Equal to ``mat.gather(1, index[..., None].expand(G, m, c))``. Without autograd, when the rows of all
    problems lie on one row grid of the storage (contiguous batches, and slices ``full[..., :s, :s]`` of a
    larger Gram), the rows are copied by one ``index_select`` on that grid, several times faster than
    ``gather`` (the active-set polish copies the margin rows of ``K`` at every step).
    """
    G, r, c = mat.shape
    Gi, m = index.shape
    sG, sR, sC = mat.stride()
    differentiable = torch.is_grad_enabled() and mat.requires_grad
    if not differentiable and G > 0 and Gi > 0 and m > 0 and sC == 1 and sR >= c and sG > 0 and sG % sR == 0:
        if checked:
            lo, hi = int(index.min()), int(index.max())
            if lo < 0 or hi >= r:  # the grid would read another problem's row: refuse like gather does
                raise IndexError(f"gather_rows: row index {lo if lo < 0 else hi} out of range for {r} rows")
        per = sG // sR  # rows of the grid between two problems
        grid = mat.as_strided(((G - 1) * per + r, c), (sR, 1))
        owner = torch.arange(G, device=mat.device) if problems is None else problems
        flat = (index + owner[:, None] * per).reshape(-1)
        return grid.index_select(0, flat).view(Gi, m, c)
    sel = mat if problems is None else mat[problems]
    return sel.gather(1, index[:, :, None].expand(Gi, m, c))


def pack_members(members: torch.Tensor, min_width: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's True positions, increasing, packed to the front of ``[G, m]`` (``m`` = the largest count,
    at least ``min_width``).

    Returns
    -------
    order : long ``[G, m]``  member indices first (slots past a row's count hold non-members)
    used : bool ``[G, m]``  True on the slots that hold a member
    count : long ``[G]``  members per row
    """
    count = members.sum(-1)
    m = max(int(count.max()) if members.shape[0] else 0, min_width)
    order = torch.argsort((~members).to(torch.int8), dim=-1, stable=True)[:, :m]
    used = torch.arange(m, device=members.device)[None, :] < count[:, None]
    return order, used, count


def gram_rows_of(gram: Any, index: torch.Tensor, problems: torch.Tensor | None = None, *,
                 checked: bool = True) -> torch.Tensor:
    """Rows ``K[g, index[g, i], :]`` of a dense Gram (:func:`gather_rows`, of the ``problems`` when given) or
    of a lazy row provider with a ``rows(index)`` method (:class:`sv_attention.svdd.gram_rows.LazyPrefix`;
    all problems)."""
    if isinstance(gram, torch.Tensor):
        return gather_rows(gram, index, problems, checked=checked)
    if problems is not None:
        raise ValueError("a lazy Gram provider reads the rows of all its problems")
    return gram.rows(index)


def _gram_times_indicator(gram: Any, subset: torch.Tensor, subset_f: torch.Tensor) -> torch.Tensor:
    """``K 1_E`` ``[G, n]`` for a key subset ``E`` (bool ``[G, n]``; ``subset_f`` the same as 0/1 floats).

    A small subset (the usual error set) is summed from its gathered rows (``K`` is symmetric, so
    ``K 1_E = sum_{j in E} K[j, :]``), which reads ``|E| n`` entries instead of the whole ``[n, n]`` block
    (the polish calls this once per step); an empty one costs nothing; a large one is the plain product
    for a dense Gram (a lazy row provider always sums rows).
    """
    G, n, _ = gram.shape
    ne = int(subset.sum(-1).max()) if G > 0 else 0
    if ne == 0:
        return torch.zeros_like(subset_f)
    if 4 * ne > n and isinstance(gram, torch.Tensor):
        return (gram @ subset_f[..., None])[..., 0]
    order, used, _ = pack_members(subset)
    return (used.to(subset_f.dtype)[:, None, :] @ gram_rows_of(gram, order))[:, 0]


def _bordered_system(gram: torch.Tensor, margin: torch.Tensor, error: torch.Tensor, C: torch.Tensor,
                     ridge: float | torch.Tensor,
                     ) -> tuple[torch.Tensor, ...]:
    """Build the compacted bordered system (differentiable in gram and C).

    The margin keys of each problem are gathered to the front (``order [G, m]``, ``m = max |S|``); slots
    beyond a problem's ``|S|`` are identity rows with a zero right-hand side.

    Returns
    -------
    A ``[G, m+1, m+1]``, b ``[G, m+1]``, empty ``[G]`` bool, order ``[G, m]`` long, vcf ``[G, m]`` (1.0 on
    used slots), rows ``[G, m, n]`` (the gathered margin rows of K), kef ``[G, n]`` (``K 1_E``).
    """
    G, n, _ = gram.shape
    dt = gram.dtype
    order, used, ns = pack_members(margin)
    m = order.shape[1]
    vcf = used.to(dt)
    rows = gather_rows(gram, order)
    Kc = rows.gather(2, order[:, None, :].expand(G, m, m))
    ridge_t = ridge if isinstance(ridge, torch.Tensor) else torch.as_tensor(ridge, dtype=dt, device=gram.device)
    empty = ns == 0
    if torch.is_grad_enabled() and (gram.requires_grad or C.requires_grad or ridge_t.requires_grad):
        eye = torch.eye(m, dtype=dt, device=gram.device)
        r3 = ridge_t[:, None, None] if ridge_t.dim() == 1 else ridge_t
        block = 2.0 * Kc * (vcf[:, :, None] * vcf[:, None, :]) + eye * (1.0 - vcf)[:, None, :] \
            + eye * (r3 * vcf[:, None, :])
        corner = empty.to(dt)[:, None, None]  # 1 where S is empty so the system stays non-singular
        top = torch.cat([corner, vcf[:, None, :]], dim=2)
        rest = torch.cat([vcf[:, :, None], block], dim=2)
        A = torch.cat([top, rest], dim=1)
    else:
        # Same matrix with fewer passes over [G, m, m] (no autograd needed: polish steps).
        A = gram.new_zeros(G, m + 1, m + 1)
        blk = A[:, 1:, 1:]
        blk.copy_(Kc).mul_(2.0 * (vcf[:, :, None] * vcf[:, None, :]))
        r2 = ridge_t[:, None] if ridge_t.dim() == 1 else ridge_t
        blk.diagonal(dim1=-2, dim2=-1).add_((1.0 - vcf) + r2 * vcf)
        A[:, 0, 1:] = vcf
        A[:, 1:, 0] = vcf
        A[:, 0, 0] = empty.to(dt)
    ef = error.to(dt)
    diag = torch.diagonal(gram, dim1=-2, dim2=-1)
    kef = _gram_times_indicator(gram, error, ef)
    h = diag - 2.0 * _c_column(C) * kef
    b0 = 1.0 - C * ef.sum(-1)
    b = torch.cat([b0[:, None], h.gather(1, order) * vcf], dim=1)
    return A, b, empty, order, vcf, rows, kef


def _rho_interval_midpoint(gram: torch.Tensor, alpha: torch.Tensor, mask: torch.Tensor,
                           error: torch.Tensor) -> torch.Tensor:
    """For an empty margin set: rho in [max_R h_i, min_E h_i] with h = K_ii - 2 (K alpha)_i; midpoint."""
    diag = torch.diagonal(gram, dim1=-2, dim2=-1)
    h = diag - 2.0 * (gram @ alpha[..., None])[..., 0]
    reserve = mask & ~error
    big = torch.finfo(gram.dtype).max / 4
    lo = torch.where(reserve, h, torch.full_like(h, -big)).amax(-1)
    hi = torch.where(error, h, torch.full_like(h, big)).amin(-1)
    lo = torch.where(lo <= -big, hi, lo)
    hi = torch.where(hi >= big, lo, hi)
    mid = 0.5 * (lo + hi)
    return torch.where(torch.isfinite(mid) & (mid.abs() < big), mid, torch.zeros_like(mid))


def fixed_partition_solve(gram: torch.Tensor, mask: torch.Tensor, margin: torch.Tensor, error: torch.Tensor,
                          C: torch.Tensor, ridge: float | torch.Tensor = 0.0) -> FixedPartitionSolve:
    """Solve the bordered KKT system of every problem for a given partition (differentiable).

    Parameters
    ----------
    gram : Tensor ``[G, n, n]`` (entries of padded keys are ignored)
    mask : bool Tensor ``[G, n]``  valid keys
    margin, error : bool Tensor ``[G, n]``  margin set S and error set E (subsets of ``mask``, disjoint)
    C : Tensor ``[G]``  box of each problem (may require grad)
    ridge : float or Tensor ``[G]``  added to the diagonal of ``2 K_SS`` (0 = exact fixed-partition optimum)

    Returns
    -------
    FixedPartitionSolve
    """
    A, b, empty, order, vcf, rows, kef = _bordered_system(gram, margin, error, C, ridge)
    u, info = torch.linalg.solve_ex(A, b[..., None], check_errors=False)
    u = u[..., 0]
    ok = (info == 0) & torch.isfinite(u).all(-1)
    if not bool(ok.all()):
        # Guard (DESIGN §2.4): re-solve the failed problems with a larger ridge (2 K_SS + ridge I is then
        # positive definite, so the bordered matrix is non-singular); replace only those rows.
        bad = ok.logical_not().nonzero()[:, 0]
        d = torch.cat([torch.zeros_like(vcf[:, :1]), vcf], dim=1)[bad]
        A2 = A[bad] + FALLBACK_RIDGE * torch.diag_embed(d)
        u2 = torch.linalg.solve_ex(A2, b[bad][..., None], check_errors=False)[0][..., 0]
        u2 = torch.nan_to_num(u2, nan=0.0, posinf=0.0, neginf=0.0)
        u = u.index_put((bad,), u2)
    alpha_c = u[:, 1:] * vcf
    alpha = torch.zeros_like(gram[:, 0]).scatter_add(1, order, alpha_c) + _c_column(C) * error.to(gram.dtype)
    k_alpha = (alpha_c[:, None, :] @ rows)[:, 0] + _c_column(C) * kef  # K symmetric: K[:, S] = K[S, :]^T
    rho = u[:, 0]
    if bool(empty.any()):
        rho = torch.where(empty, _rho_interval_midpoint(gram, alpha, mask, error), rho)
    return FixedPartitionSolve(alpha=alpha, rho=rho, ok=ok, empty=empty, k_alpha=k_alpha)


def kkt_violation(alpha: torch.Tensor, g: torch.Tensor, mask: torch.Tensor, margin: torch.Tensor,
                  error: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """Largest KKT violation of each problem, ``[G]``: box violation of alpha in units of C on S, sign
    violation of g on R (g < 0) and E (g > 0), and the residual of ``sum alpha = 1``. ``g`` on S is not
    checked (the bordered solve that produced ``alpha`` imposes it, up to its ridge). The sum is: with an
    empty margin set the bordered system has no equation left for it, and a partition with
    ``|E| C != 1`` would otherwise pass as an optimum (seen on clustered keys: four keys at C = 1/3)."""
    # Each term is a maximum over a set of keys of a monotone function of one quantity, so it is that function
    # of the set's extreme value (bitwise the same as taking it key by key); an empty set gives -inf -> 0.
    reserve = mask & ~margin & ~error
    inf = torch.tensor(float("inf"), dtype=alpha.dtype, device=alpha.device)
    Cv = C.to(alpha.dtype)
    a_min = torch.where(margin, alpha, inf).amin(-1)
    a_max = torch.where(margin, alpha, -inf).amax(-1)
    box = torch.maximum(-a_min, a_max - Cv) / Cv  # max over S of max(-alpha, alpha - C) / C
    g_r = -torch.where(reserve, g, inf).amin(-1)  # max over R of -g
    g_e = torch.where(error, g, -inf).amax(-1)  # max over E of g
    total = (torch.where(mask, alpha, torch.zeros_like(alpha)).sum(-1) - 1.0).abs()
    return torch.stack([box, g_r, g_e, total], dim=0).amax(0).clamp_min(0.0)


@dataclass
class PolishResult:
    """Result of :func:`active_set_polish`.

    Attributes
    ----------
    margin, error : bool Tensor ``[G, n]``  best partition found
    violation : Tensor ``[G]``  its KKT violation (:func:`kkt_violation` of the exact fixed-partition solve)
    converged : bool Tensor ``[G]``  partition stable (no point moves) within tolerance
    steps : int  polish steps run (the loop stops early once every problem converged)
    solve_failures : int  guarded-solve fallbacks during polishing
    """

    margin: torch.Tensor
    error: torch.Tensor
    violation: torch.Tensor
    converged: torch.Tensor
    steps: int
    solve_failures: int


def active_set_polish(gram: torch.Tensor, mask: torch.Tensor, margin: torch.Tensor, error: torch.Tensor,
                      C: torch.Tensor, steps: int, tol: float, full_steps: int = 1 << 30,
                      keep_frac: float = 0.5) -> PolishResult:
    """Primal-dual active-set refinement of a batched partition (no autograd).

    Each step solves every problem's bordered system exactly for its current partition, computes the
    KKT gradient, and moves every violating point at once: margin points with ``alpha < -tol C`` to R
    and ``alpha > C + tol C`` to E, reserve points with ``g < -tol`` and error points with ``g > tol``
    to S. The partition with the smallest violation seen is kept per problem.

    Parameters
    ----------
    gram : Tensor ``[G, n, n]`` (detached)
    mask, margin, error : bool Tensor ``[G, n]``  the starting partition (e.g. read out of FISTA)
    C : Tensor ``[G]``
    steps : int  maximum number of polish steps (each is one batched solve)
    tol : float  tolerance of the move rules and of convergence

    Returns
    -------
    PolishResult
    """
    G = gram.shape[0]
    best_m, best_e = margin.clone(), error.clone()
    best_v = torch.full((G,), float("inf"), dtype=gram.dtype, device=gram.device)
    converged = torch.zeros(G, dtype=torch.bool, device=gram.device)
    failures = 0
    # Working set: once at most a quarter of the problems still move, the settled ones are dropped, so
    # late steps cost in proportion to the few stragglers.
    work = torch.arange(G, device=gram.device)
    gw, mw, Cw = gram, mask, C
    cm, ce = margin, error
    run = 0
    for _ in range(max(steps, 0) + 1):
        Cc = _c_column(Cw)
        sol = fixed_partition_solve(gw, mw, cm, ce, Cw, polish_ridge(gw.dtype))
        failures += int((~sol.ok).sum())
        g = sol.gradient(gw)
        viol = kkt_violation(sol.alpha, g, mw, cm, ce, Cw)
        better = viol < best_v[work]
        idx = work[better]
        best_v[idx] = viol[better]
        best_m[idx] = cm[better]
        best_e[idx] = ce[better]
        reserve = mw & ~cm & ~ce
        # Per-point violation (alpha in units of C); after `full_steps` steps only points within
        # `keep_frac` of their problem's worst violation move (damps PDAS's oscillation on clustered keys).
        pv = torch.where(cm, torch.maximum(-sol.alpha, sol.alpha - Cc) / Cc,
                         torch.where(reserve, -g, torch.where(ce, g, torch.full_like(g, -1.0))))
        thr = tol if run < full_steps else torch.clamp_min(keep_frac * pv.amax(-1, keepdim=True), tol)
        big = pv > thr
        to_r = cm & big & (sol.alpha < 0)
        to_e = cm & big & (sol.alpha > Cc)
        r_to_s = reserve & big
        e_to_s = ce & big
        moved = (to_r | to_e | r_to_s | e_to_s).any(-1)
        converged[work[~moved]] = True
        if run >= steps or not bool(moved.any()):
            break
        new_m = (cm & ~to_r & ~to_e) | r_to_s | e_to_s
        new_e = (ce & ~e_to_s) | to_e
        n_moving = int(moved.sum())
        if 4 * n_moving <= moved.numel():
            # few stragglers: drop the settled problems (copies the stragglers' Grams once)
            work = work[moved]
            cm, ce = new_m[moved], new_e[moved]
            gw, mw, Cw = gw[moved], mw[moved], Cw[moved]
        else:
            # most still move: re-solving a settled problem reproduces it (no point moves), which is
            # cheaper than copying [G', n, n] Grams every step
            cm, ce = new_m, new_e
        run += 1
    return PolishResult(margin=best_m, error=best_e, violation=best_v, converged=converged, steps=run,
                        solve_failures=failures)


def primal_active_set(gram: torch.Tensor, mask: torch.Tensor, alpha0: torch.Tensor, margin: torch.Tensor,
                      error: torch.Tensor, C: torch.Tensor, steps: int, tol: float, add_frac: float = 0.1,
                      ) -> PolishResult:
    """Feasible (primal) active-set refinement of a batched partition (no autograd).

    Starting from a feasible iterate ``alpha0`` (e.g. FISTA's) and its read-out partition, each step
    solves the bordered system of the current partition for ``alpha*`` and moves along
    ``alpha + t (alpha* - alpha)`` with the largest ``t <= 1`` that keeps the margin keys in the box
    (ratio test). A blocked step moves the blocking keys to R (hit 0) or E (hit C); a full step admits
    to S the reserve keys with ``g < -tol`` and the error keys with ``g > tol`` whose violation is at
    least ``add_frac`` times the problem's largest one. The objective never increases, so the iteration
    does not cycle the way the primal-dual (all-violators) update does on clustered keys. Problems with
    no move left are frozen; the loop stops when all are.

    Parameters
    ----------
    gram : Tensor ``[G, n, n]`` (detached)
    mask : bool Tensor ``[G, n]``
    alpha0 : Tensor ``[G, n]``  feasible start (``0 <= alpha0 <= C``, sum 1 over valid keys)
    margin, error : bool Tensor ``[G, n]``  partition of the start (keys of R / E are snapped to 0 / C)
    C : Tensor ``[G]``
    steps : int  maximum number of steps (each one batched compact solve)
    tol : float  tolerance of the KKT-gradient sign tests
    add_frac : float, default 0.5  admit violators within this fraction of the worst one per step

    Returns
    -------
    PolishResult  (``violation`` is that of the final partition's exact solve)
    """
    G = gram.shape[0]
    Cc = _c_column(C)
    dt = gram.dtype
    alpha = torch.where(error, Cc.expand_as(alpha0), torch.where(margin, alpha0, torch.zeros_like(alpha0)))
    converged = torch.zeros(G, dtype=torch.bool, device=gram.device)
    failures = 0
    cur_m, cur_e = margin, error
    run = 0
    while True:
        sol = fixed_partition_solve(gram, mask, cur_m, cur_e, C, polish_ridge(gram.dtype))
        failures += int((~sol.ok).sum())
        direction = sol.alpha - alpha
        # Ratio test on the margin keys.
        huge = torch.full_like(alpha, float("inf"))
        t_lo = torch.where(cur_m & (sol.alpha < 0), alpha / (alpha - sol.alpha).clamp_min(1e-300), huge)
        t_hi = torch.where(cur_m & (sol.alpha > Cc), (Cc - alpha) / (sol.alpha - alpha).clamp_min(1e-300), huge)
        t_min = torch.minimum(t_lo.amin(-1), t_hi.amin(-1)).clamp(0.0, 1.0)
        blocked = t_min < 1.0
        step_alpha = alpha + t_min[:, None] * direction
        full = ~blocked
        # Full steps: KKT gradient of the exact solve; admit the worst violators.
        g = sol.gradient(gram)
        reserve = mask & ~cur_m & ~cur_e
        pv = torch.where(reserve, -g, torch.where(cur_e, g, torch.full_like(g, -1.0)))
        worst = pv.amax(-1, keepdim=True)
        admit = (pv > tol) & (pv >= add_frac * worst) & full[:, None]
        done = full & ~admit.any(-1)
        converged = converged | done
        if run >= steps or bool(converged.all()):
            break
        # Blocked steps: keys reaching a bound leave S.
        thr = t_min[:, None] * (1.0 + 1e-6) + 1e-12
        hit_lo = blocked[:, None] & cur_m & (t_lo <= thr)
        hit_hi = blocked[:, None] & cur_m & (t_hi <= thr) & ~hit_lo
        new_alpha = torch.where(full[:, None], sol.alpha, step_alpha)
        new_alpha = torch.where(hit_lo, torch.zeros_like(new_alpha), new_alpha)
        new_alpha = torch.where(hit_hi, Cc.expand_as(new_alpha), new_alpha)
        new_m = (cur_m & ~hit_lo & ~hit_hi) | admit
        new_e = (cur_e & ~admit) | hit_hi
        frozen = converged[:, None]
        alpha = torch.where(frozen, alpha, new_alpha)
        cur_m = torch.where(frozen, cur_m, new_m)
        cur_e = torch.where(frozen, cur_e, new_e)
        run += 1
    final = fixed_partition_solve(gram, mask, cur_m, cur_e, C, polish_ridge(gram.dtype))
    gf = final.gradient(gram)
    viol = kkt_violation(final.alpha, gf, mask, cur_m, cur_e, C).to(dt)
    return PolishResult(margin=cur_m, error=cur_e, violation=viol, converged=converged, steps=run,
                        solve_failures=failures)
