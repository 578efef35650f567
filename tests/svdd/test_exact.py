"""Tests of the exact maintained SVDD solver against the from-scratch reference and the clarabel oracle."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

from sv_attention.errors import (
    DuplicateIdError,
    InfeasibleBoxError,
    InvalidHyperparameterError,
    InvalidInputError,
    UnknownIdError,
    WarmupError,
)
from sv_attention.svdd import IncrementalSVDD, refit
from sv_attention.svdd.reference import rbf_gram_np


def clarabel_alpha(K: np.ndarray, C: float) -> np.ndarray:
    """Independent oracle: the SVDD dual solved by the clarabel interior-point QP solver."""
    import clarabel
    import scipy.sparse as sp

    n = K.shape[0]
    P = sp.csc_matrix(np.triu(2.0 * K))
    q = -np.diag(K).copy()
    A = sp.vstack([sp.csc_matrix(np.ones((1, n))), sp.eye(n), -sp.eye(n)]).tocsc()
    b = np.concatenate([[1.0], np.full(n, C), np.zeros(n)])
    cones = [clarabel.ZeroConeT(1), clarabel.NonnegativeConeT(2 * n)]
    st = clarabel.DefaultSettings()
    st.verbose = False
    st.tol_gap_abs = st.tol_gap_rel = st.tol_feas = 1e-13
    st.tol_ktratio = 1e-10
    sol = clarabel.DefaultSolver(P, q, A, b, cones, st).solve()
    return np.asarray(sol.x)


def gaussian(seed: int, n: int, d: int = 4, scale: float = 1.0) -> np.ndarray:
    return scale * np.random.default_rng(seed).standard_normal((n, d))


def assert_same_solution(s, ref, probes: np.ndarray, tol: float = 1e-10) -> None:
    # an independent comparison only: the oracle converged, and the solver never fell back to a from-scratch
    # solve (which may use the same SMO routine as refit)
    assert ref.converged and s.certificate().fallbacks == 0
    np.testing.assert_array_equal(s.ids, ref.ids)
    np.testing.assert_allclose(s.alpha, ref.alpha, atol=tol, rtol=0)
    assert abs(s.rho - ref.rho) <= tol
    np.testing.assert_allclose(s.decision_function(probes), ref.decision_function(probes), atol=tol, rtol=0)


@pytest.mark.parametrize("sigma", [1.0, 2.5])
def test_admission_matches_refit_and_clarabel(sigma):
    X = gaussian(0, 30, scale=0.5 if sigma == 1.0 else 1.0)
    s = IncrementalSVDD.from_nu(nu=0.3, n0=30, sigma=sigma)
    for k in range(30):  # one at a time
        s.add(X[k : k + 1])
    ref = refit(X, C=s.C, sigma=sigma)
    assert_same_solution(s, ref, gaussian(1, 50))
    assert s.partition == ref.partition
    oracle = clarabel_alpha(rbf_gram_np(X, sigma), s.C)
    np.testing.assert_allclose(s.alpha, oracle, atol=1e-8, rtol=0)
    sizes = s.partition.sizes
    assert sizes["error"] > 0 and sizes["reserve"] > 0 and sizes["margin"] > 0
    cert = s.certificate()
    assert cert.certified and not cert.in_warmup and cert.kkt.max <= 1e-12


def test_deletion_equals_refit_without():
    X = gaussian(2, 40)
    s = IncrementalSVDD.from_nu(nu=0.3, n0=40, sigma=1.5)
    s.add(X)
    rng = np.random.default_rng(3)
    for _ in range(6):
        victims = rng.choice(s.ids, size=2, replace=False)
        rec = s.remove(victims)
        assert rec.deleted == tuple(int(v) for v in victims)
        assert not rec.fallback and rec.kkt.max <= 1e-12
        keep = s.ids
        ref = refit(X[keep], C=s.C, sigma=s.sigma, ids=keep)
        assert_same_solution(s, ref, gaussian(4, 30))
        assert s.partition == ref.partition
    oracle = clarabel_alpha(rbf_gram_np(X[s.ids], s.sigma), s.C)
    np.testing.assert_allclose(s.alpha, oracle, atol=1e-8, rtol=0)


def test_counterexample_evicted_key_is_readmitted():
    # DESIGN §2.2: (-1,0), (1,0), (0,0.9), C=1, sigma=5; admitting (0,-10) makes the old reserve key an SV.
    s = IncrementalSVDD(C=1.0, sigma=5.0)
    s.add(np.array([[-1.0, 0.0], [1.0, 0.0], [0.0, 0.9]]))
    assert s.partition.reserve == (2,)
    ev = s.evict_reserve()
    assert ev.ids == (2,) and s.evicted_ids == (2,) and s.alpha_of([2])[0] == 0.0
    rec = s.add(np.array([[0.0, -10.0]]))
    assert rec.readmitted == (2,)
    assert s.evicted_ids == ()
    assert s.alpha_of([2])[0] == pytest.approx(0.03327, abs=5e-6)
    full = np.array([[-1.0, 0.0], [1.0, 0.0], [0.0, 0.9], [0.0, -10.0]])
    assert_same_solution(s, refit(full, C=1.0, sigma=5.0), full)


def test_evicted_keys_stay_evicted_when_still_inert_and_readouts_are_unchanged():
    X = gaussian(5, 40, scale=0.7)
    s = IncrementalSVDD.from_nu(nu=0.3, n0=40, sigma=2.0)
    s.add(X)
    Q = gaussian(6, 15)
    V = {int(i): np.random.default_rng(int(i)).standard_normal(3) for i in s.ids}
    f0, o0 = s.decision_function(Q), s.readout(Q, V)
    reserve = s.partition.reserve
    assert len(reserve) >= 3
    rec = s.evict_reserve(max_keep=1)
    assert len(rec.ids) == len(reserve) - 1 and set(rec.ids) <= set(reserve)
    np.testing.assert_allclose(s.decision_function(Q), f0, atol=1e-14, rtol=0)
    np.testing.assert_allclose(s.readout(Q, V), o0, atol=1e-14, rtol=0)
    assert s.certificate().certified and s.certificate().n_evicted == len(rec.ids)
    np.testing.assert_array_equal(s.alpha_of(list(rec.ids)), 0.0)
    # forgetting an evicted key drops it from the store; the solution does not move
    s.remove([rec.ids[0]])
    assert rec.ids[0] not in s.evicted_ids
    np.testing.assert_allclose(s.decision_function(Q), f0, atol=1e-14, rtol=0)
    # after more admissions the solution is the refit of the full history (evicted keys included)
    s.add(gaussian(7, 10, scale=2.0))
    hist_ids = np.array(sorted(set(s.ids) | set(s.evicted_ids)))
    hist = np.concatenate([X, gaussian(7, 10, scale=2.0)])[hist_ids]
    ref = refit(hist, C=s.C, sigma=s.sigma, ids=hist_ids)
    assert ref.converged and s.certificate().fallbacks == 0
    np.testing.assert_allclose(s.decision_function(Q), ref.decision_function(Q), atol=1e-10, rtol=0)
    np.testing.assert_allclose(s.alpha_of(hist_ids), ref.alpha, atol=1e-10, rtol=0)


def test_deletion_after_heavy_eviction_draws_on_evicted_keys():
    # after evicting every reserve key the active set is close to 1/C keys; deleting support vectors must
    # re-admit evicted keys (the history still has plenty) instead of refusing, and stay exact
    X = gaussian(30, 40, d=3, scale=0.6)
    s = IncrementalSVDD(C=0.1, sigma=2.0)
    s.add(X)
    s.evict_reserve()
    n_active = s.n
    victims = list(s.partition.error[:3]) + list(s.partition.margin[:3])
    assert n_active - len(victims) < 10  # the active keys alone would be infeasible (n * C < 1)
    rec = s.remove(victims)
    assert len(rec.readmitted) >= 10 - (n_active - len(victims))
    hist = np.array(sorted(set(s.ids) | set(s.evicted_ids)))
    assert len(hist) == 40 - len(victims)
    ref = refit(X[hist], C=0.1, sigma=2.0, ids=hist)
    assert ref.converged and s.certificate().fallbacks == 0
    np.testing.assert_allclose(s.alpha_of(hist), ref.alpha, atol=1e-10)
    np.testing.assert_allclose(s.decision_function(X), ref.decision_function(X), atol=1e-10)
    assert s.certificate().certified


def test_margin_set_empties_mid_decrement():
    # Constructed case: S = {1, 6}; removing error key 5 drives both margin keys to the box (S empty)
    # while alpha_5 > 0; the walk then sweeps rho until a reserve key joins S (DESIGN §2.2).
    X = np.array([[-0.1518, -0.105], [-0.0016, -0.1269], [-0.0439, 0.0672], [-1.0394, -0.7801],
                  [-0.1196, 0.1077], [0.1003, 0.3305], [-0.2183, 0.3128], [-0.3418, 2.6874]])
    s = IncrementalSVDD(C=0.222, sigma=1.0)
    s.add(X)
    assert s.partition.margin == (1, 6) and 5 in s.partition.error
    rec = s.remove([5])
    assert rec.guard_detail.get("empty_margin_rho_sweep", 0) >= 1
    assert not rec.fallback
    keep = s.ids
    ref = refit(X[keep], C=0.222, sigma=1.0, ids=keep)
    assert_same_solution(s, ref, X, tol=1e-12)
    np.testing.assert_allclose(s.alpha, clarabel_alpha(rbf_gram_np(X[keep], 1.0), 0.222), atol=1e-8)


def test_margin_set_empty_with_integer_one_over_c():
    # 1/C integer: the optimum can have no margin key (rho is then set to the midpoint of its interval).
    X = gaussian(8, 6, d=2, scale=2.0)
    s = IncrementalSVDD(C=1 / 3, sigma=1.0)
    s.add(X)
    for v in list(s.ids)[:3]:
        s.remove([v])
        ref = refit(X[s.ids], C=1 / 3, sigma=1.0, ids=s.ids)
        assert_same_solution(s, ref, X, tol=1e-12)


@pytest.mark.parametrize("jitter", [0.0, 1e-9, 1e-4])
def test_duplicate_and_near_duplicate_keys(jitter):
    rng = np.random.default_rng(9)
    base = gaussian(10, 8, d=3)
    stream = [base]
    for _ in range(20):
        k = base[rng.integers(8)] + jitter * rng.standard_normal(3)
        stream.append(k[None])
    X = np.concatenate(stream)
    s = IncrementalSVDD.from_nu(nu=0.4, n0=len(X), sigma=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback for duplicates
        recs = [s.add(X[k : k + 1]) for k in range(len(X))]
        for v in rng.choice(s.ids, size=6, replace=False):
            recs.append(s.remove([v]))
    assert all(r.kkt.max <= 1e-8 for r in recs if r.n >= 3)
    ref = refit(X[s.ids], C=s.C, sigma=s.sigma, ids=s.ids)
    assert ref.converged and s.certificate().fallbacks == 0
    probes = np.concatenate([X, X + 0.1 * rng.standard_normal(X.shape)])
    np.testing.assert_allclose(s.decision_function(probes), ref.decision_function(probes), atol=1e-8, rtol=0)
    assert s.certificate().kkt.max <= 1e-8


def test_readout_matches_plain_formula_and_torch_roundtrip():
    X = gaussian(11, 20)
    s = IncrementalSVDD.from_nu(nu=0.5, n0=20, sigma=2.0)
    s.add(torch.from_numpy(X))
    Q = gaussian(12, 7)
    V = np.random.default_rng(13).standard_normal((20, 5))
    kq = np.exp(-((Q[:, None, :] - X[None]) ** 2).sum(-1) / 4.0)
    w = kq * s.alpha[None]
    plain = (w @ V) / w.sum(1, keepdims=True)
    np.testing.assert_allclose(s.readout(Q, V), plain, rtol=1e-12, atol=1e-14)
    by_id = {int(i): V[k] for k, i in enumerate(s.ids)}
    np.testing.assert_allclose(s.readout(Q, by_id), plain, rtol=1e-12, atol=1e-14)
    out_t = s.readout(torch.from_numpy(Q), V)
    assert isinstance(out_t, torch.Tensor) and out_t.dtype == torch.float64
    f = s.decision_function(Q)
    np.testing.assert_allclose(f, 2 * kq @ s.alpha - s.rho, atol=1e-14)


def test_explicit_ids_alpha_of_and_warmup():
    s = IncrementalSVDD(C=0.25, sigma=1.0)
    assert s.warmup_size == 6
    rec = s.add(gaussian(14, 2, d=3), ids=[100, 104])
    assert rec.ids == (100, 104) and rec.in_warmup and not s.has_solution
    np.testing.assert_allclose(s.alpha, [0.5, 0.5])
    with pytest.raises(WarmupError):
        s.decision_function(gaussian(1, 2, d=3))
    assert not s.certificate().certified
    with pytest.raises(WarmupError):
        s.evict_reserve()
    s.add(gaussian(15, 3, d=3), ids=[7, 8, 9])
    assert s.has_solution and s.in_warmup  # 5 keys: feasible (5 * 0.25 >= 1), still warm-up
    assert "warm-up" in s.certificate().reason
    s.add(gaussian(16, 1, d=3))
    assert not s.in_warmup and s.certificate().certified
    np.testing.assert_array_equal(s.ids, [7, 8, 9, 100, 104, 105])  # default ids continue after the max
    np.testing.assert_allclose(s.alpha_of([104, 7]), s.alpha[[4, 0]])
    with pytest.raises(UnknownIdError):
        s.alpha_of([3])


def _bad_calls(s: IncrementalSVDD):
    good = gaussian(20, 2, d=4)
    nan = good.copy()
    nan[0, 1] = np.nan
    inf = good.copy()
    inf[1, 0] = np.inf
    return [
        (InvalidInputError, lambda: s.add(nan)),
        (InvalidInputError, lambda: s.add(inf)),
        (InvalidInputError, lambda: s.add(good.astype(np.float32))),
        (InvalidInputError, lambda: s.add(torch.from_numpy(good).float())),
        (InvalidInputError, lambda: s.add(good[0])),
        (InvalidInputError, lambda: s.add(gaussian(20, 2, d=3))),
        (InvalidInputError, lambda: s.add([[0.0, 1.0, 2.0, 3.0]])),
        (DuplicateIdError, lambda: s.add(good, ids=[500, 500])),
        (DuplicateIdError, lambda: s.add(good, ids=[int(s.ids[0]), 501])),
        (InvalidInputError, lambda: s.add(good, ids=[1])),
        (InvalidInputError, lambda: s.add(good, ids=[1.5, 2.5])),
        (UnknownIdError, lambda: s.remove([12345])),
        (DuplicateIdError, lambda: s.remove([int(s.ids[0]), int(s.ids[0])])),
        (InfeasibleBoxError, lambda: s.remove(list(s.ids[: s.n - 2]) + list(s.evicted_ids))),
        (InvalidInputError, lambda: s.evict_reserve(max_keep=-1)),
        (InvalidInputError, lambda: s.decision_function(np.zeros((2, 3)))),
    ]


def test_rejected_input_leaves_state_bit_identical():
    s = IncrementalSVDD(C=0.2, sigma=1.5)
    s.add(gaussian(21, 12, d=4))
    s.evict_reserve()
    before = s.state_dict()
    for err, call in _bad_calls(s):
        with pytest.raises(err) as info:
            call()
        assert len(str(info.value)) > 20  # says what was wrong and what to do
        after = s.state_dict()
        assert before.keys() == after.keys()
        for key in before:
            if isinstance(before[key], np.ndarray):
                np.testing.assert_array_equal(before[key], after[key], err_msg=key)
            elif isinstance(before[key], dict) and key == "evicted":
                assert before[key].keys() == after[key].keys()
            else:
                assert before[key] == after[key], key


@pytest.mark.parametrize("kwargs", [dict(C=0.0, sigma=1.0), dict(C=-1.0, sigma=1.0), dict(C=0.1, sigma=0.0),
                                    dict(C=float("nan"), sigma=1.0), dict(C=0.1, sigma=float("inf"))])
def test_bad_hyperparameters(kwargs):
    with pytest.raises(InvalidHyperparameterError):
        IncrementalSVDD(**kwargs)
    with pytest.raises(InvalidHyperparameterError):
        refit(gaussian(0, 20), **kwargs)


def test_from_nu_fixes_c_for_life():
    s = IncrementalSVDD.from_nu(nu=0.4, n0=24, sigma=2.0)
    assert s.C == pytest.approx(1 / (0.4 * 24)) and s.nu_calibration == {"nu": 0.4, "n0": 24}
    s.add(gaussian(22, 40))
    s.remove(s.ids[:10])
    assert s.C == pytest.approx(1 / (0.4 * 24))
    for bad in [dict(nu=0.0, n0=10), dict(nu=1.5, n0=10), dict(nu=0.5, n0=0), dict(nu=0.5, n0=2.5)]:
        with pytest.raises(InvalidHyperparameterError):
            IncrementalSVDD.from_nu(sigma=1.0, **bad)


def test_refit_rejects_infeasible():
    with pytest.raises(InfeasibleBoxError):
        refit(gaussian(0, 3), C=0.1, sigma=1.0)


def test_walk_failure_falls_back_to_scratch_and_reports(monkeypatch):
    X = gaussian(23, 25)
    s = IncrementalSVDD.from_nu(nu=0.4, n0=25, sigma=1.5)
    s.add(X)
    from sv_attention.svdd import exact

    def broken(self, c, direction):
        raise exact._WalkFailed("injected")

    monkeypatch.setattr(exact.IncrementalSVDD, "_sweep", broken)
    victim = s.partition.error[0] if s.partition.error else s.partition.margin[0]
    with pytest.warns(RuntimeWarning, match="from-scratch"):
        rec = s.remove([victim])
    assert rec.fallback and rec.guard_detail["fallback_from_scratch"] == 1
    assert rec.guard_detail["scratch_smo"] == 1  # the walks are broken here: the SMO candidate, verified
    assert s.certificate().fallbacks == 1 and s.certificate().certified
    ref = refit(X[s.ids], C=s.C, sigma=s.sigma, ids=s.ids)
    np.testing.assert_allclose(s.decision_function(X), ref.decision_function(X), atol=1e-10)
    # after an SMO fallback the comparison with refit is not independent: check against clarabel too
    np.testing.assert_allclose(s.alpha, clarabel_alpha(rbf_gram_np(X[s.ids], s.sigma), s.C), atol=1e-8, rtol=0)


def test_receipts_carry_fields():
    s = IncrementalSVDD.from_nu(nu=0.4, n0=20, sigma=2.0)
    rec = s.add(gaussian(24, 20))
    assert rec.n == 20 and sum(rec.partition_sizes.values()) == 20 and rec.elapsed_s >= 0
    assert set(rec.kkt.as_dict()) == {"sum", "margin", "error", "reserve", "box", "evicted", "max"}
    assert isinstance(rec.guard_events, int) and rec.readmitted == ()
    s2 = copy.deepcopy(s)
    rec2 = s2.remove([3])
    assert rec2.deleted == (3,) and rec2.n == 19
