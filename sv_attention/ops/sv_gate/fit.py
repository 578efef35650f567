"""The batched gate fit: warm starts, counted fallbacks, one differentiable final solve.

Every fitted boundary goes through one chain (the only copy):

1. **Partition.** A boundary whose previous boundary's gate is known starts warm from that gate's
   partition (:func:`sv_attention.svdd.warm_fit.fit_warm`: primal-dual active-set steps, the first read
   off the previous gate); a small first boundary (``<= COLD_PDAS_MAX_KEYS`` keys) starts the same steps
   from "every key on the margin"; a larger cold boundary runs the partition finder
   (:func:`sv_attention.svdd.batched.solve_batched` on the settings' ``gate_backend``). Problems that do
   not settle fall back (working-set fit, then the cold solve); every fallback is counted in
   :func:`gate_stats`, and a solve that ends with a caveat is reported once per process.
2. **Gate.** The exact optimum of the found partition (bordered KKT solve, ridge
   (:func:`~sv_attention.svdd.polish.polish_ridge`: 1e-6, 1e-10 in float64). With ``detach_gate=False`` the same solve is
   repeated on a Gram that carries the keys' autograd graph (:func:`differentiable_gate`), so the gate's
   value is unchanged and its gradient is the implicit derivative of the optimum within the partition.
"""

from __future__ import annotations

import warnings

import torch

from sv_attention.svdd.polish import fixed_partition_solve, polish_ridge
from sv_attention.svdd.warm_fit import fit_chain, fit_warm, partition_from_alpha, prefix_of, stacked_gates

#: Counters of what the gate did in this process (fits, solver statuses, reuse); see :func:`gate_stats`.
STATS: dict[str, int] = {}
_WARNED: set[str] = set()
#: FISTA / power iterations of a warm-started finder run (the polish makes the found partition exact).
WARM_FISTA_ITERS = 10
WARM_POWER_ITERS = 5
#: FISTA iterations of a cold finder run (the polish then makes the found partition a KKT point).
COLD_FISTA_ITERS = 40
#: Cold fits up to this many keys start the active-set steps from uniform alpha (every key on the margin)
#: instead of running the partition finder; larger cold fits use ``solve_batched``.
COLD_PDAS_MAX_KEYS = 256


def count(key: str, n: int = 1) -> None:
    """Add ``n`` to the process-wide counter ``key`` (:func:`gate_stats`)."""
    STATS[key] = STATS.get(key, 0) + int(n)


def gate_stats() -> dict[str, int]:
    """A copy of the process-wide gate counters (``fits``, ``warm_fits``, ``problems``, ``status:<name>``,
    ``reused``, fallbacks...)."""
    return dict(STATS)


def warn_once(key: str, message: str) -> None:
    """``warnings.warn`` a message once per process and key."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


class CountingSolve:
    """``solve_batched`` with the gate's settings (finder backend, polish ridge), counting statuses.

    Called as ``solve(gram [G, n, n], mask [G, n], C, init=None | [G, n])``; ``init`` is a warm start (the
    finder then runs only :data:`WARM_FISTA_ITERS` iterations before the polish).
    """

    def __init__(self, backend: str = "auto") -> None:
        self.backend = backend

    def __call__(self, gram: torch.Tensor, mask: torch.Tensor, C: float, init: torch.Tensor | None = None):
        from sv_attention.svdd.batched import STATUS_NAMES, solve_batched

        if init is None:
            sol = solve_batched(gram, mask, C, check_inputs=False, ridge=polish_ridge(gram.dtype), backend=self.backend,
                                fista_iters=COLD_FISTA_ITERS)
        else:
            sol = solve_batched(gram, mask, C, check_inputs=False, init_alpha=init, fista_iters=WARM_FISTA_ITERS,
                                power_iters=WARM_POWER_ITERS, ridge=polish_ridge(gram.dtype), backend=self.backend)
            count("warm_fits")
        count("fits")
        count("problems", gram.shape[0])
        if sol.backend == "mlx":
            count("mlx_finder_calls")
        for code, name in STATUS_NAMES.items():
            k = int((sol.status == code).sum())
            if k:
                count(f"status:{name}", k)
                if name in ("solve fallback", "not converged", "infeasible"):
                    warn_once(f"status:{name}", f"sv gate: {k} SVDD problem(s) ended with status '{name}'; a "
                              "gate that is not feasible is refitted by the primal active set, a feasible one is "
                              "used as the best available approximation (see sv_attention.ops.sv_gate.gate_stats())")
        return sol


#: Relative tolerance of the validity check of a fitted gate (sum 1, inside the box).
VALID_TOL = {torch.float64: 1e-9, torch.float32: 1e-4}
#: Step budget (times the number of keys) of the last-resort primal active-set fit.
PRIMAL_STEPS_PER_KEY = 4


def invalid_gates(alpha: torch.Tensor, C: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Problems whose gate ``alpha [G, n]`` is not a feasible SVDD solution: ``sum != 1`` or outside
    ``[0, C]`` beyond :data:`VALID_TOL`, or not finite. Bool ``[G]``."""
    tol = VALID_TOL.get(alpha.dtype, 1e-4)
    a = alpha if mask is None else torch.where(mask, alpha, torch.zeros_like(alpha))
    return (~torch.isfinite(a).all(-1)) | ((a.sum(-1) - 1.0).abs() > tol) | (a.amax(-1) > C * (1.0 + tol)) \
        | (a.amin(-1) < -tol * C)


def ensure_valid(gram: torch.Tensor, alpha: torch.Tensor, C: float, mask: torch.Tensor | None = None,
                 solve: CountingSolve | None = None) -> torch.Tensor:
    """``alpha [G, n]`` with every infeasible gate (:func:`invalid_gates`) refitted: first by the cold
    ``solve`` when given (counted as ``cold_refit``), then, for what is still infeasible, by the feasible
    primal active-set method from uniform alpha (monotone in the objective, so it cannot cycle; counted as
    ``primal_fallback``). A problem that still fails is reported (``RuntimeWarning``, counted as
    ``invalid_gate``), never returned silently."""
    from sv_attention.svdd.polish import primal_active_set
    from sv_attention.svdd.warm_fit import polish_tol

    bad = invalid_gates(alpha, C, mask)
    if not bool(bad.any()):
        return alpha
    idx = bad.nonzero().flatten()
    G, n = alpha.shape
    g_bad = gram[idx] if isinstance(gram, torch.Tensor) else gram.dense(idx)
    m_bad = torch.ones(len(idx), n, dtype=torch.bool, device=alpha.device) if mask is None else mask[idx]
    if solve is not None:
        count("cold_refit", len(idx))
        cold = solve(g_bad, m_bad, C).alpha.clamp_min(0.0)
        cold = torch.where(m_bad, cold, torch.zeros_like(cold))
        alpha = alpha.index_copy(0, idx, cold.to(alpha.dtype))
        still_bad = invalid_gates(cold, C, m_bad)
        if not bool(still_bad.any()):
            return alpha
        idx, g_bad, m_bad = idx[still_bad], g_bad[still_bad], m_bad[still_bad]
    count("primal_fallback", len(idx))
    start = m_bad.to(alpha.dtype) / m_bad.sum(-1, keepdim=True).clamp_min(1)
    Ct = torch.full((len(idx),), float(C), dtype=alpha.dtype, device=alpha.device)
    start = torch.minimum(start, Ct[:, None])  # (n C >= 1 past warm-up, so uniform is feasible)
    res = primal_active_set(g_bad, m_bad, start, m_bad.clone(), torch.zeros_like(m_bad), Ct,
                            PRIMAL_STEPS_PER_KEY * n, polish_tol(alpha.dtype))
    from sv_attention.svdd.polish import fixed_partition_solve, polish_ridge

    refit = fixed_partition_solve(g_bad, m_bad, res.margin, res.error, Ct, polish_ridge(alpha.dtype)).alpha
    refit = torch.where(m_bad, refit.clamp_min(0.0), torch.zeros_like(refit))
    still = invalid_gates(refit, C, m_bad) | ~res.converged
    if bool(still.any()):
        count("invalid_gate", int(still.sum()))
        warn_once("invalid_gate", f"sv gate: {int(still.sum())} SVDD problem(s) have no valid fitted gate after "
                  "every fallback; their best iterate is used (see sv_attention.ops.sv_gate.gate_stats())")
    return alpha.index_copy(0, idx, refit.to(alpha.dtype))


def fit_cold(gram: torch.Tensor, C: float, solve: CountingSolve) -> torch.Tensor:
    """Gates of full problems ``gram [G, n, n]`` (all keys valid) with no previous gate: ``alpha [G, n]``."""
    G, n, _ = gram.shape
    if n <= COLD_PDAS_MAX_KEYS and solve.backend != "mlx":
        # a small first boundary: the active-set steps from "every key on the margin"
        uniform = torch.full((G, n), 1.0 / n, dtype=gram.dtype, device=gram.device)
        alpha = fit_warm(gram, uniform, C, 0, solve=solve, count=count, stat="cold_pdas_fits")
    else:
        dense = gram.dense() if hasattr(gram, "dense") else gram
        alpha = solve(dense, torch.ones(G, n, dtype=torch.bool, device=gram.device), C).alpha.clamp_min(0.0)
    return ensure_valid(gram, alpha, C, solve=solve)


def fit_from(gram: torch.Tensor, previous: torch.Tensor, C: float, new: int, solve: CountingSolve) -> torch.Tensor:
    """Gates of full problems ``gram [G, n, n]`` warm-started from the previous boundary's gate
    ``previous [G, n - new]``: ``alpha [G, n]``."""
    init = torch.nn.functional.pad(previous.to(gram.dtype), (0, new))
    return ensure_valid(gram, fit_warm(gram, init, C, new, solve=solve, count=count), C, solve=solve)


def fit_chain_from(gram: torch.Tensor, bounds: list[int], previous: torch.Tensor | None, C: float,
                   solve: CountingSolve) -> list[torch.Tensor] | None:
    """Gates of the consecutive boundaries ``bounds`` of ``gram [G, N, N]`` (all keys valid; dense or a lazy
    row provider) in one native call (:func:`sv_attention.svdd.warm_fit.fit_chain`): the same gates as :func:`fit_cold` /
    :func:`fit_from` boundary by boundary, each checked by :func:`ensure_valid`. ``previous [G, p]``: the gate
    the first boundary starts from (None: cold, every key on the margin).

    Returns
    -------
    list of Tensor ``[G, bounds[b]]``, or None where the chain does not apply (no native kernel, the MLX
    finder, a cold first boundary above :data:`COLD_PDAS_MAX_KEYS`): the caller fits boundary by boundary
    """
    if solve.backend == "mlx" or (previous is None and bounds[0] > COLD_PDAS_MAX_KEYS):
        return None
    fitted = fit_chain(gram, bounds, previous, C, solve=solve, count=count)
    if fitted is None:
        return None
    G, N, _ = gram.shape
    stacked = stacked_gates(fitted, N)  # [G, B, N]
    bad = invalid_gates(stacked.reshape(G * len(bounds), N), C).view(G, len(bounds)).any(0)
    for b in bad.nonzero().flatten().tolist():  # (feasibility of every boundary checked at once)
        fitted[b] = ensure_valid(prefix_of(gram, bounds[b]), fitted[b], C, solve=solve)
    return fitted


def fit_masked(gram: torch.Tensor, mask: torch.Tensor, C: float, solve: CountingSolve) -> torch.Tensor:
    """Gates of problems with invalid keys (a non-causal layer's padded sequences): ``alpha [G, n]``, 0 where
    ``mask`` is False."""
    alpha = solve(gram, mask, C).alpha.clamp_min(0.0)
    return ensure_valid(gram, torch.where(mask, alpha, torch.zeros_like(alpha)), C, mask, solve=solve)


def differentiable_gate(gram: torch.Tensor, alpha: torch.Tensor, C: float,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """The gate ``alpha [G, n]`` recomputed as the exact optimum of its own partition on ``gram [G, n, n]``
    (which may carry autograd history): equal in value, differentiable w.r.t. the Gram (and so the keys
    and the bandwidth) through the bordered solve (DESIGN §2.3, §2.4)."""
    G, n = alpha.shape
    mask = torch.ones(G, n, dtype=torch.bool, device=alpha.device) if mask is None else mask
    margin, error = partition_from_alpha(alpha.detach(), C)
    margin, error = margin & mask, error & mask
    if not bool(mask.all()):
        keep = mask[:, :, None] & mask[:, None, :]
        gram = torch.where(keep, gram, torch.zeros((), dtype=gram.dtype, device=gram.device))
    Ct = torch.full((G,), float(C), dtype=gram.dtype, device=gram.device)
    sol = fixed_partition_solve(gram, mask, margin, error, Ct, polish_ridge(gram.dtype))
    return torch.where(mask, sol.alpha, torch.zeros_like(sol.alpha))
