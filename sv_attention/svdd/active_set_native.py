"""The active-set iteration of :func:`sv_attention.svdd.warm_fit.active_set_fit` as one C call (CPU, dense Grams).

The torch loop of :func:`~sv_attention.svdd.warm_fit.active_set_fit` is the reference: every problem runs
the same steps here (the bordered solve of the margin block through a Cholesky factor of
``2 K_SS + ridge I``, the KKT gradient, the move rules, the block-principal-pivoting safeguard, the
first step read off a known start), but each problem iterates on its own in float64, so a problem that
settles in 3 steps costs 3 steps however slow its batch neighbours are, and a step costs a few
microseconds instead of ~100 torch calls. The problems are shared out over ``threads`` POSIX threads.

Differences from the torch loop, all in the direction of accuracy: arithmetic is float64 whatever the
Gram's dtype (the move tolerance ``tol`` is the caller's, so decisions are the same up to rounding); the
"known start" test is made per problem (the torch loop accepts it for the whole batch or for none); a
Cholesky factor that fails, or a margin set that empties, ends that problem unsettled at once (the torch
loop keeps iterating on non-finite values until it stops; either way the caller's fallback refits it).
tests/svdd/test_active_set_native.py checks solutions, partitions and step counts against the torch loop.
"""

from __future__ import annotations

import ctypes

import torch

from sv_attention.svdd.native_build import load_kernel

NAME = "sv_active_set"

SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const void *gram; int is_double; int64_t G, n;
    const uint8_t *mask; uint8_t *margin, *error;
    double C; int64_t steps; double tol, ridge, settled_factor; int64_t pivot_backup;
    const double *start;
    double *alpha, *g, *rho; uint8_t *settled; int64_t *solves;
    int64_t next; int failed;
} job_t;

typedef struct { double *Kd, *M, *aS, *z1, *z2, *hs, *Kc; int64_t *S, *E, *pos; uint8_t *viol; } work_t;

static int chol(double *M, int64_t m) {  /* in place, lower triangle, row-major; 0 on success */
    for (int64_t j = 0; j < m; j++) {
        double *rj = M + j * m, s = rj[j];
        for (int64_t k = 0; k < j; k++) s -= rj[k] * rj[k];
        if (!(s > 0.0)) return 1;
        double d = sqrt(s); rj[j] = d;
        for (int64_t i = j + 1; i < m; i++) {
            double *ri = M + i * m, t = ri[j];
            for (int64_t k = 0; k < j; k++) t -= ri[k] * rj[k];
            ri[j] = t / d;
        }
    }
    return 0;
}

static void chol_solve(const double *L, int64_t m, double *x) {  /* x <- (L L^T)^-1 x */
    for (int64_t i = 0; i < m; i++) {
        const double *ri = L + i * m; double t = x[i];
        for (int64_t k = 0; k < i; k++) t -= ri[k] * x[k];
        x[i] = t / ri[i];
    }
    for (int64_t i = m - 1; i >= 0; i--) {
        double t = x[i];
        for (int64_t k = i + 1; k < m; k++) t -= L[k * m + i] * x[k];
        x[i] = t / L[i * m + i];
    }
}

/* Kc = sum_k aS[k] K[S[k], :] + C sum_e K[E[e], :] */
static void gram_times(const double *K, int64_t n, const int64_t *S, const double *aS, int64_t ns,
                       const int64_t *E, int64_t ne, double C, double *Kc) {
    memset(Kc, 0, (size_t)n * sizeof(double));
    for (int64_t k = 0; k < ns; k++) {
        const double *row = K + S[k] * n; double c = aS[k];
        for (int64_t i = 0; i < n; i++) Kc[i] += c * row[i];
    }
    for (int64_t e = 0; e < ne; e++) {
        const double *row = K + E[e] * n;
        for (int64_t i = 0; i < n; i++) Kc[i] += C * row[i];
    }
}

static void solve_one(job_t *jb, work_t *w, int64_t p) {
    const int64_t n = jb->n;
    const double C = jb->C, tol = jb->tol, ridge = jb->ridge;
    const double *K;
    if (jb->is_double) K = (const double *)jb->gram + p * n * n;
    else {
        const float *src = (const float *)jb->gram + p * n * n;
        for (int64_t i = 0; i < n * n; i++) w->Kd[i] = (double)src[i];
        K = w->Kd;
    }
    const uint8_t *mask = jb->mask + p * n;
    uint8_t *mar = jb->margin + p * n, *err = jb->error + p * n;
    const double *start = jb->start ? jb->start + p * n : NULL;
    double *g = jb->g + p * n;
    int64_t best = n + 1, backup = jb->pivot_backup, run = 0, solves = 0;
    double rho = 0.0;
    int ok = 1, settled = 0;
    for (int64_t i = 0; i < n; i++) { mar[i] &= mask[i]; err[i] &= mask[i]; }
    for (;;) {
        int64_t ns = 0, ne = 0;
        for (int64_t i = 0; i < n; i++) {
            w->pos[i] = -1;
            if (mar[i]) { w->pos[i] = ns; w->S[ns++] = i; }
            else if (err[i]) w->E[ne++] = i;
        }
        if (ns == 0) { ok = 0; settled = 0; break; }  /* an empty margin: unsettled (the caller refits) */
        int known = 0;
        if (run == 0 && start) {  /* the starting partition's solution may be known: no solve */
            for (int64_t k = 0; k < ns; k++) w->aS[k] = start[w->S[k]];
            gram_times(K, n, w->S, w->aS, ns, w->E, ne, C, w->Kc);
            double sum_r = 0.0, mass = C * (double)ne - 1.0;
            for (int64_t k = 0; k < ns; k++) {
                int64_t i = w->S[k];
                w->hs[k] = K[i * n + i] - 2.0 * w->Kc[i] - ridge * w->aS[k];
                sum_r += w->hs[k]; mass += w->aS[k];
            }
            double r = sum_r / (double)ns, spread = 0.0;
            for (int64_t k = 0; k < ns; k++) spread = fmax(spread, fabs(w->hs[k] - r));
            double bound = jb->settled_factor * tol * fmax(1.0, sqrt((double)n));
            if (spread <= bound && fabs(mass) <= bound) {
                known = 1; rho = r; ok = isfinite(rho);
                for (int64_t k = 0; k < ns; k++) ok = ok && isfinite(w->aS[k]);
            }
        }
        if (!known) {
            /* [[0, 1^T], [1, M]] [rho; a] = [1 - C |E|; h_S], M = 2 K_SS + ridge I */
            for (int64_t a = 0; a < ns; a++) {
                const double *row = K + w->S[a] * n; double *Ma = w->M + a * ns;
                for (int64_t b = 0; b <= a; b++) Ma[b] = 2.0 * row[w->S[b]];
                Ma[a] += ridge;
                double t = 0.0;
                for (int64_t e = 0; e < ne; e++) t += row[w->E[e]];
                w->z1[a] = row[w->S[a]] - 2.0 * C * t;
                w->z2[a] = 1.0;
            }
            solves++;
            if (chol(w->M, ns)) { ok = 0; settled = 0; break; }
            chol_solve(w->M, ns, w->z1);
            chol_solve(w->M, ns, w->z2);
            double s1 = 0.0, s2 = 0.0;
            for (int64_t k = 0; k < ns; k++) { s1 += w->z1[k]; s2 += w->z2[k]; }
            rho = (s1 - (1.0 - C * (double)ne)) / s2;
            ok = isfinite(rho);
            for (int64_t k = 0; k < ns; k++) { w->aS[k] = w->z1[k] - rho * w->z2[k]; ok = ok && isfinite(w->aS[k]); }
            gram_times(K, n, w->S, w->aS, ns, w->E, ne, C, w->Kc);
        }
        for (int64_t i = 0; i < n; i++) g[i] = rho - K[i * n + i] + 2.0 * w->Kc[i];
        /* each key's violation in the units of its move rule; the largest one (first on ties) */
        int64_t nviol = 0, top = -1; double top_size = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            w->viol[i] = 0;
            if (!mask[i]) continue;
            double size;
            if (mar[i]) { double a = w->aS[w->pos[i]] / C; size = fmax(-a, a - 1.0); }
            else size = err[i] ? g[i] : -g[i];
            if (size > tol) { w->viol[i] = 1; nviol++; }
            if (size > top_size) { top_size = size; top = i; }
        }
        if (nviol == 0 || run >= jb->steps) { settled = (nviol == 0) && ok; break; }
        int improved = nviol < best, block = improved || backup > 0;
        backup = improved ? jb->pivot_backup : (backup > 0 ? backup - 1 : 0);
        if (nviol < best) best = nviol;
        for (int64_t i = 0; i < n; i++) {
            if (!w->viol[i] || !(block || i == top)) continue;
            if (mar[i]) { err[i] = w->aS[w->pos[i]] / C > 1.0; mar[i] = 0; }
            else { err[i] = 0; mar[i] = 1; }
        }
        run++;
    }
    double *alpha = jb->alpha + p * n;
    for (int64_t i = 0; i < n; i++)
        alpha[i] = (mar[i] && w->pos[i] >= 0) ? w->aS[w->pos[i]] : (err[i] ? C : 0.0);
    jb->rho[p] = rho;
    jb->settled[p] = (uint8_t)(settled && ok);
    jb->solves[p] = solves;
}

static void *worker(void *arg) {
    job_t *jb = (job_t *)arg;
    const int64_t n = jb->n;
    work_t w;
    size_t nn = (size_t)n * (size_t)n;
    w.Kd = jb->is_double ? NULL : malloc(nn * sizeof(double));
    w.M = malloc(nn * sizeof(double));
    double *vec = malloc(5 * (size_t)n * sizeof(double));
    int64_t *idx = malloc(3 * (size_t)n * sizeof(int64_t));
    w.viol = malloc((size_t)n);
    if (!w.M || !vec || !idx || !w.viol || (!jb->is_double && !w.Kd)) {
        __atomic_store_n(&jb->failed, 1, __ATOMIC_SEQ_CST);
    } else {
        w.aS = vec; w.z1 = vec + n; w.z2 = vec + 2 * n; w.hs = vec + 3 * n; w.Kc = vec + 4 * n;
        w.S = idx; w.E = idx + n; w.pos = idx + 2 * n;
        for (;;) {
            int64_t p = __atomic_fetch_add(&jb->next, 1, __ATOMIC_SEQ_CST);
            if (p >= jb->G) break;
            solve_one(jb, &w, p);
        }
    }
    free(w.Kd); free(w.M); free(vec); free(idx); free(w.viol);
    return NULL;
}

int sv_active_set(const void *gram, int is_double, int64_t G, int64_t n, const uint8_t *mask, uint8_t *margin,
                  uint8_t *error, double C, int64_t steps, double tol, double ridge, double settled_factor,
                  int64_t pivot_backup, const double *start, double *alpha, double *g, double *rho,
                  uint8_t *settled, int64_t *solves, int64_t threads) {
    job_t jb = {gram, is_double, G, n, mask, margin, error, C, steps, tol, ridge, settled_factor, pivot_backup,
                start, alpha, g, rho, settled, solves, 0, 0};
    if (threads > G) threads = G;
    if (threads < 1) threads = 1;
    pthread_t tid[64];
    if (threads > 64) threads = 64;
    int64_t started = 0;
    for (int64_t t = 1; t < threads; t++) {
        if (pthread_create(&tid[t], NULL, worker, &jb) != 0) break;
        started = t;
    }
    worker(&jb);
    for (int64_t t = 1; t <= started; t++) pthread_join(tid[t], NULL);
    return jb.failed;
}
"""

_i64, _f64, _ptr = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p


def kernel() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use), or None where it cannot be built (reported once)."""
    lib = load_kernel(NAME, SOURCE)
    if lib is not None and not getattr(lib, "_sv_typed", False):
        lib.sv_active_set.restype = ctypes.c_int
        lib.sv_active_set.argtypes = [_ptr, ctypes.c_int, _i64, _i64, _ptr, _ptr, _ptr, _f64, _i64, _f64, _f64, _f64,
                                      _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64]
        lib._sv_typed = True
    return lib


def supports(gram: object) -> bool:
    """Whether the kernel can run on ``gram``: a dense CPU float32 / float64 Tensor without autograd."""
    return (isinstance(gram, torch.Tensor) and gram.device.type == "cpu" and gram.dtype in (torch.float32, torch.float64)
            and not gram.requires_grad and gram.dim() == 3)


def run_active_set(lib: ctypes.CDLL, gram: torch.Tensor, mask: torch.Tensor, margin: torch.Tensor,
                   error: torch.Tensor, C: float, steps: int, tol: float, ridge: float, settled_factor: float,
                   pivot_backup: int, start_alpha: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """One kernel call on ``G`` problems.

    Parameters
    ----------
    gram : Tensor ``[G, n, n]``  dense, CPU, float32 or float64
    mask, margin, error : bool Tensor ``[G, n]``  valid keys and the starting partition
    C, steps, tol, ridge : as :func:`sv_attention.svdd.warm_fit.active_set_fit`
    settled_factor : float  the known-start test's bound is ``settled_factor * tol * max(1, sqrt(n))``
    pivot_backup : int  block steps allowed after the violator count last reached a new minimum
    start_alpha : Tensor ``[G, n]`` or None  the starting partition's solution when known

    Returns
    -------
    dict with ``alpha [G, n]``, ``g [G, n]``, ``rho [G]`` (float64), ``margin``, ``error`` (bool ``[G, n]``,
    the final partition), ``settled`` (bool ``[G]``) and ``solves`` (long ``[G]``)
    """
    G, n, _ = gram.shape
    gram = gram.contiguous()
    u8 = {name: t.to(torch.uint8).contiguous().clone() for name, t in (("margin", margin), ("error", error))}
    mask_u8 = mask.to(torch.uint8).contiguous()
    start = None if start_alpha is None else start_alpha.to(torch.float64).contiguous()
    alpha = torch.empty(G, n, dtype=torch.float64)
    g = torch.empty(G, n, dtype=torch.float64)
    rho = torch.empty(G, dtype=torch.float64)
    settled = torch.empty(G, dtype=torch.uint8)
    solves = torch.empty(G, dtype=torch.int64)
    failed = lib.sv_active_set(gram.data_ptr(), int(gram.dtype == torch.float64), G, n, mask_u8.data_ptr(),
                               u8["margin"].data_ptr(), u8["error"].data_ptr(), float(C), int(steps), float(tol),
                               float(ridge), float(settled_factor), int(pivot_backup),
                               None if start is None else start.data_ptr(), alpha.data_ptr(), g.data_ptr(),
                               rho.data_ptr(), settled.data_ptr(), solves.data_ptr(), torch.get_num_threads())
    if failed:
        raise MemoryError("sv_active_set: the kernel could not allocate its workspace")
    return {"alpha": alpha, "g": g, "rho": rho, "margin": u8["margin"].bool(), "error": u8["error"].bool(),
            "settled": settled.bool(), "solves": solves}
