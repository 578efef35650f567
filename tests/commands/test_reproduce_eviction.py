"""``sv-attention reproduce eviction``: the smallest setting end to end."""

from __future__ import annotations

import json

from sv_attention.cli import main


def test_command_writes_json_and_figure(tmp_path, capsys) -> None:
    out = tmp_path / "eviction.json"
    assert main(["reproduce", "eviction", "--trials", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["protocol"]["trials"] == 2
    for name in ("certified", "h2o", "random", "recency"):
        assert 0.0 <= data["batch"][name]["rare"] <= 1.0
    for panel in ("streamed", "streamed_shuffled"):
        for name in ("certified", "h2o", "random", "recency"):
            assert 0.0 <= data[panel][name]["rare"] <= 1.0
    assert data["published"]["batch"]["certified"] == 0.861
    assert (tmp_path / "eviction.png").stat().st_size > 0
    assert "rare recall" in capsys.readouterr().out
