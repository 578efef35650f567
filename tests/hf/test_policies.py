"""Eviction policies: one interface, matched budgets, certified never drops a support vector."""

from __future__ import annotations

import numpy as np
import pytest

from sv_attention.errors import ConfigError, InvalidHyperparameterError, InvalidInputError
from sv_attention.hf.policies import (
    POLICIES,
    CertifiedPolicy,
    HeavyHitterPolicy,
    PolicyContext,
    RandomPolicy,
    RecencyPolicy,
    get_policy,
    rbf_attention_mass,
)


def _ctx(n: int = 10, seed: int = 0) -> PolicyContext:
    rng = np.random.default_rng(seed)
    support = np.zeros(n, dtype=bool)
    support[[1, 4, 7]] = True
    return PolicyContext(positions=np.arange(n), keys=rng.normal(size=(n, 3)),
                         attention_mass=rng.random(n), support=support, rng=rng)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_meets_a_feasible_budget(name: str) -> None:
    ctx = _ctx()
    dec = get_policy(name).select(ctx, 5)
    assert dec.keep.shape == (10,) and dec.keep.dtype == bool
    assert dec.n_kept == 5 and dec.budget_met
    assert set(dec.evicted_index.tolist()) == set(np.flatnonzero(~dec.keep).tolist())


def test_certified_keeps_support_then_recent_reserve() -> None:
    ctx = _ctx()
    dec = CertifiedPolicy().select(ctx, 5)
    assert dec.certified
    assert dec.keep[[1, 4, 7]].all()
    assert dec.keep[[8, 9]].all()  # the two most recent reserve tokens fill the spare budget
    assert dec.n_kept == 5


def test_certified_never_drops_support_below_budget() -> None:
    ctx = _ctx()
    dec = CertifiedPolicy().select(ctx, 2)
    assert dec.keep[[1, 4, 7]].all() and dec.n_kept == 3
    assert not dec.budget_met


def test_recency_keeps_last_positions() -> None:
    ctx = PolicyContext(positions=np.array([5, 0, 9, 3, 7]))
    dec = RecencyPolicy().select(ctx, 2)
    assert dec.keep.tolist() == [False, False, True, False, True]
    assert not dec.certified


def test_h2o_keeps_heaviest_ties_to_recent() -> None:
    ctx = PolicyContext(positions=np.arange(5), attention_mass=np.array([1.0, 3.0, 2.0, 3.0, 0.5]))
    dec = HeavyHitterPolicy().select(ctx, 2)
    assert dec.keep.tolist() == [False, True, False, True, False]
    dec = HeavyHitterPolicy().select(ctx, 1)
    assert dec.keep.tolist() == [False, False, False, True, False]  # tie 3.0 -> the more recent


def test_random_is_reproducible_and_uniform_size() -> None:
    ctx = PolicyContext(positions=np.arange(20))
    a = RandomPolicy(seed=3).select(ctx, 7).keep
    b = RandomPolicy(seed=3).select(ctx, 7).keep
    assert (a == b).all() and a.sum() == 7


def test_policy_inputs_are_checked() -> None:
    with pytest.raises(InvalidInputError):
        CertifiedPolicy().select(PolicyContext(positions=np.arange(3)), 2)  # no support given
    with pytest.raises(InvalidInputError):
        RecencyPolicy().select(PolicyContext(positions=np.arange(3)), -1)
    with pytest.raises(InvalidInputError):
        PolicyContext(positions=np.arange(3), attention_mass=np.ones(4))
    with pytest.raises(ConfigError):
        get_policy("lru")


def test_rbf_attention_mass_matches_loop_reference() -> None:
    rng = np.random.default_rng(1)
    q, x = rng.normal(size=(6, 2)), rng.normal(size=(5, 2))
    mass = rbf_attention_mass(q, x, sigma=1.3)
    ref = np.zeros(5)
    for qi in q:
        w = np.array([np.exp(-np.sum((qi - xj) ** 2) / 1.3**2) for xj in x])
        ref += w / w.sum()
    np.testing.assert_allclose(mass, ref, rtol=1e-12)
    assert np.isclose(mass.sum(), 6.0)
    # causal: query at position p sees keys at positions <= p only
    qpos, kpos = np.arange(6), np.array([0, 2, 4, 6, 8])
    cm = rbf_attention_mass(q, x, sigma=1.3, causal=True, query_positions=qpos, key_positions=kpos)
    ref = np.zeros(5)
    for qi, p in zip(q, qpos, strict=True):
        vis = kpos <= p
        w = np.array([np.exp(-np.sum((qi - xj) ** 2) / 1.3**2) for xj in x]) * vis
        ref += w / w.sum()
    np.testing.assert_allclose(cm, ref, rtol=1e-12)
    with pytest.raises(InvalidHyperparameterError):
        rbf_attention_mass(q, x, sigma=0.0)


def test_softmax_attention_mass_matches_loop_reference() -> None:
    from sv_attention.hf.policies import softmax_attention_mass

    rng = np.random.default_rng(2)
    q, x = rng.normal(size=(5, 3)), rng.normal(size=(4, 3))
    ref = np.zeros(4)
    for qi in q:
        w = np.exp(x @ qi / np.sqrt(3))
        ref += w / w.sum()
    np.testing.assert_allclose(softmax_attention_mass(q, x), ref, rtol=1e-12)
    qpos, kpos = np.arange(5), np.array([0, 1, 3, 4])
    ref = np.zeros(4)
    for qi, p in zip(q, qpos, strict=True):
        w = np.exp(x @ qi / np.sqrt(3)) * (kpos <= p)
        ref += w / w.sum()
    got = softmax_attention_mass(q, x, causal=True, query_positions=qpos, key_positions=kpos)
    np.testing.assert_allclose(got, ref, rtol=1e-12)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_only_the_certified_policy_claims_a_certificate(name: str) -> None:
    """The flag the certified cache's receipts rely on: a decision is certified only from CertifiedPolicy,
    and a certified decision never drops a support token."""
    ctx = _ctx()
    for budget in (0, 2, 5, 10):
        dec = get_policy(name).select(ctx, budget)
        assert dec.certified == (name == CertifiedPolicy.name) == type(get_policy(name)).certified
        if dec.certified:
            assert dec.keep[ctx.support].all()
        else:
            assert dec.n_kept == min(budget, ctx.n) and dec.budget_met
