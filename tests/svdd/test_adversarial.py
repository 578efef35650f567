"""Issue 15: the exact solver under adversarial input -- fallbacks that are verified optima, keys far from the
origin, NaN, extreme hyperparameters, exact duplicates, an oracle that says when it did not converge, and a
short budget of the seeded random property driver (the long one is ``sv-attention reproduce robustness``)."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

from sv_attention.errors import InvalidHyperparameterError, InvalidInputError, SolverError
from sv_attention.svdd import IncrementalSVDD, exact, reference, refit
from sv_attention.svdd.readapi import rbf_cross, sq_dists
from sv_attention.svdd.receipts import kkt_residuals
from sv_attention.svdd.reference import rbf_gram_np
from tests.svdd.test_exact import clarabel_alpha

# 29 one-dimensional keys (one exact duplicate, far outliers) whose from-scratch solve used to return alpha < 0
FALLBACK_KEYS_1D = np.array([
    -2.780783944111591, -65.22810540986589, -3.6152434089849352, 1670856.4001483677, -456749.5186005844,
    -5.490658656625271, 3.3841732500685398, -822492.8773614038, -1.8520299608811288, -2.10284754658426,
    605838.066859694, 3.087929482832619, 1.696870575864361, -0.439395559097011, 0.9299799710415766,
    0.2855513923327411, -1.5247266976111309, -0.6138367620128773, -0.7443113478943715, -0.5833673428756464,
    -884.3750071170966, 2184.363841810373, 243.83845750005324, 243.83845750005324, -1.1847732590822084,
    0.7552860600148631, 0.03946699797611462, -2.4645724360727073, 0.714275702369698])[:, None]
C_1D, SIGMA_1D = 0.054365808898847415, 0.7531865153172613


def converged_refit(X: np.ndarray, C: float, sigma: float, ids: np.ndarray | None = None):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a non-converged oracle is an error here
        ref = refit(X, C=C, sigma=sigma, ids=ids)
    assert ref.converged
    return ref


def test_fallback_solve_is_a_verified_optimum() -> None:
    s = IncrementalSVDD(C=C_1D, sigma=SIGMA_1D)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        rec = s.add(FALLBACK_KEYS_1D)
    assert not rec.fallback and s.certificate().certified
    f0 = s.decision_function(FALLBACK_KEYS_1D)
    method = s._from_scratch()  # the path every reported fallback takes
    cert = s.certificate()
    assert method in ("walks", "smo") and cert.certified and cert.kkt.max <= 1e-10
    assert s.alpha.min() >= 0.0 and s.alpha.max() <= s.C and abs(s.alpha.sum() - 1) <= 1e-12
    ref = converged_refit(FALLBACK_KEYS_1D, C_1D, SIGMA_1D)
    np.testing.assert_allclose(s.decision_function(FALLBACK_KEYS_1D), ref.decision_function(FALLBACK_KEYS_1D),
                               atol=1e-9, rtol=0)
    np.testing.assert_allclose(s.decision_function(FALLBACK_KEYS_1D), f0, atol=1e-9, rtol=0)
    oracle = clarabel_alpha(rbf_gram_np(FALLBACK_KEYS_1D, SIGMA_1D), C_1D)
    K = rbf_gram_np(FALLBACK_KEYS_1D, SIGMA_1D)
    np.testing.assert_allclose(K @ s.alpha, K @ oracle, atol=1e-7)  # the centre, judged independently


def test_first_feasible_solve_does_not_use_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first feasible solve walks from a slack-key start: with the SMO reference disabled it still gives
    the optimum, so comparing the solver with refit() is comparing two independent methods."""

    def no_smo(*args, **kwargs):
        raise AssertionError("the first feasible solve must not call the SMO reference")

    X = np.random.default_rng(3).standard_normal((30, 3))
    monkeypatch.setattr(exact, "solve_dual", no_smo)
    s = IncrementalSVDD.from_nu(nu=0.3, n0=30, sigma=1.5)
    rec = s.add(X)
    monkeypatch.undo()
    assert not rec.fallback and "scratch_smo" not in s.certificate().guard_detail
    ref = converged_refit(X, s.C, s.sigma)
    np.testing.assert_allclose(s.alpha, ref.alpha, atol=1e-10, rtol=0)
    np.testing.assert_allclose(s.alpha, clarabel_alpha(rbf_gram_np(X, 1.5), s.C), atol=1e-8, rtol=0)


def test_an_unverifiable_fallback_raises_and_restores_the_state(monkeypatch: pytest.MonkeyPatch) -> None:
    X = np.random.default_rng(4).standard_normal((25, 2))
    s = IncrementalSVDD.from_nu(nu=0.4, n0=25, sigma=1.5)
    s.add(X)
    s.evict_reserve()
    before = s.state_dict()

    def broken_walk(self, c, direction, join=None):
        raise exact._WalkFailed("injected")

    def bad_smo(self):  # a "solution" outside the box: must never replace the state
        n = self._n
        self._alpha[:n] = -1.0 / n
        self._alpha[0] = 2.0
        self._S, self._R = [], None

    monkeypatch.setattr(exact.IncrementalSVDD, "_sweep", broken_walk)
    monkeypatch.setattr(exact.IncrementalSVDD, "_solve_by_smo", bad_smo)
    victim = s.partition.error[0] if s.partition.error else s.partition.margin[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(SolverError, match="restored|verification"):
            s.remove([victim])
        with pytest.raises(SolverError):
            s.add(3.0 + np.zeros((1, 2)))  # needs a walk: g < 0 far from the support
    after = s.state_dict()
    for key, value in before.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(value, after[key], err_msg=key)
        elif key == "evicted":
            assert value.keys() == after[key].keys()
        else:
            assert value == after[key], key
    monkeypatch.undo()
    assert s.remove([victim]).kkt.max <= 1e-10  # and the state still works


@pytest.mark.parametrize("offset", [0.0, 1e6, 1e8])
def test_keys_far_from_the_origin_certify_the_right_answer(offset: float) -> None:
    X = offset + np.random.default_rng(0).standard_normal((40, 2))
    s = IncrementalSVDD.from_nu(nu=0.3, n0=40, sigma=1.0)
    s.add(X)
    s.evict_reserve()
    rec = s.remove([int(i) for i in s.ids[s.alpha > 0][:6]])
    assert not rec.fallback
    h = np.array(sorted(set(s.ids.tolist()) | set(s.evicted_ids)))
    ref = converged_refit(X[h], s.C, s.sigma, ids=h)
    assert s.certificate().certified
    np.testing.assert_allclose(s.decision_function(X[h]), ref.decision_function(X[h]), atol=1e-9, rtol=0)
    np.testing.assert_allclose(s.alpha_of(h), ref.alpha, atol=1e-9, rtol=0)


def test_eviction_alone_never_loses_the_certificate_far_from_the_origin() -> None:
    X = 1e7 + np.random.default_rng(0).standard_normal((40, 2))
    s = IncrementalSVDD.from_nu(nu=0.3, n0=40, sigma=1.0)
    s.add(X)
    assert s.certificate().certified
    s.evict_reserve()
    cert = s.certificate()
    assert cert.certified and cert.kkt.evicted <= 1e-12


def test_rbf_cross_equals_the_kernel_by_differences() -> None:
    rng = np.random.default_rng(5)
    for offset, scale in ((0.0, 1.0), (1e6, 1.0), (1e8, 3.0), (0.0, 1e3)):
        A = offset + scale * rng.standard_normal((30, 4))
        B = offset + scale * rng.standard_normal((20, 4))
        B[:3] = A[:3] + 1e-9 * scale  # near-duplicates across the two sets
        for sigma in (0.5 * scale, 5.0 * scale):
            exact_k = np.exp(-sq_dists(A, B) / sigma**2)
            np.testing.assert_allclose(rbf_cross(A, B, 1.0 / sigma**2), exact_k, atol=1e-14, rtol=0)
    huge = np.array([[1.7e308, -1.7e308], [0.0, 1.0]])
    k = rbf_cross(huge, np.array([[0.0, 0.0], [1e308, 1e308]]), 1.0)
    assert np.isfinite(k).all() and k[0].max() == 0.0


def test_a_huge_key_is_never_read_as_nan_and_nan_is_never_certified() -> None:
    X = 1.5 * np.random.default_rng(0).standard_normal((30, 4))
    s = IncrementalSVDD.from_nu(nu=0.4, n0=30, sigma=3.0)
    s.add(X)
    s.add(np.array([[1.7e308, -1.7e308, 0.0, 0.0]]))
    ev = s.evict_reserve()
    assert len(ev.ids) > 0 and np.isfinite(s._evicted_g()).all()
    assert s.certificate().certified
    assert s.add(np.zeros((1, 4))).readmitted == ()  # nothing violated, nothing re-admitted
    # a NaN anywhere in a certificate: uncertified, with the reason
    broken = copy.deepcopy(s)
    broken._g[0] = np.nan
    cert = broken.certificate()
    assert not cert.certified and "non-finite" in cert.reason and not np.isfinite(cert.kkt.max)
    res = kkt_residuals(np.array([0.5, 0.5]), np.array([0.0, 0.0]), np.array([1, 1], dtype=np.int8), 1.0,
                        np.array([np.nan]))
    assert res.evicted == np.inf and res.max == np.inf


@pytest.mark.parametrize("kwargs", [dict(C=0.2, sigma=1e-200), dict(C=0.2, sigma=1e200), dict(C=1e-300, sigma=1.0),
                                    dict(C=5e-324, sigma=1.0), dict(C=True, sigma=1.0), dict(C=0.2, sigma=False),
                                    dict(C="0.2", sigma=1.0), dict(C=0.2, sigma=np.array([1.0, 2.0]))])
def test_extreme_or_mistyped_hyperparameters_are_typed_errors(kwargs) -> None:
    with pytest.raises(InvalidHyperparameterError) as info:
        IncrementalSVDD(**kwargs)
    assert len(str(info.value)) > 20
    with pytest.raises(InvalidHyperparameterError):
        refit(np.zeros((5, 2)), **kwargs)


def test_numpy_scalars_and_small_but_usable_values_are_accepted() -> None:
    X = np.random.default_rng(6).standard_normal((12, 2))
    a = IncrementalSVDD(C=np.float32(0.25), sigma=np.int64(2))
    b = IncrementalSVDD(C=0.25, sigma=2.0)
    a.add(X)
    b.add(X)
    np.testing.assert_array_equal(a.alpha, b.alpha)
    tiny = IncrementalSVDD(C=0.5, sigma=1e-150)  # sigma**2 is still a normal float
    tiny.add(X[:4])
    assert tiny.certificate().kkt.max <= 1e-12


def test_ids_are_never_truncated_or_flattened() -> None:
    X = np.random.default_rng(7).standard_normal((10, 2))
    s = IncrementalSVDD(C=0.25, sigma=1.0)
    s.add(X)
    before = s.state_dict()["alpha"].copy()
    for bad in ([5.7], np.array([[1, 2]]), [True], "3"):
        with pytest.raises(InvalidInputError):
            s.alpha_of(bad)
        with pytest.raises(InvalidInputError):
            s.remove(bad)
    np.testing.assert_array_equal(s.state_dict()["alpha"], before)
    with pytest.raises(InvalidInputError):
        refit(X, C=0.25, sigma=1.0, ids=np.arange(10).reshape(2, 5))
    ref = converged_refit(X, 0.25, 1.0, ids=np.arange(10))
    with pytest.raises(InvalidInputError):
        ref.alpha_of([2.5])
    np.testing.assert_allclose(s.alpha_of(np.array([3, 5])), ref.alpha_of([3, 5]), atol=1e-10)


def test_refit_says_when_it_did_not_converge(monkeypatch: pytest.MonkeyPatch) -> None:
    X = np.random.default_rng(8).standard_normal((40, 1))
    ok = converged_refit(X, 0.05, 20.0)  # sigma 20x the data scale: a numerically singular Gram
    assert ok.kkt.max <= reference.REFIT_TOL
    orig = reference._smo
    monkeypatch.setattr(reference, "_smo", lambda K, C, tol, max_iter, alpha0: orig(K, C, tol, 3, alpha0))
    monkeypatch.setattr(reference, "SMO_EXTRA_ROUNDS", 0)
    with pytest.warns(RuntimeWarning, match="converged is False"):
        bad = refit(X, C=0.05, sigma=20.0)
    assert not bad.converged and bad.kkt.max > reference.REFIT_TOL


@pytest.mark.parametrize("jitter", [0.0, 1e-9])
def test_deleting_duplicated_support_vectors_is_exact(jitter: float) -> None:
    rng = np.random.default_rng(9)
    fresh = 1.5 * rng.standard_normal((20, 3))
    X = np.concatenate([fresh, fresh[rng.integers(20, size=40)] + jitter * rng.standard_normal((40, 3))])
    s = IncrementalSVDD.from_nu(nu=0.4, n0=60, sigma=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        s.add(X)
        absorbed = 0
        for _ in range(8):
            victim = int(rng.choice(s.ids[s.alpha > 0]))
            rec = s.remove([victim])
            assert not rec.fallback
            absorbed += rec.guard_detail.get("twin_absorbed", 0) + rec.guard_detail.get("twin_swap", 0)
    if jitter == 0.0:
        assert absorbed > 0  # exact duplicates take over the mass without a walk
    ref = converged_refit(X[s.ids], s.C, s.sigma, ids=s.ids)
    tol = 1e-10 if jitter == 0.0 else 1e-7
    np.testing.assert_allclose(s.decision_function(X), ref.decision_function(X), atol=tol, rtol=0)
    assert s.certificate().kkt.max <= 1e-9
    K = rbf_gram_np(X[s.ids], s.sigma)
    np.testing.assert_allclose(K @ s.alpha, K @ clarabel_alpha(K, s.C), atol=1e-7)


def test_short_random_property_budget_meets_every_target() -> None:
    """A few seconds of the seeded driver behind ``sv-attention reproduce robustness``: KKT after every
    operation (recomputed from the history), refits every few operations, refused deletions unchanged."""
    from sv_attention.experiments.robustness import run_robustness

    out = run_robustness(ops=700, seed=11, refit_every=6)
    s = out["summary"]
    assert s["operations"] == 700 and s["refits"] > 50 and s["certified_states"] > 300
    assert s["exceptions"] == 0 and s["violations"] == 0 and s["refused_deletions_bad"] == 0
    assert s["worst_kkt_certified"] <= 1e-8 and s["worst_deviation"] <= 1e-8
    assert s["worst_deviation_near_duplicate"] <= 1e-6
    assert sum(out["by_kind"].values()) == 700 and min(out["by_op"].values()) > 0
