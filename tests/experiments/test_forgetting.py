"""The forgetting study (sv_attention.experiments.forgetting): the key regimes."""

import numpy as np

from sv_attention.experiments.forgetting import make_keys


def test_regime_generators_shapes():
    rng = np.random.default_rng(0)
    for regime in ("gaussian", "redundant", "near_duplicate"):
        X, sigma = make_keys(regime, rng, None)
        assert X.shape == (24, 6) and sigma == 2.0
    X, _ = make_keys("near_duplicate", rng, None)
    d = np.abs(X[:, None] - X[None]).sum(-1) + np.eye(24)
    assert (d == 0).any() and ((d > 0) & (d < 0.1)).any()  # exact repeats and near-duplicates
