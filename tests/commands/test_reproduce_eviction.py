"""``sv-attention reproduce eviction``: the smallest setting end to end, and the study's invariants."""

from __future__ import annotations

import json

import numpy as np

from sv_attention.cli import main
from sv_attention.commands import reproduce_eviction as study
from sv_attention.svdd import refit


def test_command_writes_json_and_figure(tmp_path, capsys) -> None:
    out = tmp_path / "eviction.json"
    assert main(["reproduce", "eviction", "--trials", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["protocol"]["trials"] == 2
    for name in ("certified", "h2o", "random", "recency"):
        assert 0.0 <= data["batch"][name]["rare"] <= 1.0
    for name in ("certified", "h2o", "random"):
        assert 0.0 <= data["streamed"][name]["rare"] <= 1.0
    assert data["published"]["batch"]["certified"] == 0.861
    assert (tmp_path / "eviction.png").stat().st_size > 0
    assert "rare recall" in capsys.readouterr().out


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


def test_stream_trial_matches_the_online_budget() -> None:
    rng = np.random.default_rng(1)
    row = study.stream_trial(study.make_trial(rng), rng)
    assert row["certified"]["kept"] == row["budget"] < row["n"]
    assert row["h2o"]["kept"] == row["random"]["kept"] == row["budget"]
