"""Batched SVDD solves for training: partition finder + active-set polish + ridged bordered solve.

:func:`solve_batched` solves ``G`` small SVDD problems (DESIGN §2.1) at once, e.g. one per
(sequence, head, chunk boundary), with different prefix lengths packed together by a validity mask:

1. **finder** (no autograd): FISTA on the capped simplex with the tangent-space Lipschitz step, warm-started
   Newton/bisection + exact-shift projection and adaptive restart (:mod:`sv_attention.svdd.batched_torch`, or the MLX port
   :mod:`sv_attention.svdd.batched_mlx`); the partition is read out with ``eps = 1e-4 C``;
2. **polish** (no autograd): active-set steps on the exact bordered system of the compacted margin block
   (:mod:`sv_attention.svdd.polish`): a few primal-dual steps (all violators move at once), then, for
   the problems those leave unsettled, a feasible primal active-set method with a ratio test (monotone,
   so it does not cycle). FISTA alone stalls on clustered keys (DESIGN §2.4); the polish turns its
   near-correct partition into the exact one;
3. **ridged bordered solve** (autograd): ``(M + ridge diag(0, 1_S)) [rho; alpha_S] = c`` with
   ``torch.linalg.solve_ex``, guarded per problem (zero pivot / non-finite -> re-solved with a larger
   ridge, counted in :attr:`BatchedSolution.fallbacks`). Gradients flow to ``gram`` (and ``C`` when it is
   a tensor that requires grad) through the solve; the partition is held fixed (migrations are kinks).

The returned coefficients are a stabilised approximation (ridge) and never carry a deletion
certificate; the exact maintained solver is :class:`sv_attention.svdd.IncrementalSVDD`.
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass, field

import torch

from sv_attention.errors import BackendUnavailableError, InvalidHyperparameterError, InvalidInputError
from sv_attention.svdd.batched_torch import fista_finder
from sv_attention.svdd.box import warmup_size
from sv_attention.svdd.polish import (
    PolishResult,
    active_set_polish,
    fixed_partition_solve,
    primal_active_set,
)

#: Per-problem status codes of :attr:`BatchedSolution.status`.
STATUS_OK = 0
STATUS_WARMUP = 1  # fewer than ceil(1/C) + 2 valid keys (still solved when feasible; no certificate)
STATUS_INFEASIBLE = 2  # n_valid * C < 1: no feasible alpha; alpha is uniform over the valid keys
STATUS_EMPTY_MARGIN = 3  # the optimum has no margin point (rho from the KKT interval midpoint)
STATUS_SOLVE_FALLBACK = 4  # the guarded ridged solve failed and the fallback ridge was used
STATUS_NOT_CONVERGED = 5  # the polish did not reach a KKT point within tolerance (best partition used)

STATUS_NAMES = {
    STATUS_OK: "ok",
    STATUS_WARMUP: "warm-up",
    STATUS_INFEASIBLE: "infeasible",
    STATUS_EMPTY_MARGIN: "empty margin",
    STATUS_SOLVE_FALLBACK: "solve fallback",
    STATUS_NOT_CONVERGED: "not converged",
}

BACKENDS = ("auto", "torch", "mlx")
POLISHES = ("hybrid", "primal", "pdas")
#: Primal-dual steps of the "hybrid" polish before the primal method takes over the unsettled problems.
PDAS_STEPS = 4


@dataclass
class BatchedSolution:
    """Solutions of a batch of SVDD problems (torch tensors on the input device).

    Attributes
    ----------
    alpha : Tensor ``[G, n]``
        Coefficients from the ridged bordered solve; differentiable w.r.t. ``gram`` (and ``C``).
        Exactly 0 on reserve and padded keys, exactly ``C`` on error keys.
    rho : Tensor ``[G]``  (differentiable)
    margin, error, reserve : bool Tensor ``[G, n]``
        The partition (S: 0 < alpha < C, E: alpha = C, R: alpha = 0); padded keys are in none.
    valid : bool Tensor ``[G]``
        True where the problem was solved to a KKT point, is out of warm-up and has a non-empty margin.
    status : int8 Tensor ``[G]``  one of the ``STATUS_*`` codes (the most severe reason that applies:
        infeasible > warm-up > empty margin > solve fallback > not converged)
    kkt_violation : Tensor ``[G]``
        KKT violation of the ridge-0 solution of the returned partition (0 up to rounding when exact).
    iterations : int  FISTA iterations run
    polish_steps : int  active-set polish steps run (stops early when every problem converged)
    fallbacks : int  problems whose guarded solve fell back to the larger ridge (polish + final)
    backend : str  the finder backend actually used ("torch" or "mlx")
    counts : dict  number of problems per status name
    """

    alpha: torch.Tensor
    rho: torch.Tensor
    margin: torch.Tensor
    error: torch.Tensor
    reserve: torch.Tensor
    valid: torch.Tensor
    status: torch.Tensor
    kkt_violation: torch.Tensor
    iterations: int
    polish_steps: int
    fallbacks: int
    backend: str
    counts: dict[str, int] = field(default_factory=dict)


def mlx_available() -> bool:
    """True when ``mlx.core`` imports (on Linux it needs the ``mlx[cpu]`` extra)."""
    try:
        import mlx.core  # noqa: F401
    except Exception:  # ImportError, or a broken wheel raising OSError / RuntimeError
        return False
    return True


def select_backend(backend: str, device: torch.device) -> str:
    """Resolve ``backend`` ("auto", "torch", "mlx") for tensors on ``device``.

    ``"auto"`` picks **MLX on Apple silicon** (macOS arm64, CPU tensors, mlx importable) and **torch
    everywhere else** (Linux CPU, CUDA). Why: MLX runs only the (non-differentiable) finder, the polish
    and the differentiable solve are torch in both cases, and on Linux ``mlx[cpu]`` is single-threaded
    with reference BLAS. Measured on the project's shared 2-core x86_64 Linux machine (``sv-attention bench
    gate``, results/bench_gate.json, which records the machine): torch was 3.2-6.9x faster than MLX in
    all six cells (n = 64 and 256, G = 64, 512, 4096). On Apple silicon MLX uses Accelerate and unified
    memory (not measured here). Pass ``backend="mlx"`` (the gate's ``gate_backend`` setting) to force it.
    """
    if backend not in BACKENDS:
        raise InvalidInputError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "mlx":
        if not mlx_available():
            raise BackendUnavailableError(
                "backend='mlx' requested but mlx.core cannot be imported; on Linux install 'mlx[cpu]' "
                "(needs glibc >= 2.35), or use backend='torch'")
        return "mlx"
    if device.type == "cpu" and platform.system() == "Darwin" and platform.machine() == "arm64" \
            and mlx_available():
        return "mlx"
    return "torch"


def _as_c_tensor(C: float | torch.Tensor, G: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(C, torch.Tensor):
        if C.dim() == 0:
            C = C.expand(G)
        if C.shape != (G,):
            raise InvalidInputError(f"C must be a float, a 0-d tensor or shape [G]=[{G}], got {tuple(C.shape)}")
        Ct = C.to(dtype=dtype, device=device)
    else:
        Ct = torch.full((G,), float(C), dtype=dtype, device=device)
    Cd = Ct.detach()
    if not bool(torch.isfinite(Cd).all()) or bool((Cd <= 0).any()):
        raise InvalidHyperparameterError(f"C must be finite and > 0 for every problem, got min {float(Cd.min())}; "
                                         "pass a positive box (C = 1/(nu n0))")
    return Ct


def _validate(gram: torch.Tensor, mask: torch.Tensor) -> None:
    if not isinstance(gram, torch.Tensor) or gram.dim() != 3 or gram.shape[-1] != gram.shape[-2]:
        raise InvalidInputError(f"gram must be a tensor [G, n, n], got shape "
                                f"{tuple(gram.shape) if isinstance(gram, torch.Tensor) else type(gram).__name__}")
    if not gram.is_floating_point():
        raise InvalidInputError(f"gram must be float32 or float64, got {gram.dtype}")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != gram.shape[:2]:
        raise InvalidInputError(f"mask must be a bool tensor [G, n]={tuple(gram.shape[:2])}, got "
                                f"{getattr(mask, 'dtype', type(mask).__name__)} "
                                f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else ''}")
    if mask.device != gram.device:
        raise InvalidInputError(f"mask is on {mask.device} but gram on {gram.device}; put both on one device")
    valid2 = mask[:, :, None] & mask[:, None, :]
    g = gram.detach()
    if not bool(torch.isfinite(torch.where(valid2, g, torch.zeros_like(g))).all()):
        raise InvalidInputError("gram has non-finite entries on valid keys; check the keys and sigma")


def solve_batched(gram: torch.Tensor, mask: torch.Tensor, C: float | torch.Tensor, *, backend: str = "auto",
                  fista_iters: int = 80, projection_steps: int = 4, power_iters: int = 20, polish_steps: int = 64,
                  ridge: float = 1e-3, eps_rel: float = 1e-4, tol: float | None = None,
                  polish: str = "hybrid", check_inputs: bool = True,
                  finder_matvec_dtype: torch.dtype | None = torch.float16,
                  init_alpha: torch.Tensor | None = None) -> BatchedSolution:
    """Solve a batch of SVDD problems; differentiable coefficients through a ridged bordered solve.

    Parameters
    ----------
    gram : Tensor ``[G, n, n]`` float32 / float64 (CPU or CUDA)
        RBF Gram matrices (symmetric, diagonal 1 for the RBF kernel). Entries in rows / columns of
        padded keys are ignored (they receive exactly zero gradient).
    mask : bool Tensor ``[G, n]``
        True on the valid keys of each problem (different prefix lengths packed together).
    C : float, 0-d Tensor or Tensor ``[G]``
        Box of each problem (fixed; ``nu`` calibrates it as ``1 / (nu n0)`` elsewhere). May require grad.
    backend : {"auto", "torch", "mlx"}, default "auto"
        Where the (non-differentiable) FISTA finder runs; see :func:`select_backend` for what "auto"
        picks and why. Polish and the differentiable solve always run in torch.
    fista_iters : int, default 80
        FISTA iterations of the finder.
    projection_steps : int, default 4
        Safeguarded Newton / bisection steps of each capped-simplex projection (warm-started from the
        previous iteration, followed by the exact-shift polish).
    power_iters : int, default 20
        Power iterations for the tangent-space Lipschitz constant.
    polish_steps : int, default 64
        Maximum active-set polish steps (each one batched exact bordered solve on the compacted margin
        block); 0 disables. The loop stops as soon as every problem's partition is a KKT point.
    ridge : float, default 1e-3
        Ridge of the final differentiable solve, ``(M + ridge diag(0, 1_S)) u = c`` (DESIGN §2.4).
        ``0`` returns the exact optimum of the found partition.
    eps_rel : float, default 1e-4
        Partition read-out threshold of the finder's iterate, ``eps = eps_rel * C`` (``<=`` / ``>=``).
    tol : float or None, default None
        Tolerance of the polish move rules (None: ``64 * finfo(dtype).eps``, about 7.6e-6 in fp32).
    polish : {"hybrid", "primal", "pdas"}, default "hybrid"
        ``"pdas"``: primal-dual active set (moves every violator at once; fast, but oscillates on some
        clustered problems); ``"primal"``: feasible active set with a ratio test (monotone, one blocking
        key per step); ``"hybrid"``: ``PDAS_STEPS`` primal-dual steps, then the primal method on the
        problems still unsettled.
    finder_matvec_dtype : torch.dtype or None, default torch.float16
        Storage dtype of K for the finder's matrix-vector products (torch backend; None = ``gram.dtype``).
        The finder only proposes a partition that the polish then makes exact, so half precision costs
        little accuracy (measured by ``sv-attention bench gate``) and on this CPU runs the products 5-8x
        faster (half the memory traffic, and a kernel unaffected by thread oversubscription).
    check_inputs : bool, default True
        Validate shapes and finiteness of ``gram`` (a full pass over it); callers that built ``gram``
        from keys they already checked (the causal layer) pass False.
    init_alpha : Tensor ``[G, n]`` or None, default None
        Warm start of the finder (projected onto the feasible set first), e.g. the solution of a shorter
        prefix padded with zeros for the new keys; then a few ``fista_iters`` (even 0) suffice, as the
        polish makes the partition exact. A warm start always runs the torch finder.

    Returns
    -------
    BatchedSolution
        Per-problem ``valid`` / ``status`` say which problems are warm-up, infeasible, have an empty
        margin set, used the solve fallback or did not converge; none of these raises.

    Raises
    ------
    InvalidInputError
        Wrong shapes / dtypes, non-finite Gram entries on valid keys, unknown backend.
    InvalidHyperparameterError
        ``C`` not finite and positive, negative iteration counts or ridge.
    BackendUnavailableError
        ``backend="mlx"`` where MLX cannot be imported.
    """
    if check_inputs:
        _validate(gram, mask)
    for name, val in (("fista_iters", fista_iters), ("projection_steps", projection_steps), ("power_iters", power_iters),
                      ("polish_steps", polish_steps)):
        if int(val) != val or val < 0:
            raise InvalidHyperparameterError(f"{name} must be a non-negative integer, got {val!r}")
    if polish not in POLISHES:
        raise InvalidInputError(f"polish must be one of {POLISHES}, got {polish!r}")
    if not (ridge >= 0 and math.isfinite(ridge)) or not (eps_rel > 0):
        raise InvalidHyperparameterError(f"ridge must be >= 0 and eps_rel > 0, got ridge={ridge}, eps_rel={eps_rel}")
    G, n, _ = gram.shape
    dt, dev = gram.dtype, gram.device
    Ct = _as_c_tensor(C, G, dt, dev)
    Cd = Ct.detach()
    used = select_backend(backend, dev)
    tol = 64.0 * torch.finfo(dt).eps if tol is None else float(tol)

    cnt = mask.sum(-1)
    feasible = (cnt.to(dt) * Cd >= 1.0 - 1e-9) & (cnt > 0)
    warm = cnt < warmup_size(Cd).to(cnt.dtype)
    # Infeasible problems are solved as if C were 1/n (feasible) and overwritten below.
    C_run = torch.where(feasible, Cd, 1.0 / cnt.clamp_min(1).to(dt))

    with torch.no_grad():
        maskf = mask.to(dt)
        g0 = gram.detach() * (maskf[:, :, None] * maskf[:, None, :])
        prof = torch.profiler.record_function("sv.finder")
        prof.__enter__()
        if init_alpha is not None:
            if init_alpha.shape != mask.shape:
                raise InvalidInputError(f"init_alpha must have the mask's shape {tuple(mask.shape)}, got "
                                        f"{tuple(init_alpha.shape)}")
            a = fista_finder(g0, maskf, C_run, iters=fista_iters, projection_steps=projection_steps,
                             power_iters=power_iters, matvec_dtype=finder_matvec_dtype,
                             init=init_alpha.detach())
        elif used == "mlx":
            from sv_attention.svdd.batched_mlx import fista_finder_mlx

            a = fista_finder_mlx(g0, maskf, C_run, iters=fista_iters, projection_steps=projection_steps,
                                 power_iters=power_iters)
        else:
            a = fista_finder(g0, maskf, C_run, iters=fista_iters, projection_steps=projection_steps,
                             power_iters=power_iters, matvec_dtype=finder_matvec_dtype)
        prof.__exit__(None, None, None)
        eps = eps_rel * C_run[:, None]
        error = mask & (a >= C_run[:, None] - eps)
        margin = mask & ~error & (a > eps)
        with torch.profiler.record_function("sv.polish"):
            pol = _polish(g0, mask, a, margin, error, C_run, polish, polish_steps, tol)
        margin, error = pol.margin, pol.error

    # Final differentiable solve (gram with padded entries zeroed so they get exactly zero gradient).
    mask2 = mask[:, :, None] & mask[:, None, :]
    gram_m = torch.where(mask2, gram, torch.zeros((), dtype=dt, device=dev))
    C_final = torch.where(feasible, Ct, C_run)
    with torch.profiler.record_function("sv.solve"):
        sol = fixed_partition_solve(gram_m, mask, margin, error, C_final, ridge)
    alpha, rho = sol.alpha, sol.rho
    uniform = maskf / cnt.clamp_min(1).to(dt)[:, None]
    alpha = torch.where(feasible[:, None], alpha, uniform)
    viol = pol.violation  # of the ridge-0 solve of the returned partition

    status = torch.full((G,), STATUS_OK, dtype=torch.int8, device=dev)
    not_conv = viol > 10.0 * tol
    # Later assignments win: infeasible > warm-up > empty margin > solve fallback > not converged; an empty margin
    # is an optimum only when the partition converged (kkt_violation includes the sum residual).
    for code, flag in ((STATUS_NOT_CONVERGED, not_conv), (STATUS_SOLVE_FALLBACK, ~sol.ok),
                       (STATUS_EMPTY_MARGIN, sol.empty & ~not_conv), (STATUS_WARMUP, warm),
                       (STATUS_INFEASIBLE, ~feasible)):
        status = torch.where(flag, torch.full_like(status, code), status)
    reserve = mask & ~margin & ~error
    margin = torch.where(feasible[:, None], margin, torch.zeros_like(margin))
    error = torch.where(feasible[:, None], error, torch.zeros_like(error))
    reserve = torch.where(feasible[:, None], reserve, torch.zeros_like(reserve))
    counts = {STATUS_NAMES[c]: int((status == c).sum()) for c in STATUS_NAMES}
    return BatchedSolution(
        alpha=alpha, rho=rho, margin=margin, error=error, reserve=reserve, valid=status == STATUS_OK,
        status=status, kkt_violation=viol, iterations=fista_iters, polish_steps=pol.steps,
        fallbacks=pol.solve_failures + int((~sol.ok).sum()), backend=used, counts=counts)


def _polish(g0: torch.Tensor, mask: torch.Tensor, a: torch.Tensor, margin: torch.Tensor, error: torch.Tensor,
            C: torch.Tensor, polish: str, steps: int, tol: float) -> PolishResult:
    """Run the selected polish; "hybrid" = primal-dual steps, then the primal method on the problems the
    primal-dual iteration did not settle (restarted from the finder's iterate)."""
    if polish == "primal":
        return primal_active_set(g0, mask, a, margin, error, C, steps, tol)
    if polish == "pdas":
        return active_set_polish(g0, mask, margin, error, C, steps, tol)
    first = active_set_polish(g0, mask, margin, error, C, min(steps, PDAS_STEPS), tol)
    bad = (~first.converged).nonzero()[:, 0]
    if bad.numel() == 0 or steps <= PDAS_STEPS:
        return first
    second = primal_active_set(g0[bad], mask[bad], a[bad], margin[bad], error[bad], C[bad], steps, tol)
    better = second.violation < first.violation[bad]
    idx = bad[better]
    m, e, v = first.margin.clone(), first.error.clone(), first.violation.clone()
    m[idx], e[idx], v[idx] = second.margin[better], second.error[better], second.violation[better]
    conv = first.converged.clone()
    conv[bad] = second.converged
    return PolishResult(margin=m, error=e, violation=v, converged=conv, steps=first.steps + second.steps,
                        solve_failures=first.solve_failures + second.solve_failures)
