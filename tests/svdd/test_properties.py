"""Property tests (hypothesis) of the exact solver's invariants under random admission/deletion sequences."""

from __future__ import annotations

import warnings

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sv_attention.svdd import IncrementalSVDD, refit

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

ops_strategy = st.lists(st.tuples(st.sampled_from(["add", "add", "remove", "evict"]), st.integers(1, 3)),
                        min_size=3, max_size=14)


def check_invariants(s: IncrementalSVDD, tol: float = 1e-9) -> None:
    a = s.alpha
    assert abs(a.sum() - 1.0) <= 1e-12
    assert a.min() >= -1e-15 and a.max() <= s.C * (1 + 1e-12)
    cert = s.certificate()
    assert cert.kkt.max <= tol, cert.kkt
    assert cert.fallbacks == 0


@SETTINGS
@given(seed=st.integers(0, 10_000), C=st.sampled_from([0.12, 0.2, 0.3]), sigma=st.sampled_from([1.0, 2.0]),
       ops=ops_strategy)
def test_random_sequences_keep_kkt(seed, C, sigma, ops):
    rng = np.random.default_rng(seed)
    s = IncrementalSVDD(C=C, sigma=sigma)
    need = int(np.ceil(1 / C)) + 2
    s.add(rng.standard_normal((need, 3)))
    history = {int(i): k for i, k in zip(s.ids, s.keys, strict=True)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for op, m in ops:
            if op == "add":
                keys = rng.standard_normal((m, 3))
                rec = s.add(keys)
                history.update({i: k for i, k in zip(rec.ids, keys, strict=True)})
            elif op == "remove" and (s.n - m) * C >= 1 and s.n - m >= need:
                victims = rng.choice(s.ids, size=m, replace=False)
                s.remove(victims)
                for v in victims:
                    history.pop(int(v))
            elif op == "evict" and not s.in_warmup:
                s.evict_reserve()
            check_invariants(s)
    # the maintained solution equals the refit of the whole retained history (evicted keys included)
    ids = np.array(sorted(history))
    ref = refit(np.stack([history[i] for i in ids]), C=C, sigma=sigma, ids=ids)
    assert ref.converged  # an independent oracle (the solver never fell back: check_invariants)
    probes = rng.standard_normal((20, 3))
    np.testing.assert_allclose(s.decision_function(probes), ref.decision_function(probes), atol=1e-9, rtol=0)
    np.testing.assert_allclose(s.alpha_of(ids), ref.alpha, atol=1e-9, rtol=0)


@SETTINGS
@given(seed=st.integers(0, 10_000), n=st.integers(8, 30), m=st.integers(1, 4), nu=st.sampled_from([0.3, 0.5]))
def test_add_then_remove_restores_decision_function(seed, n, m, nu):
    rng = np.random.default_rng(seed)
    s = IncrementalSVDD.from_nu(nu=nu, n0=n, sigma=1.5)
    s.add(1.2 * rng.standard_normal((n, 4)))
    probes = rng.standard_normal((25, 4))
    f0, a0 = s.decision_function(probes), s.alpha
    rec = s.add(1.2 * rng.standard_normal((m, 4)))
    s.remove(list(rec.ids))
    np.testing.assert_allclose(s.decision_function(probes), f0, atol=1e-10, rtol=0)
    np.testing.assert_allclose(s.alpha, a0, atol=1e-10, rtol=0)
    check_invariants(s)
