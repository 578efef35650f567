"""The active-set iteration of :func:`sv_attention.svdd.warm_fit.active_set_fit` as one C call (CPU, dense Grams).

The torch loop of :func:`~sv_attention.svdd.warm_fit.active_set_fit` is the reference: every problem runs
the same steps here (the bordered solve of the margin block through a Cholesky factor of
``2 K_SS + ridge I``, the KKT gradient, the move rules, the block-principal-pivoting safeguard, the
first step read off a known start), but each problem iterates on its own in float64, so a problem that
settles in 3 steps costs 3 steps however slow its batch neighbours are, and a step costs a few
microseconds instead of ~100 torch calls. The problems are shared out over POSIX threads, as many as
torch's intra-op threads outside the gate's one-thread scope (:func:`sv_attention.threads.outer_threads`).

A solution found through an updated factor is accepted only when its margin residual (``g_i + ridge alpha_i``
on the margin keys, computed from the Gram's rows) is below ``tol / 1000``; otherwise it is solved again from
a fresh factor. Differences from the torch loop, all in the direction of accuracy: arithmetic is float64 whatever the
Gram's dtype (the move tolerance ``tol`` is the caller's, so decisions are the same up to rounding); the
"known start" test is made per problem (the torch loop accepts it for the whole batch or for none); a
Cholesky factor that fails, or a margin set that empties, ends that problem unsettled at once (the torch
loop keeps iterating on non-finite values until it stops; either way the caller's fallback refits it).
tests/svdd/test_active_set_native.py checks solutions, partitions and step counts against the torch loop.
"""

from __future__ import annotations

import ctypes

import torch

from sv_attention.svdd.native_build import C_EXP_NEG_F, C_OPENMP_PROBE, load_kernel
from sv_attention.threads import outer_threads

NAME = "sv_active_set"

SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const void *gram; int is_double; int64_t G, n, pstride, ld;
    int64_t *slot; int64_t slot_stride; const double *diag; const uint8_t *active; uint8_t *need;
    /* a lazy RBF row store: rows are computed here from the keys [G, N, kd] and sigma^2 [G] into free store rows
       (filled [G] of cap), slot[i] set; keys NULL: every needed row is already stored */
    const void *keys; int64_t k_pstride, k_ld, kd, N; const double *s2; int64_t *filled; int64_t cap;
    const uint8_t *mask; uint8_t *margin, *error;
    double C; int64_t steps; double tol, ridge, settled_factor; int64_t pivot_backup;
    const double *start;
    double *alpha, *g, *rho; uint8_t *settled; int64_t *solves;
    int64_t next; int failed;
} job_t;

/* one problem's Gram [n, n], float32 or float64, read in float64: row i is stored at row slot[i] (a lazy
   row store; slot NULL: row i) of a buffer whose rows are ld elements apart (a view into a larger Gram
   needs no copy). Only the rows of margin and error keys are read. A lazy store with keys computes a
   missing row (all N columns, as sv_attention.svdd.gram_rows.LazyRBFGram stores them) on first use. */
typedef struct {
    const float *f; const double *d; int64_t n, ld; int64_t *slot;
    const float *kf; const double *kdb; int64_t kld, kd, N; double s2; int64_t *filled; int64_t cap; double *kn;
    const float *kt;  /* float keys transposed [kd, N]: a row is kd vectorised sweeps over the keys */
    int64_t *len;  /* a chain: columns computed per stored row (rows grow with the boundary); NULL: whole rows */
} gram_t;

""" + C_EXP_NEG_F + r"""
/* the RBF row of key i, exp(-max(|k_i|^2 + |k_j|^2 - 2 k_i.k_j, 0) / sigma^2) for j < N (1 at j = i), into a
   free store row; 0 on success, 1 when the store is full */
/* columns [j0, j1) of key i's RBF row into row (entry (i, j) depends on i and j only: a row computed in pieces
   equals one computed whole, bit for bit) */
static void row_columns(const gram_t *K, int64_t i, void *row_out, int64_t j0, int64_t j1) {
    const int64_t N = K->N, kd = K->kd;
    const double inv = 1.0 / K->s2;
    if (K->kdb) {
        const double *ki = K->kdb + i * K->kld;
        double *row = (double *)row_out;
        for (int64_t j = j0; j < j1; j++) {
            const double *kj = K->kdb + j * K->kld;
            double dot = 0.0;
            for (int64_t t = 0; t < kd; t++) dot += ki[t] * kj[t];
            double d2 = K->kn[i] + K->kn[j] - 2.0 * dot;
            row[j] = exp(-(d2 > 0.0 ? d2 : 0.0) * inv);
        }
        if (i >= j0 && i < j1) row[i] = 1.0;
    } else {
        const float *ki = K->kf + i * K->kld;
        float *row = (float *)row_out;
        memset(row + j0, 0, (size_t)(j1 - j0) * sizeof(float));
        for (int64_t t = 0; t < kd; t++) {  /* k_i . k_j for every j: one sweep per feature */
            const float a = ki[t], *kt = K->kt + t * N;
            for (int64_t j = j0; j < j1; j++) row[j] += a * kt[j];
        }
        const float fi = (float)inv, ni = (float)K->kn[i];
        for (int64_t j = j0; j < j1; j++) {
            float d2 = ni + (float)K->kn[j] - 2.0f * row[j];
            row[j] = exp_neg_f(-(d2 > 0.0f ? d2 : 0.0f) * fi);
        }
        if (i >= j0 && i < j1) row[i] = 1.0f;
    }
}

static inline void *row_ptr(const gram_t *K, int64_t r) {
    return K->d ? (void *)((double *)K->d + r * K->ld) : (void *)((float *)K->f + r * K->ld);
}

/* the RBF row of key i, exp(-max(|k_i|^2 + |k_j|^2 - 2 k_i.k_j, 0) / sigma^2) (1 at j = i), into a free store
   row: all N columns, or (a chain) the first n, grown later by ensure_row; 0 on success, 1 when the store is full */
static int compute_row(gram_t *K, int64_t i) {
    if (*K->filled >= K->cap) return 1;
    int64_t r = (*K->filled)++;
    const int64_t upto = K->len ? K->n : K->N;
    row_columns(K, i, row_ptr(K, r), 0, upto);
    if (K->len) K->len[i] = upto;
    K->slot[i] = r;
    return 0;
}

/* the rows of the keys idx[0..m) (none stored yet), four at a time sharing each sweep over the transposed keys
   (float keys; the same sums in the same order as row_columns: bit for bit its rows); 0 on success, 1 when the
   store is full (the rows that fit are stored) */
static int compute_rows(gram_t *K, const int64_t *idx, int64_t m) {
    int64_t q = 0;
    if (K->kf)
        for (; q + 4 <= m && *K->filled + 4 <= K->cap; q += 4) {
            const int64_t upto = K->len ? K->n : K->N, N = K->N;
            float *r0 = (float *)row_ptr(K, *K->filled), *r1 = (float *)row_ptr(K, *K->filled + 1);
            float *r2 = (float *)row_ptr(K, *K->filled + 2), *r3 = (float *)row_ptr(K, *K->filled + 3);
            const float *k0 = K->kf + idx[q] * K->kld, *k1 = K->kf + idx[q + 1] * K->kld;
            const float *k2 = K->kf + idx[q + 2] * K->kld, *k3 = K->kf + idx[q + 3] * K->kld;
            memset(r0, 0, (size_t)upto * sizeof(float)); memset(r1, 0, (size_t)upto * sizeof(float));
            memset(r2, 0, (size_t)upto * sizeof(float)); memset(r3, 0, (size_t)upto * sizeof(float));
            for (int64_t t = 0; t < K->kd; t++) {
                const float a0 = k0[t], a1 = k1[t], a2 = k2[t], a3 = k3[t], *kt = K->kt + t * N;
                for (int64_t j = 0; j < upto; j++) {
                    const float x = kt[j];
                    r0[j] += a0 * x; r1[j] += a1 * x; r2[j] += a2 * x; r3[j] += a3 * x;
                }
            }
            float *rows[4] = {r0, r1, r2, r3};
            const float fi = (float)(1.0 / K->s2);
            for (int u = 0; u < 4; u++) {
                const int64_t i = idx[q + u];
                float *row = rows[u]; const float ni = (float)K->kn[i];
                for (int64_t j = 0; j < upto; j++) {
                    float d2 = ni + (float)K->kn[j] - 2.0f * row[j];
                    row[j] = exp_neg_f(-(d2 > 0.0f ? d2 : 0.0f) * fi);
                }
                if (i < upto) row[i] = 1.0f;
                if (K->len) K->len[i] = upto;
                K->slot[i] = (*K->filled)++;
            }
        }
    for (; q < m; q++) if (compute_row(K, idx[q])) return 1;
    return 0;
}

/* make row i available over the problem's n columns (computing it into a lazy store when the keys are
   given, or the columns a chain's growing boundary adds); 0 on success */
static inline int ensure_row(gram_t *K, int64_t i) {
    if (!K->slot) return 0;
    if (K->slot[i] >= 0) {
        if (K->len && K->len[i] < K->n) {
            row_columns(K, i, row_ptr(K, K->slot[i]), K->len[i], K->n);
            K->len[i] = K->n;
        }
        return 0;
    }
    if (!K->kf && !K->kdb) return 1;
    return compute_row(K, i);
}

static inline int64_t krow(const gram_t *K, int64_t i) { return K->slot ? K->slot[i] : i; }

static inline double kat(const gram_t *K, int64_t i, int64_t j) {
    int64_t r = krow(K, i);
    return K->d ? K->d[r * K->ld + j] : (double)K->f[r * K->ld + j];
}

static void add_row(const gram_t *K, int64_t i, double c, double *acc) {  /* acc += c K[i, :] */
    const int64_t n = K->n, r = krow(K, i);
    if (K->d) { const double *row = K->d + r * K->ld; for (int64_t j = 0; j < n; j++) acc[j] += c * row[j]; }
    else { const float *row = K->f + r * K->ld; for (int64_t j = 0; j < n; j++) acc[j] += c * (double)row[j]; }
}

typedef struct {
    double *L, *aS, *z1, *z2, *hs, *Kc, *KE, *diag, *kn; int64_t *S, *E, *pos; uint8_t *viol;
    float *kt; const void *keys_of;  /* transposed float keys and norms, and the keys they were computed for */
    /* the state a problem ended in (solve_one): its margin size and whether L / KE still describe its final
       partition (carry), and were computed from scratch (fresh); a chain's next boundary may start from it */
    int64_t last_ns; int last_carry, last_fresh;
    int64_t ldL, capL;  /* the factor's row stride and row capacity: grown (the kept rows copied) as the margin
                           grows, so a factor carries across sizes and stays compact (a stride of the problem
                           size, a power of two, made its rows collide in the caches) */
    int64_t factorizations;  /* Cholesky factorisations from scratch since the caller last reset it */
    int64_t *rowlen; int partial;  /* a chain on a row store: columns computed per key's row (gram_t.len) */
} work_t;

/* room for a factor of m rows, keeping the first `keep` rows of the current one; 0 on success */
static int ensure_factor(work_t *w, int64_t m, int64_t keep) {
    if (m <= w->capL) return 0;
    int64_t cap = 2 * w->capL > m ? 2 * w->capL : m;
    const int64_t ld = cap + 8;  /* off a power of two */
    double *L = malloc((size_t)cap * (size_t)ld * sizeof(double));
    if (!L) return 1;
    for (int64_t i = 0; i < keep; i++) memcpy(L + i * ld, w->L + i * w->ldL, (size_t)(i + 1) * sizeof(double));
    free(w->L);
    w->L = L; w->ldL = ld; w->capL = cap;
    return 0;
}

/* Cholesky factor of the margin block, lower triangle, row-major with leading dimension ld; 0 on success */
static int chol(double *L, int64_t m, int64_t ld) {
    for (int64_t j = 0; j < m; j++) {
        double *rj = L + j * ld, s = rj[j];
        for (int64_t k = 0; k < j; k++) s -= rj[k] * rj[k];
        if (!(s > 0.0)) return 1;
        const double d = sqrt(s), inv = 1.0 / d;  /* one division per column: the inner loop multiplies */
        rj[j] = d;
        for (int64_t i = j + 1; i < m; i++) {
            double *ri = L + i * ld, t = ri[j];
            for (int64_t k = 0; k < j; k++) t -= ri[k] * rj[k];
            ri[j] = t * inv;
        }
    }
    return 0;
}

static void forward(const double *L, int64_t m, int64_t ld, double *x) {  /* x <- L^-1 x */
    for (int64_t i = 0; i < m; i++) {
        const double *ri = L + i * ld; double t = x[i];
        for (int64_t k = 0; k < i; k++) t -= ri[k] * x[k];
        x[i] = t / ri[i];
    }
}

/* x <- (L L^T)^-1 x and y <- (L L^T)^-1 y: both right-hand sides in one pass over L per triangle; the
   backward triangle reads L by rows (x_k -= L_ik x_i for k < i), contiguous, not down its columns */
static void chol_solve2(const double *L, int64_t m, int64_t ld, double *x, double *y) {
    for (int64_t i = 0; i < m; i++) {
        const double *ri = L + i * ld; double t = x[i], u = y[i];
        for (int64_t k = 0; k < i; k++) { t -= ri[k] * x[k]; u -= ri[k] * y[k]; }
        const double inv = 1.0 / ri[i];
        x[i] = t * inv; y[i] = u * inv;
    }
    for (int64_t i = m - 1; i >= 0; i--) {
        const double *ri = L + i * ld, inv = 1.0 / ri[i];
        const double xi = (x[i] *= inv), yi = (y[i] *= inv);
        for (int64_t k = 0; k < i; k++) { x[k] -= ri[k] * xi; y[k] -= ri[k] * yi; }
    }
}

/* Append key j as the last margin slot: L gains the row [l, d], l = L^-1 (2 K_Sj),
   d = sqrt(2 K_jj + ridge - |l|^2). 0 on success (1: not positive definite within rounding). */
static int chol_append(double *L, int64_t m, int64_t ld, const int64_t *S, const gram_t *K, int64_t j,
                       double ridge) {
    double *rm = L + m * ld, s = 2.0 * kat(K, j, j) + ridge;
    for (int64_t k = 0; k < m; k++) rm[k] = 2.0 * kat(K, j, S[k]);
    forward(L, m, ld, rm);
    for (int64_t k = 0; k < m; k++) s -= rm[k] * rm[k];
    if (!(s > 0.0)) return 1;
    rm[m] = sqrt(s);
    return 0;
}

/* Remove slot p: rows below p lose column p, which is folded into the trailing factor by a rank-one
   update (Givens form); rows and columns after p shift up / left by one. x: scratch of m entries. */
static void chol_remove(double *L, int64_t m, int64_t ld, int64_t p, double *x) {
    int64_t R = m - p - 1;
    for (int64_t i = 0; i < R; i++) x[i] = L[(p + 1 + i) * ld + p];
    for (int64_t k = 0; k < R; k++) {
        double *rk = L + (p + 1 + k) * ld + (p + 1);
        double a = rk[k], r = hypot(a, x[k]), c = r / a, s = x[k] / a, ic = a / r;
        rk[k] = r;
        for (int64_t i = k + 1; i < R; i++) {
            double *ri = L + (p + 1 + i) * ld + (p + 1);
            ri[k] = (ri[k] + s * x[i]) * ic;
            x[i] = c * x[i] - s * ri[k];
        }
    }
    for (int64_t i = p + 1; i < m; i++) {  /* shift row i up to i - 1, dropping column p */
        double *src = L + i * ld, *dst = L + (i - 1) * ld;
        for (int64_t k = 0; k < p; k++) dst[k] = src[k];
        for (int64_t k = p + 1; k <= i; k++) dst[k - 1] = src[k];
    }
}

/* carry_from > 0: the workspace holds the factor / K 1_E of the partition mar / err over the first carry_from
   keys (the previous boundary of a chain, whose final partition this start is); keys past it are new */
static void solve_one(job_t *jb, work_t *w, int64_t p, int64_t carry_from) {
    const int64_t n = jb->n;
    const double C = jb->C, tol = jb->tol, ridge = jb->ridge;
    gram_t K = {NULL, NULL, n, jb->ld, jb->slot ? jb->slot + p * jb->slot_stride : NULL,
                NULL, NULL, jb->k_ld, jb->kd, jb->N, 0.0, NULL, jb->cap, w->kn, NULL, NULL};
    if (w->partial && jb->keys) K.len = w->rowlen;
    if (jb->is_double) K.d = (const double *)jb->gram + p * jb->pstride;
    else K.f = (const float *)jb->gram + p * jb->pstride;
    if (jb->keys) {  /* squared norms of the keys, for the rows computed here */
        if (jb->is_double) K.kdb = (const double *)jb->keys + p * jb->k_pstride;
        else K.kf = (const float *)jb->keys + p * jb->k_pstride;
        K.s2 = jb->s2[p]; K.filled = jb->filled + p; K.kt = w->kt;
        const void *keys_p = K.kdb ? (const void *)K.kdb : (const void *)K.kf;
        if (w->keys_of != keys_p) {  /* once per problem (a chain's boundaries share its keys) */
            for (int64_t j = 0; j < jb->N; j++) {
                double s = 0.0;
                for (int64_t t = 0; t < jb->kd; t++) {
                    double x = K.kdb ? K.kdb[j * K.kld + t] : (double)K.kf[j * K.kld + t];
                    s += x * x;
                    if (K.kf) w->kt[t * jb->N + j] = K.kf[j * K.kld + t];
                }
                w->kn[j] = s;
            }
            w->keys_of = keys_p;
        }
    }
    const uint8_t *mask = jb->mask + p * n;
    uint8_t *mar = jb->margin + p * n, *err = jb->error + p * n;
    const double *start = jb->start ? jb->start + p * n : NULL;
    double *g = jb->g + p * n;
    int64_t best = n + 1, backup = jb->pivot_backup, run = 0, solves = 0, ns = 0;
    double rho = 0.0;
    int ok = 1, settled = 0;
    /* factored: w->L is the factor of the margin block in the slot order w->S and w->KE = K 1_E, both kept
       across steps by updates while few keys move; fresh: both were computed from scratch */
    int factored = 0, fresh = 0;
    int need = 0;  /* a key without a stored row must join the margin: stop, the caller adds its row */
    for (int64_t i = 0; i < n; i++) {
        mar[i] &= mask[i]; err[i] &= mask[i];
        w->diag[i] = jb->diag ? jb->diag[p * n + i] : kat(&K, i, i);
    }
    if (carry_from > 0) {  /* the new keys: not on the margin; K 1_E extended to their columns */
        factored = 1; fresh = w->last_fresh; ns = w->last_ns;
        if (K.len)  /* the rows read (margin and error keys) gain the new columns */
            for (int64_t i = 0; i < carry_from; i++) if (mar[i] || err[i]) ensure_row(&K, i);
        for (int64_t i = carry_from; i < n; i++) { w->pos[i] = -1; w->KE[i] = 0.0; }
        for (int64_t e = 0; e < carry_from; e++) {
            if (!err[e]) continue;
            const int64_t r = krow(&K, e);
            if (K.d) { const double *row = K.d + r * K.ld; for (int64_t i = carry_from; i < n; i++) w->KE[i] += row[i]; }
            else { const float *row = K.f + r * K.ld; for (int64_t i = carry_from; i < n; i++) w->KE[i] += (double)row[i]; }
        }
    }
    for (;;) {
        int64_t ne = 0;
        for (int64_t i = 0; i < n; i++) ne += err[i];
        if (!factored) {  /* margin slots in index order, K 1_E summed anew */
            ns = 0;
            if (K.slot && (K.kf || K.kdb)) {  /* the missing rows first, computed together */
                int64_t miss = 0;
                for (int64_t i = 0; i < n; i++) if ((mar[i] || err[i]) && K.slot[i] < 0) w->E[miss++] = i;
                if (compute_rows(&K, w->E, miss)) need = 1;
            }
            for (int64_t i = 0; i < n; i++) {
                w->pos[i] = -1;
                if ((mar[i] || err[i]) && ensure_row(&K, i)) need = 1;
                if (mar[i]) { w->pos[i] = ns; w->S[ns++] = i; }
            }
            if (need) { settled = 0; break; }
            memset(w->KE, 0, (size_t)n * sizeof(double));
            for (int64_t i = 0; i < n; i++) if (err[i]) add_row(&K, i, 1.0, w->KE);
        }
        if (ns == 0) { ok = 0; settled = 0; break; }  /* an empty margin: unsettled (the caller refits) */
        int known = 0;
        if (run == 0 && start) {  /* the starting partition's solution may be known: no solve */
            memset(w->Kc, 0, (size_t)n * sizeof(double));
            for (int64_t k = 0; k < ns; k++) { w->aS[k] = start[w->S[k]]; add_row(&K, w->S[k], w->aS[k], w->Kc); }
            double sum_r = 0.0, mass = C * (double)ne - 1.0;
            for (int64_t k = 0; k < ns; k++) {
                int64_t i = w->S[k];
                w->hs[k] = w->diag[i] - 2.0 * (w->Kc[i] + C * w->KE[i]) - ridge * w->aS[k];
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
            /* [[0, 1^T], [1, M]] [rho; a] = [1 - C |E|; h_S], M = 2 K_SS + ridge I, h_S = diag_S - 2 C (K 1_E)_S */
            if (!factored) {
                if (ensure_factor(w, ns, 0)) { __atomic_store_n(&jb->failed, 1, __ATOMIC_SEQ_CST); ok = 0; break; }
                for (int64_t a = 0; a < ns; a++) {
                    double *La = w->L + a * w->ldL;
                    for (int64_t b = 0; b <= a; b++) La[b] = 2.0 * kat(&K, w->S[a], w->S[b]);
                    La[a] += ridge;
                }
                w->factorizations++;
                if (chol(w->L, ns, w->ldL)) { solves++; ok = 0; settled = 0; break; }
                factored = fresh = 1;
            }
            for (int64_t a = 0; a < ns; a++) {
                w->z1[a] = w->diag[w->S[a]] - 2.0 * C * w->KE[w->S[a]];
                w->z2[a] = 1.0;
            }
            solves++;
            chol_solve2(w->L, ns, w->ldL, w->z1, w->z2);
            double s1 = 0.0, s2 = 0.0;
            for (int64_t k = 0; k < ns; k++) { s1 += w->z1[k]; s2 += w->z2[k]; }
            rho = (s1 - (1.0 - C * (double)ne)) / s2;
            ok = isfinite(rho);
            memset(w->Kc, 0, (size_t)n * sizeof(double));
            for (int64_t k = 0; k < ns; k++) {
                w->aS[k] = w->z1[k] - rho * w->z2[k];
                ok = ok && isfinite(w->aS[k]);
                add_row(&K, w->S[k], w->aS[k], w->Kc);
            }
        }
        /* KKT gradient g = rho - K_ii + 2 (K alpha)_i, K alpha = K_S alpha_S + C K 1_E */
        for (int64_t i = 0; i < n; i++) g[i] = rho - w->diag[i] + 2.0 * (w->Kc[i] + C * w->KE[i]);
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
        if (nviol == 0 && !known && !fresh) {
            /* a solve through an updated factor is accepted when it solves its system as a fresh one does:
               g_i = -ridge alpha_i on the margin (g from the Gram's rows, not from the factor) */
            double resid = 0.0;
            for (int64_t k = 0; k < ns; k++) resid = fmax(resid, fabs(g[w->S[k]] + ridge * w->aS[k]));
            if (!(resid <= 1e-3 * tol)) { factored = 0; continue; }  /* else solve again from a fresh factor */
        }
        if (nviol == 0 || run >= jb->steps) { settled = (nviol == 0) && ok; break; }
        /* block principal pivoting: every violator while their count reaches a new minimum (or backups
           are left), else only the largest one */
        int improved = nviol < best, block = improved || backup > 0;
        backup = improved ? jb->pivot_backup : (backup > 0 ? backup - 1 : 0);
        if (nviol < best) best = nviol;
        /* the moves: viol[i] = 1 joins the margin, 2 leaves it for R, 3 leaves it for E */
        int64_t moves = 0;
        for (int64_t i = 0; i < n; i++) {
            if (!w->viol[i] || !(block || i == top)) { w->viol[i] = 0; continue; }
            moves++;
            if (mar[i]) w->viol[i] = (w->aS[w->pos[i]] / C > 1.0) ? 3 : 2;
        }
        /* few moves: update the factor (O(|S|^2) each) and K 1_E instead of recomputing them */
        int update = factored && 8 * moves <= ns + 8;
        if (K.slot) {
            if (K.kf || K.kdb) {  /* the missing rows of the keys joining the margin, computed together */
                int64_t miss = 0;
                for (int64_t i = 0; i < n; i++) if (w->viol[i] == 1 && K.slot[i] < 0) w->E[miss++] = i;
                if (compute_rows(&K, w->E, miss)) { need = 1; update = 0; }
            }
            for (int64_t i = 0; i < n; i++) if (w->viol[i] == 1 && ensure_row(&K, i)) { need = 1; update = 0; }
        }
        for (int64_t i = 0; i < n; i++) {  /* margin keys leave first */
            if (w->viol[i] < 2) continue;
            mar[i] = 0; err[i] = w->viol[i] == 3;
            if (!update) continue;
            int64_t slot = w->pos[i];
            chol_remove(w->L, ns, w->ldL, slot, w->hs);
            for (int64_t k = slot + 1; k < ns; k++) { w->S[k - 1] = w->S[k]; w->pos[w->S[k - 1]] = k - 1; }
            ns--;
            w->pos[i] = -1;
            if (err[i]) add_row(&K, i, 1.0, w->KE);
        }
        for (int64_t i = 0; i < n; i++) {
            if (w->viol[i] != 1) continue;
            int was_error = err[i];
            err[i] = 0; mar[i] = 1;
            if (update && ensure_factor(w, ns + 1, ns)) { __atomic_store_n(&jb->failed, 1, __ATOMIC_SEQ_CST); update = 0; }
            if (update && chol_append(w->L, ns, w->ldL, w->S, &K, i, ridge)) update = 0;
            if (update) {
                w->S[ns] = i; w->pos[i] = ns; ns++;
                if (was_error) add_row(&K, i, -1.0, w->KE);
            }
        }
        if (update) fresh = 0;
        else factored = 0;
        run++;
        if (need) { settled = 0; break; }
    }
    double *alpha = jb->alpha + p * n;
    for (int64_t i = 0; i < n; i++)
        alpha[i] = (mar[i] && w->pos[i] >= 0 && w->pos[i] < ns) ? w->aS[w->pos[i]] : (err[i] ? C : 0.0);
    jb->rho[p] = rho;
    jb->settled[p] = (uint8_t)(settled && ok && !need);
    jb->solves[p] = solves;
    if (jb->need) jb->need[p] = (uint8_t)need;
    w->last_ns = ns; w->last_carry = factored && settled && ok && !need; w->last_fresh = fresh;
}

static int work_alloc(work_t *w, int64_t n, int64_t N, int64_t kd) {  /* 0 on success */
    w->kt = malloc((size_t)(N > 0 ? N : 1) * (size_t)(kd > 0 ? kd : 1) * sizeof(float));
    w->keys_of = NULL;
    w->capL = n < 128 ? (n > 0 ? n : 1) : 128;
    w->ldL = w->capL + 8;
    w->L = malloc((size_t)w->capL * (size_t)w->ldL * sizeof(double));
    w->factorizations = 0;
    w->aS = malloc(8 * (size_t)n * sizeof(double));
    w->kn = malloc((size_t)(N > 0 ? N : 1) * sizeof(double));
    w->S = malloc(3 * (size_t)n * sizeof(int64_t));
    w->rowlen = malloc((size_t)(N > 0 ? N : 1) * sizeof(int64_t)); w->partial = 0;
    w->viol = malloc((size_t)n);
    if (!w->L || !w->aS || !w->kn || !w->S || !w->viol || !w->kt || !w->rowlen) return 1;
    w->z1 = w->aS + n; w->z2 = w->aS + 2 * n; w->hs = w->aS + 3 * n; w->Kc = w->aS + 4 * n;
    w->KE = w->aS + 5 * n; w->diag = w->aS + 6 * n;
    w->E = w->S + n; w->pos = w->S + 2 * n;
    return 0;
}

static void work_free(work_t *w) {
    free(w->L); free(w->aS); free(w->kn); free(w->S); free(w->viol); free(w->kt); free(w->rowlen);
}

static void *worker(void *arg) {
    job_t *jb = (job_t *)arg;
    work_t w;
    if (work_alloc(&w, jb->n, jb->N, jb->kd)) {
        __atomic_store_n(&jb->failed, 1, __ATOMIC_SEQ_CST);
    } else {
        for (;;) {
            int64_t p = __atomic_fetch_add(&jb->next, 1, __ATOMIC_SEQ_CST);
            if (p >= jb->G) break;
            if (!jb->active || jb->active[p]) solve_one(jb, &w, p, 0);
        }
    }
    work_free(&w);
    return NULL;
}

/* fn(arg) on `threads` threads (each takes units from a shared counter): the OpenMP pool torch uses where the
   kernel was built with OpenMP (its workers are usually spinning from torch's last operation: no thread
   competes with them), else POSIX threads started here */
static int run_threads(void *(*fn)(void *), void *arg, int64_t units, int64_t threads) {
    if (threads > units) threads = units;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
#ifdef _OPENMP
    #pragma omp parallel num_threads((int)threads)
    { fn(arg); }
#else
    pthread_t tid[64];
    int64_t started = 0;
    for (int64_t t = 1; t < threads; t++) {
        if (pthread_create(&tid[t], NULL, fn, arg) != 0) break;
        started = t;
    }
    fn(arg);
    for (int64_t t = 1; t <= started; t++) pthread_join(tid[t], NULL);
#endif
    return 0;
}

""" + C_OPENMP_PROBE + r"""
/* A chain of boundaries s_0 < s_1 < ... of a dense Gram [G, N, N] (rows ld apart): boundary b solves the
   problem of the first s_b keys, started from boundary b - 1's gate (its partition, the new keys in reserve,
   the gate as the known start; boundary 0: the given partition and start). */
typedef struct {
    job_t base;  /* the shared settings; its per-problem arrays are unused */
    int64_t B; const int64_t *bounds; const uint8_t *ones;
    uint8_t *margins, *errors;  /* [G, B, N] the final partition of every boundary */
    int64_t *factorizations;  /* [G, B] factorisations from scratch per boundary (the carried factor saves them) */
    const double *diag_ones;  /* [N] the diagonal of a lazy RBF store's Gram */
} chain_t;

static void *chain_worker(void *arg) {
    chain_t *ch = (chain_t *)arg;
    job_t *jb = &ch->base;
    const int64_t N = jb->N, B = ch->B;
    work_t w;
    double *st = malloc((size_t)(N > 0 ? N : 1) * sizeof(double));
    if (work_alloc(&w, N, N, jb->kd) || !st) {
        __atomic_store_n(&jb->failed, 1, __ATOMIC_SEQ_CST);
        work_free(&w);
        free(st);
        return NULL;
    }
    /* the partition of a previous gate, read as sv_attention.svdd.warm_fit.partition_from_alpha reads it from
       the gate the boundary-by-boundary path hands on (clamped at 0, in the Gram's dtype) */
    const double at_c = jb->is_double ? jb->C * (1.0 - 1e-6) : (double)(float)(jb->C * (1.0 - 1e-6));
    for (;;) {
        int64_t p = __atomic_fetch_add(&jb->next, 1, __ATOMIC_SEQ_CST);
        if (p >= jb->G) break;
        uint8_t *mar = jb->margin + p * N, *err = jb->error + p * N;
        int64_t *slot_p = jb->keys ? jb->slot + p * jb->slot_stride : NULL;
        /* a row store: rows computed here grow with the boundaries (rows stored before are whole) */
        w.partial = slot_p != NULL;
        if (slot_p) for (int64_t i = 0; i < N; i++) w.rowlen[i] = slot_p[i] >= 0 ? N : 0;
        for (int64_t b = 0; b < B; b++) {
            int64_t q = p * B + b;
            job_t sub = *jb;  /* one problem: the first s_b keys of problem p */
            sub.G = 1; sub.n = ch->bounds[b]; sub.N = 0; sub.keys = NULL; sub.slot = NULL; sub.diag = NULL;
            sub.active = NULL; sub.need = NULL;
            if (jb->keys) {  /* a lazy store: rows computed on first use (a full store leaves a problem unsettled) */
                sub.keys = jb->is_double ? (const void *)((const double *)jb->keys + p * jb->k_pstride)
                                         : (const void *)((const float *)jb->keys + p * jb->k_pstride);
                sub.k_pstride = 0; sub.N = jb->N; sub.s2 = jb->s2 + p; sub.filled = jb->filled + p;
                sub.slot = jb->slot + p * jb->slot_stride; sub.slot_stride = 0; sub.diag = ch->diag_ones;
            }
            sub.gram = jb->is_double ? (const void *)((const double *)jb->gram + p * jb->pstride)
                                     : (const void *)((const float *)jb->gram + p * jb->pstride);
            sub.mask = ch->ones; sub.margin = mar; sub.error = err;
            int64_t carry = 0;
            if (b == 0) sub.start = jb->start ? jb->start + p * N : NULL;
            else {
                const double *prev = jb->alpha + (q - 1) * N;
                int same = 1;
                for (int64_t i = 0; i < N; i++) {
                    double a = prev[i] > 0.0 ? prev[i] : 0.0;
                    if (!jb->is_double) a = (double)(float)a;
                    st[i] = a;
                    uint8_t e = a >= at_c, m = a > 0.0 && !e;
                    same = same && e == err[i] && m == mar[i];
                    err[i] = e; mar[i] = m;
                }
                sub.start = st;
                /* the partition read off the gate is the one the previous boundary ended in: its factor carries */
                if (same && w.last_carry) carry = ch->bounds[b - 1];
            }
            sub.alpha = jb->alpha + q * N; sub.g = jb->g + q * N;
            sub.rho = jb->rho + q; sub.settled = jb->settled + q; sub.solves = jb->solves + q;
            solve_one(&sub, &w, 0, carry);
            if (sub.failed) __atomic_store_n(&jb->failed, 1, __ATOMIC_SEQ_CST);  /* (sub is a copy) */
            const int64_t n = ch->bounds[b];  /* past the boundary: alpha and g are 0 (the outputs come uninitialised) */
            memset(sub.alpha + n, 0, (size_t)(N - n) * sizeof(double));
            memset(sub.g + n, 0, (size_t)(N - n) * sizeof(double));
            memcpy(ch->margins + q * N, mar, (size_t)N);
            memcpy(ch->errors + q * N, err, (size_t)N);
            ch->factorizations[q] = w.factorizations;
            w.factorizations = 0;
        }
        /* rows the chain left short of N columns are dropped from the store (a later reader recomputes them) */
        if (slot_p) for (int64_t i = 0; i < N; i++) if (slot_p[i] >= 0 && w.rowlen[i] < N) slot_p[i] = -1;
        w.partial = 0;
    }
    work_free(&w);
    free(st);
    return NULL;
}

int sv_active_set_chain(const void *gram, int is_double, int64_t G, int64_t N, int64_t pstride, int64_t ld,
                        int64_t *slot, int64_t slot_stride, const void *keys, int64_t k_pstride, int64_t k_ld,
                        int64_t kd, const double *s2, int64_t *filled, int64_t cap, const double *diag_ones,
                        int64_t B, const int64_t *bounds, const uint8_t *ones, uint8_t *margin, uint8_t *error,
                        double C, int64_t steps, double tol, double ridge, double settled_factor,
                        int64_t pivot_backup, const double *start, double *alpha, double *g, double *rho,
                        uint8_t *settled, int64_t *solves, uint8_t *margins, uint8_t *errors,
                        int64_t *factorizations, int64_t threads) {
    job_t base = {gram, is_double, G, N, pstride, ld, slot, slot_stride, NULL, NULL, NULL, keys, k_pstride, k_ld, kd,
                  N, s2, filled, cap, ones, margin, error, C, steps, tol, ridge, settled_factor, pivot_backup, start,
                  alpha, g, rho, settled, solves, 0, 0};
    chain_t ch = {base, B, bounds, ones, margins, errors, factorizations, diag_ones};
    run_threads(chain_worker, &ch, G, threads);
    return ch.base.failed;
}

int sv_active_set(const void *gram, int is_double, int64_t G, int64_t n, int64_t pstride, int64_t ld,
                  int64_t *slot, int64_t slot_stride, const double *diag, const uint8_t *active,
                  uint8_t *need, const void *keys, int64_t k_pstride, int64_t k_ld, int64_t kd, int64_t N,
                  const double *s2, int64_t *filled, int64_t cap, const uint8_t *mask, uint8_t *margin,
                  uint8_t *error, double C, int64_t steps, double tol, double ridge, double settled_factor,
                  int64_t pivot_backup, const double *start, double *alpha, double *g, double *rho,
                  uint8_t *settled, int64_t *solves, int64_t threads) {
    job_t jb = {gram, is_double, G, n, pstride, ld, slot, slot_stride, diag, active, need, keys, k_pstride, k_ld, kd,
                N, s2, filled, cap, mask, margin, error, C, steps, tol, ridge, settled_factor, pivot_backup,
                start, alpha, g, rho, settled, solves, 0, 0};
    run_threads(worker, &jb, G, threads);
    return jb.failed;
}
"""

_i64, _f64, _ptr = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p


def kernel() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use), or None where it cannot be built (reported once)."""
    lib = load_kernel(NAME, SOURCE)
    if lib is not None and not getattr(lib, "_sv_typed", False):
        lib.sv_active_set.restype = ctypes.c_int
        lib.sv_active_set.argtypes = [_ptr, ctypes.c_int, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr,
                                      _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _f64, _i64, _f64, _f64, _f64,
                                      _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64]
        lib.sv_active_set_chain.restype = ctypes.c_int
        lib.sv_active_set_chain.argtypes = [_ptr, ctypes.c_int, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64,
                                            _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr,
                                            _f64, _i64, _f64, _f64, _f64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr,
                                            _ptr, _ptr, _ptr, _i64]
        lib._sv_typed = True
    return lib


#: Kernel calls on a lazy row store before problems still asking for rows are left unsettled (a call stops a
#: problem that finds the store full; the store then doubles and it resumes).
LAZY_ROUNDS = 16


def _is_lazy(gram: object) -> bool:
    from sv_attention.svdd.gram_rows import LazyPrefix

    return isinstance(gram, LazyPrefix)


def _row_store_inputs(parent) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel reads to compute a :class:`~sv_attention.svdd.gram_rows.LazyRBFGram`'s rows: its keys
    (unit-stride features) and ``sigma^2`` per problem in float64."""
    keys = parent.keys if parent.keys.stride(-1) == 1 else parent.keys.contiguous()
    if keys.dtype != parent.store.dtype:
        raise TypeError("the lazy row store and its keys must share a dtype")
    return keys, (parent.sigma.to(torch.float64) ** 2).contiguous()


def supports(gram: object) -> bool:
    """Whether the kernel can run on ``gram``: a dense CPU float32 / float64 Tensor ``[G, n, n]`` without autograd,
    or a lazy row provider over such keys (:class:`sv_attention.svdd.gram_rows.LazyPrefix`)."""
    if _is_lazy(gram):
        keys = gram.parent.keys
        return keys.device.type == "cpu" and keys.dtype in (torch.float32, torch.float64)
    return (isinstance(gram, torch.Tensor) and gram.device.type == "cpu" and gram.dtype in (torch.float32, torch.float64)
            and not gram.requires_grad and gram.dim() == 3)


def run_active_set(lib: ctypes.CDLL, gram, mask: torch.Tensor, margin: torch.Tensor,
                   error: torch.Tensor, C: float, steps: int, tol: float, ridge: float, settled_factor: float,
                   pivot_backup: int, start_alpha: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The kernel on ``G`` problems.

    Parameters
    ----------
    gram : Tensor ``[G, n, n]``  dense, CPU, float32 or float64; any strides with contiguous rows (a slice of a
        larger Gram is read in place); or a :class:`~sv_attention.svdd.gram_rows.LazyPrefix`: the kernel reads
        its stored rows in place and computes a missing row into the store's free rows; a problem that finds
        the store full stops, the store doubles and it resumes from its partition (at most
        :data:`LAZY_ROUNDS` calls; a problem still waiting is returned unsettled)
    mask, margin, error : bool Tensor ``[G, n]``  valid keys and the starting partition
    C, steps, tol, ridge : as :func:`sv_attention.svdd.warm_fit.active_set_fit`
    settled_factor : float  the known-start test's bound is ``settled_factor * tol * max(1, sqrt(n))``
    pivot_backup : int  block steps allowed after the violator count last reached a new minimum
    start_alpha : Tensor ``[G, n]`` or None  the starting partition's solution when known

    Returns
    -------
    dict with ``alpha [G, n]``, ``g [G, n]``, ``rho [G]`` (float64), ``margin``, ``error`` (bool ``[G, n]``,
    the final partition), ``settled`` (bool ``[G]``) and ``solves`` (long ``[G]``, summed over the calls)
    """
    G, n, _ = gram.shape
    lazy = _is_lazy(gram)
    if not lazy and gram.stride(2) != 1:  # rows must be contiguous; other problem / row strides are read in place
        gram = gram.contiguous()
    u8 = {name: t.to(torch.uint8).contiguous().clone() for name, t in (("margin", margin), ("error", error))}
    mask_u8 = mask.to(torch.uint8).contiguous()
    start = None if start_alpha is None else start_alpha.to(torch.float64).contiguous()
    alpha = torch.zeros(G, n, dtype=torch.float64)
    g = torch.zeros(G, n, dtype=torch.float64)
    rho = torch.zeros(G, dtype=torch.float64)
    settled = torch.zeros(G, dtype=torch.uint8)
    solves = torch.zeros(G, dtype=torch.int64)
    total = torch.zeros(G, dtype=torch.int64)
    need = torch.zeros(G, dtype=torch.uint8)
    active: torch.Tensor | None = None
    diag = gram.diagonal().to(torch.float64).contiguous() if lazy else None
    if lazy:
        parent = gram.parent
        keys, s2 = _row_store_inputs(parent)
    for _ in range(LAZY_ROUNDS if lazy else 1):
        if lazy:
            # the kernel computes the missing rows into the free rows of the store; a full store stops the problems
            # that need more (need), the store doubles and they resume from their partition
            store, slot = parent.store, parent.slot
            filled_before = parent.filled.clone()
            key_args = (keys.data_ptr(), keys.stride(0), keys.stride(1), keys.shape[2], keys.shape[1], s2.data_ptr(),
                        parent.filled.data_ptr(), store.shape[1])
            buf, pstride, ld = store, store.stride(0), store.stride(1)
            slot_ptr, slot_stride = slot.data_ptr(), slot.stride(0)
        else:
            key_args = (None, 0, 0, 0, 0, None, None, 0)
            buf, pstride, ld, slot_ptr, slot_stride = gram, gram.stride(0), gram.stride(1), None, 0
        failed = lib.sv_active_set(buf.data_ptr(), int(buf.dtype == torch.float64), G, n, pstride, ld, slot_ptr,
                                   slot_stride, None if diag is None else diag.data_ptr(),
                                   None if active is None else active.data_ptr(), need.data_ptr(), *key_args,
                                   mask_u8.data_ptr(), u8["margin"].data_ptr(), u8["error"].data_ptr(), float(C),
                                   int(steps), float(tol), float(ridge), float(settled_factor), int(pivot_backup),
                                   None if start is None else start.data_ptr(), alpha.data_ptr(), g.data_ptr(),
                                   rho.data_ptr(), settled.data_ptr(), solves.data_ptr(), outer_threads())
        if failed:
            raise MemoryError("sv_active_set: the kernel could not allocate its workspace")
        total += solves if active is None else solves * active
        if not lazy:
            break
        parent.rows_computed += int((parent.filled - filled_before).sum())
        if not bool(need.any()):
            break
        parent.reserve(2 * parent.store.shape[1])
        active, start = need.clone(), None  # the waiting problems resume from their partition (no known start)
    return {"alpha": alpha, "g": g, "rho": rho, "margin": u8["margin"].bool(), "error": u8["error"].bool(),
            "settled": settled.bool() & ~need.bool(), "solves": total}


def run_active_set_chain(lib: ctypes.CDLL, gram, bounds: list[int], margin: torch.Tensor,
                         error: torch.Tensor, C: float, steps: int, tol: float, ridge: float, settled_factor: float,
                         pivot_backup: int, start_alpha: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """A chain of boundaries in one kernel call: boundary ``b`` solves the problem of the first ``bounds[b]``
    keys, started from boundary ``b - 1``'s gate (clamped at 0 and rounded to the Gram's dtype, as the gate
    the boundary-by-boundary path hands on; its partition by
    :func:`~sv_attention.svdd.warm_fit.partition_from_alpha`, the new keys in reserve, the gate as the known
    start), exactly what successive :func:`run_active_set` calls on ``gram[:, :s, :s]`` do, without a Python
    round trip per boundary.

    Parameters
    ----------
    gram : Tensor ``[G, N, N]``  dense CPU float32 / float64 with contiguous rows; ``N >= bounds[-1]``; or a
        :class:`~sv_attention.svdd.gram_rows.LazyPrefix` of ``N`` keys whose parent holds ``N`` keys: its store
        is grown to ``N`` rows (memory is touched only by the rows computed) and the kernel computes the rows
        the fits read
    bounds : list of int  increasing boundary sizes
    margin, error : bool Tensor ``[G, N]``  the first boundary's starting partition (False past ``bounds[0]``)
    start_alpha : Tensor ``[G, N]`` or None  its solution when known

    Returns
    -------
    dict with ``alpha`` and ``g`` ``[G, B, N]`` (float64, zero past each boundary), ``rho``, ``solves``,
    ``factorizations`` ``[G, B]`` (Cholesky factorisations from scratch: a boundary that starts from the
    previous one's final partition carries its factor), ``settled`` bool ``[G, B]``, ``margin`` / ``error``
    bool ``[G, B, N]`` (each final partition)
    """
    G, N, _ = gram.shape
    B = len(bounds)
    if B == 0 or any(not 0 < a < b for a, b in zip(bounds, bounds[1:])) or bounds[0] < 1 or bounds[-1] > N:
        raise ValueError(f"run_active_set_chain: bounds must increase within 1..{N}, got {bounds}")
    lazy = _is_lazy(gram)
    if lazy:
        parent = gram.parent
        if parent.keys.shape[1] != N:
            raise ValueError("run_active_set_chain: a lazy Gram's parent must hold exactly the chain's keys")
        parent.reserve(N)
        keys, s2 = _row_store_inputs(parent)
        buf, filled_before = parent.store, parent.filled.clone()
        diag_ones = torch.ones(N, dtype=torch.float64)
        lazy_args = (parent.slot.data_ptr(), parent.slot.stride(0), keys.data_ptr(), keys.stride(0), keys.stride(1),
                     keys.shape[2], s2.data_ptr(), parent.filled.data_ptr(), buf.shape[1], diag_ones.data_ptr())
    else:
        buf = gram if gram.stride(2) == 1 else gram.contiguous()
        lazy_args = (None, 0, None, 0, 0, 0, None, None, 0, None)
    first = torch.arange(N, device=buf.device) < bounds[0]
    work = {name: (t & first).to(torch.uint8).contiguous().clone() for name, t in (("margin", margin), ("error", error))}
    start = None if start_alpha is None else start_alpha.to(torch.float64).contiguous()
    ones = torch.ones(N, dtype=torch.uint8)
    bounds_t = torch.tensor(bounds, dtype=torch.int64)
    # every entry of the outputs is written by the kernel (alpha and g zero past each boundary)
    alpha = torch.empty(G, B, N, dtype=torch.float64)
    g = torch.empty(G, B, N, dtype=torch.float64)
    rho = torch.empty(G, B, dtype=torch.float64)
    settled = torch.empty(G, B, dtype=torch.uint8)
    solves = torch.empty(G, B, dtype=torch.int64)
    margins = torch.empty(G, B, N, dtype=torch.uint8)
    errors = torch.empty(G, B, N, dtype=torch.uint8)
    factorizations = torch.empty(G, B, dtype=torch.int64)
    failed = lib.sv_active_set_chain(buf.data_ptr(), int(buf.dtype == torch.float64), G, N, buf.stride(0),
                                     buf.stride(1), *lazy_args, B, bounds_t.data_ptr(), ones.data_ptr(),
                                     work["margin"].data_ptr(), work["error"].data_ptr(), float(C), int(steps),
                                     float(tol), float(ridge), float(settled_factor), int(pivot_backup),
                                     None if start is None else start.data_ptr(), alpha.data_ptr(), g.data_ptr(),
                                     rho.data_ptr(), settled.data_ptr(), solves.data_ptr(), margins.data_ptr(),
                                     errors.data_ptr(), factorizations.data_ptr(), outer_threads())
    if failed:
        raise MemoryError("sv_active_set_chain: the kernel could not allocate its workspace")
    if lazy:
        parent.rows_computed += int((parent.filled - filled_before).sum())
    # (the kernel writes 0 / 1 bytes: read as bool in place)
    return {"alpha": alpha, "g": g, "rho": rho, "settled": settled.bool(), "solves": solves,
            "margin": margins.view(torch.bool), "error": errors.view(torch.bool), "factorizations": factorizations}
