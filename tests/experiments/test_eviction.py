"""The eviction study (sv_attention.experiments.eviction): its invariants."""

from __future__ import annotations

import numpy as np

from sv_attention.experiments import eviction as study
from sv_attention.svdd import refit


def test_batch_trial_matches_budget_and_keeps_the_support() -> None:
    rng = np.random.default_rng(0)
    t = study.make_trial(rng)
    assert t["keys"].shape == (66, 4) and (t["groups"][:6] == np.arange(6)).all()
    row = study.batch_trial(t, rng)
    ref = refit(t["keys"], C=1.0 / (study.NU * 66), sigma=study.SIGMA)
    assert row["budget"] == int((ref.alpha > 1e-12).sum())
    for name in ("certified", "h2o", "random", "recency"):
        assert row[name]["kept"] == row["budget"]
    assert row["recency"]["rare_kept"] == 0  # rare keys come first in the stream


def test_recall_reads_out_the_nearest_group() -> None:
    keys = np.array([[0.0, 0, 0, 0], [5.0, 0, 0, 0]])
    groups = np.array([0, 7])
    queries = np.array([[0.1, 0, 0, 0], [4.9, 0, 0, 0]])
    r = study.recall(keys, groups, np.array([True, True]), queries, np.array([0, 7]))
    assert r.tolist() == [1.0, 1.0]
    r = study.recall(keys, groups, np.array([False, True]), queries, np.array([0, 7]))
    assert r.tolist() == [0.0, 1.0]


def test_stream_trial_matches_the_online_budget_and_keeps_the_support() -> None:
    rng = np.random.default_rng(1)
    t = study.make_trial(rng)
    for order in ("protocol", "shuffled"):
        row = study.stream_trial(t, np.random.default_rng(2), order)
        n, budget = row["n"], row["budget"]
        assert row["certified"]["kept"] == budget < n
        for name in study.STREAM_POLICIES:
            assert row[name]["kept"] == budget  # matched at the end ...
        # ... and online: after every boundary each baseline held what the certified cache held
        assert row["budget_trace"][-1] == budget and len(row["budget_trace"]) == -(-n // study.STREAM_CHUNK)
        kept = set(row["certified"]["positions"])
        assert set(row["support"]) <= kept  # no support vector of the final solver was evicted
        last_chunk = set(range((n - 1) // study.STREAM_CHUNK * study.STREAM_CHUNK, n))
        assert last_chunk <= kept  # the current chunk is read densely, never evicted
        assert row["recency"]["positions"] == list(range(n - budget, n))
    row = study.stream_trial(t, np.random.default_rng(2), "protocol")
    assert row["recency"]["rare_kept"] == 0  # the rare keys open the stream


def test_stream_certified_equals_the_batch_support_of_the_admitted_prefix() -> None:
    """In the protocol order the final solver is the exact fit of the admitted prefix (same C, sigma)."""
    rng = np.random.default_rng(3)
    t = study.make_trial(rng)
    row = study.stream_trial(t, np.random.default_rng(4), "protocol")
    n, c = row["n"], study.STREAM_CHUNK
    m = (n - 1) // c * c  # admitted prefix
    ref = refit(t["keys"][:m], C=1.0 / (study.NU * n), sigma=study.SIGMA)
    assert row["support"] == np.flatnonzero(ref.alpha > 1e-12).tolist()
