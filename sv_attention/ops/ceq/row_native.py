"""The sgate decoding row of the ceq hop engine as one C call (CPU, float32 / float64).

:func:`sv_attention.ops.ceq.engine._sgate_decode_row` computes one decoding query's stock softmax, the
sgate row ``A = c softmax(sc w) - c lam softmax(-sc w)`` over the strictly earlier keys (``c = rho / (1 +
lam)``), ``y_1 = A v`` and every further hop ``y_{h+1} = A y_h`` over the hop history, in about 20 torch
operations, each a dispatch and a pass over ``kv_len`` entries. This kernel makes, per (sequence, kv head),
one pass over the keys for the logits of the query heads that share the kv head and one pass for all the
outputs, in blocks of :data:`BLOCK` keys so that each block of keys and values is read from memory once
for all those query heads (the values serve the stock output and ``y_1``); each history row is read once. The torch row stays the reference
(``tests/ops/test_ceq_row_native.py`` checks the two against each other and the prefill) and the path
wherever the kernel cannot run (no compiler, ``SV_ATTENTION_NATIVE=0``, another device or dtype, a strided
last dimension, a value head size over 256).

Arithmetic is in the inputs' dtype, like the torch row; float32 uses a vectorisable ``exp`` (Cephes'
polynomial, relative error about 1e-7), float64 the C library's.
"""

from __future__ import annotations

import ctypes

import torch

from sv_attention.svdd.native_build import C_EXP_NEG_F, C_OPENMP_PROBE, load_kernel, uses_openmp
from sv_attention.threads import outer_threads

NAME = "sv_ceq_row"

#: Threads per row: torch's intra-op count where the kernel was built with OpenMP (it then runs on torch's own
#: pool: in a 4-layer Llama at 2048 keys the decode went from 1.61x to 1.44x sdpa against the torch row), one
#: where it starts POSIX threads (those compete with torch's spinning workers: 575 us per row with two, 356 us
#: with one, measured at 2048 keys). None: that rule; an int: a fixed count.
ROW_THREADS: int | None = None
#: Keys per block (a block of keys and values, 2 x BLOCK x head size values, stays in the L1 cache).
BLOCK = 64
#: Largest value head size the kernel takes (its accumulators live on the stack).
MAX_VALUE_DIM = 256

SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

""" + C_OPENMP_PROBE + r"""
#define BLOCK """ + str(BLOCK) + r"""
#define MAXDV """ + str(MAX_VALUE_DIM) + r"""
#define MAXR 64

""" + C_EXP_NEG_F + r"""
static inline double exp_neg_d(double x) { return exp(x); }

typedef struct {
    int64_t B, H, HKV, d, dv, e, nstore;
    const void *q; int64_t q_sb, q_sh;
    const void *k; int64_t k_sb, k_sh, k_st;
    const void *v; int64_t v_sb, v_sh, v_st;
    void *const *stores; const int64_t *st_strides;  /* per history buffer: (batch, head, row) strides */
    double sc, c_plus, c_minus; int with_stock;
    void *out0, *ylast;  /* [B, H, dv] contiguous */
    int64_t next; int failed;
} row_job_t;

/* one (sequence, kv head) and its r = H / HKV query heads. scr: 3 r e values of T (logits, then the stock
   weights; A's + part, then A; A's - part). D / DV: head sizes as compile-time constants, or 0 for any. */
#define ROW_UNIT(NAME, T, EXP, D, DV)                                                                        \
static void NAME(row_job_t *jb, int64_t b, int64_t gi, T *scr) {                                             \
    const int64_t r = jb->H / jb->HKV, e = jb->e, off = e - 1, d = D ? D : jb->d, dv = DV ? DV : jb->dv;     \
    T *ps = scr, *ep = scr + r * e, *em = scr + 2 * r * e;                                                   \
    const T *kb = (const T *)jb->k + b * jb->k_sb + gi * jb->k_sh;                                           \
    const T *vb = (const T *)jb->v + b * jb->v_sb + gi * jb->v_sh;                                           \
    const T sc = (T)jb->sc;                                                                                  \
    const T *qs[MAXR];                                                                                       \
    for (int64_t hh = 0; hh < r; hh++) qs[hh] = (const T *)jb->q + b * jb->q_sb + (gi * r + hh) * jb->q_sh;  \
    for (int64_t j0 = 0; j0 < e; j0 += BLOCK) {  /* logits w = (q . k) sc, a block of keys for every head */ \
        const int64_t j1 = j0 + BLOCK < e ? j0 + BLOCK : e;                                                  \
        for (int64_t hh = 0; hh < r; hh++) {                                                                 \
            const T *qv = qs[hh]; T *wr = ps + hh * e;                                                       \
            for (int64_t j = j0; j < j1; j++) {                                                              \
                const T *kj = kb + j * jb->k_st; T s = 0;                                                    \
                for (int64_t t = 0; t < d; t++) s += qv[t] * kj[t];                                          \
                wr[j] = s * sc;                                                                              \
            }                                                                                                \
        }                                                                                                    \
    }                                                                                                        \
    T f0[MAXR];                                                                                              \
    for (int64_t hh = 0; hh < r; hh++) {  /* the three softmaxes, each over its own maximum; A */           \
        T *wr = ps + hh * e, *epr = ep + hh * e, *emr = em + hh * e;                                         \
        T mx[8], mn[8];  /* 8 lanes of running max / min (elementwise, vectorised), then folded */           \
        for (int l = 0; l < 8; l++) { mx[l] = wr[0]; mn[l] = wr[0]; }                                        \
        int64_t j8 = 0;                                                                                      \
        for (; j8 + 8 <= off; j8 += 8)                                                                       \
            for (int l = 0; l < 8; l++) {                                                                    \
                const T x = wr[j8 + l]; mx[l] = x > mx[l] ? x : mx[l]; mn[l] = x < mn[l] ? x : mn[l];         \
            }                                                                                                \
        for (; j8 < off; j8++) { const T x = wr[j8]; mx[0] = x > mx[0] ? x : mx[0]; mn[0] = x < mn[0] ? x : mn[0]; } \
        T m1 = mx[0], lo = mn[0];                                                                            \
        for (int l = 1; l < 8; l++) { m1 = mx[l] > m1 ? mx[l] : m1; lo = mn[l] < lo ? mn[l] : lo; }         \
        const T m0 = wr[off] > m1 ? wr[off] : m1, m2 = -lo;                                                  \
        T s0 = 0, s1 = 0, s2 = 0;                                                                            \
        for (int64_t j = 0; j < off; j++) {                                                                  \
            const T x = wr[j], a = EXP(x - m0), p = EXP(x - m1), n = EXP(-x - m2);                           \
            wr[j] = a; epr[j] = p; emr[j] = n; s0 += a; s1 += p; s2 += n;                                    \
        }                                                                                                    \
        wr[off] = EXP(wr[off] - m0); s0 += wr[off];                                                          \
        const T f1 = ((T)1 / s1) * (T)jb->c_plus, f2 = ((T)1 / s2) * (T)(-jb->c_minus);                      \
        f0[hh] = (T)1 / s0;                                                                                  \
        for (int64_t j = 0; j < off; j++) epr[j] = epr[j] * f1 + emr[j] * f2;                                \
    }                                                                                                        \
    /* stock = (sum_j e_j v_j) / s0 and y_1 = A v: a block of values for every head; y_{h+2} = A history h */ \
    T acc[2 * MAXR * MAXDV];                                                                                 \
    for (int64_t i = 0; i < 2 * r * dv; i++) acc[i] = 0;                                                     \
    for (int64_t j0 = 0; j0 < e; j0 += BLOCK) {                                                              \
        const int64_t j1 = j0 + BLOCK < e ? j0 + BLOCK : e, ja = j1 < off ? j1 : off;                        \
        for (int64_t hh = 0; hh < r; hh++) {                                                                 \
            T *a0 = acc + 2 * hh * dv, *a1 = a0 + dv;                                                        \
            const T *psr = ps + hh * e, *ar = ep + hh * e;                                                   \
            for (int64_t j = j0; j < ja; j++) {                                                              \
                const T *vj = vb + j * jb->v_st; const T pj = psr[j], aj = ar[j];                            \
                for (int64_t t = 0; t < dv; t++) { a0[t] += pj * vj[t]; a1[t] += aj * vj[t]; }               \
            }                                                                                                \
            if (j1 == e) { const T *vj = vb + off * jb->v_st; const T pj = psr[off];                         \
                           for (int64_t t = 0; t < dv; t++) a0[t] += pj * vj[t]; }                           \
        }                                                                                                    \
    }                                                                                                        \
    for (int64_t hh = 0; hh < r; hh++) {                                                                     \
        const int64_t hq = gi * r + hh;                                                                      \
        const T *a0 = acc + 2 * hh * dv, *a1 = a0 + dv, *ar = ep + hh * e;                                   \
        if (jb->with_stock) {                                                                                \
            T *o = (T *)jb->out0 + (b * jb->H + hq) * dv;                                                    \
            for (int64_t t = 0; t < dv; t++) o[t] = a0[t] * f0[hh];                                          \
        }                                                                                                    \
        const T *yprev = a1;  /* y_1, then each hop: written into its history row off, the last one out */  \
        T yh[MAXDV];                                                                                         \
        for (int64_t h = 0; h < jb->nstore; h++) {                                                           \
            const int64_t *st = jb->st_strides + 3 * h;                                                     \
            T *hist = (T *)jb->stores[h] + b * st[0] + hq * st[1];                                           \
            for (int64_t t = 0; t < dv; t++) yh[t] = 0;                                                      \
            for (int64_t j = 0; j < off; j++) {                                                              \
                const T *yj = hist + j * st[2]; const T aj = ar[j];                                          \
                for (int64_t t = 0; t < dv; t++) yh[t] += aj * yj[t];                                        \
            }                                                                                                \
            memcpy(hist + off * st[2], yprev, (size_t)dv * sizeof(T));                                       \
            memcpy(acc + 2 * hh * dv + dv, yh, (size_t)dv * sizeof(T));                                      \
            yprev = acc + 2 * hh * dv + dv;                                                                  \
        }                                                                                                    \
        memcpy((T *)jb->ylast + (b * jb->H + hq) * dv, yprev, (size_t)dv * sizeof(T));                       \
    }                                                                                                        \
}

ROW_UNIT(unit_f32, float, exp_neg_f, 0, 0)
ROW_UNIT(unit_f32_32, float, exp_neg_f, 32, 32)
ROW_UNIT(unit_f32_64, float, exp_neg_f, 64, 64)
ROW_UNIT(unit_f32_128, float, exp_neg_f, 128, 128)
ROW_UNIT(unit_f64, double, exp_neg_d, 0, 0)

static void run_unit(row_job_t *jb, int is_double, int64_t b, int64_t gi, void *scr) {
    if (is_double) { unit_f64(jb, b, gi, (double *)scr); return; }
    if (jb->d == 32 && jb->dv == 32) unit_f32_32(jb, b, gi, (float *)scr);
    else if (jb->d == 64 && jb->dv == 64) unit_f32_64(jb, b, gi, (float *)scr);
    else if (jb->d == 128 && jb->dv == 128) unit_f32_128(jb, b, gi, (float *)scr);
    else unit_f32(jb, b, gi, (float *)scr);
}

typedef struct { row_job_t *jb; int is_double; } row_arg_t;

static void *row_worker(void *arg) {
    row_arg_t *ra = (row_arg_t *)arg;
    row_job_t *jb = ra->jb;
    const int64_t r = jb->H / jb->HKV;
    void *scr = malloc((size_t)(3 * r * jb->e) * (ra->is_double ? sizeof(double) : sizeof(float)));
    if (!scr) { __atomic_store_n(&jb->failed, 1, __ATOMIC_SEQ_CST); return NULL; }
    for (;;) {
        int64_t u = __atomic_fetch_add(&jb->next, 1, __ATOMIC_SEQ_CST);
        if (u >= jb->B * jb->HKV) break;
        run_unit(jb, ra->is_double, u / jb->HKV, u % jb->HKV, scr);
    }
    free(scr);
    return NULL;
}

int sv_ceq_sgate_row(int is_double, int64_t B, int64_t H, int64_t HKV, int64_t d, int64_t dv, int64_t e,
                     const void *q, int64_t q_sb, int64_t q_sh,
                     const void *k, int64_t k_sb, int64_t k_sh, int64_t k_st,
                     const void *v, int64_t v_sb, int64_t v_sh, int64_t v_st,
                     int64_t nstore, void *const *stores, const int64_t *st_strides,
                     double sc, double c_plus, double c_minus, int with_stock, void *out0, void *ylast,
                     int64_t threads) {
    if (H / HKV > MAXR || dv > MAXDV) return 2;
    row_job_t jb = {B, H, HKV, d, dv, e, nstore, q, q_sb, q_sh, k, k_sb, k_sh, k_st, v, v_sb, v_sh, v_st,
                    stores, st_strides, sc, c_plus, c_minus, with_stock, out0, ylast, 0, 0};
    row_arg_t ra = {&jb, is_double};
    int64_t units = B * HKV;
    if (threads > units) threads = units;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
#ifdef _OPENMP
    #pragma omp parallel num_threads((int)threads)
    { row_worker(&ra); }
#else
    pthread_t tid[64];
    int64_t started = 0;
    for (int64_t t = 1; t < threads; t++) {
        if (pthread_create(&tid[t], NULL, row_worker, &ra) != 0) break;
        started = t;
    }
    row_worker(&ra);
    for (int64_t t = 1; t <= started; t++) pthread_join(tid[t], NULL);
#endif
    return jb.failed;
}
"""

_i64, _f64, _ptr = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p


def kernel() -> ctypes.CDLL | None:
    """The compiled row kernel (built on first use), or None where it cannot be built (reported once)."""
    lib = load_kernel(NAME, SOURCE)
    if lib is not None and not getattr(lib, "_sv_typed", False):
        lib.sv_ceq_sgate_row.restype = ctypes.c_int
        lib.sv_ceq_sgate_row.argtypes = [ctypes.c_int, _i64, _i64, _i64, _i64, _i64, _i64,
                                         _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i64,
                                         _i64, _ptr, _ptr, _f64, _f64, _f64, ctypes.c_int, _ptr, _ptr, _i64]
        lib._sv_typed = True
    return lib


def _threads(lib: ctypes.CDLL) -> int:
    """Threads for one row (see :data:`ROW_THREADS`)."""
    if ROW_THREADS is not None:
        return ROW_THREADS
    return outer_threads() if uses_openmp(lib) else 1


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: list[torch.Tensor]) -> bool:
    """Whether the kernel takes these inputs: CPU, one dtype (float32 / float64), contiguous last dims, no
    autograd, at most 64 query heads per kv head and a value head size of at most :data:`MAX_VALUE_DIM`."""
    ts = (q, k, v, *store)
    return (q.dtype in (torch.float32, torch.float64) and v.shape[-1] <= MAX_VALUE_DIM
            and q.shape[1] // k.shape[1] <= 64
            and all(t.device.type == "cpu" and t.dtype == q.dtype and t.stride(-1) == 1 and not t.requires_grad
                    for t in ts))


def sgate_decode_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sc: float, rho: float, lam: float,
                     store: list[torch.Tensor], with_stock: bool,
                     ) -> tuple[list[torch.Tensor], torch.Tensor | None] | None:
    """:func:`sv_attention.ops.ceq.engine._sgate_decode_row` in one kernel call, or None where it cannot run.

    Parameters
    ----------
    q : ``[b, h, 1, d]``; k, v : ``[b, h_kv, kv_len, d]`` (``kv_len >= 2``)
    sc : logit scale; rho, lam : the sgate parameters
    store : K-1 tensors ``[b, h, >= kv_len, dv]`` (rows ``[:kv_len - 1]`` read, row ``kv_len - 1`` written)
    with_stock : also return the stock softmax attention of the row

    Returns
    -------
    (ys, out0) as the torch row returns them, or None (no kernel, or inputs it does not take)
    """
    if not supports(q, k, v, store):
        return None
    lib = kernel()
    if lib is None:
        return None
    b, h, _, d = q.shape
    hkv, e = k.shape[1], k.shape[2]
    dv = v.shape[-1]
    last = q.new_empty(b, h, 1, dv)
    out0 = q.new_empty(b, h, 1, dv) if with_stock else None
    ptrs = (ctypes.c_void_p * max(len(store), 1))(*[t.data_ptr() for t in store])
    strides = (ctypes.c_int64 * max(3 * len(store), 1))(*[x for t in store for x in t.stride()[:3]])
    c = rho / (1.0 + lam)
    failed = lib.sv_ceq_sgate_row(int(q.dtype == torch.float64), b, h, hkv, d, dv, e,
                                  q.data_ptr(), q.stride(0), q.stride(1),
                                  k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
                                  v.data_ptr(), v.stride(0), v.stride(1), v.stride(2),
                                  len(store), ptrs, ctypes.addressof(strides), float(sc), c, c * lam,
                                  int(with_stock), None if out0 is None else out0.data_ptr(), last.data_ptr(),
                                  _threads(lib))
    if failed:
        raise MemoryError("sv_ceq_sgate_row: the kernel could not allocate its scratch")
    off = e - 1
    return [t[:, :, off:off + 1] for t in store] + [last], out0
