"""``sv-attention bench plugin`` at its smallest setting."""

from __future__ import annotations

import json

from sv_attention.cli import main


def test_bench_plugin_smallest_setting(tmp_path, capsys):
    out = tmp_path / "bench_plugin.json"
    rc = main(["bench", "plugin", "--contexts", "20", "--new-tokens", "3", "--hidden", "32", "--layers", "1",
               "--heads", "4", "--kv-heads", "2", "--chunk", "8", "--no-progress", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert set(rows) == {"sdpa", "eager", "ceq_a0", "ceq_a0.05", "sv_attention"}
    assert rows["ceq_a0"]["last_logits_bitwise_equal_sdpa"] is True
    assert rows["ceq_a0.05"]["last_logits_bitwise_equal_sdpa"] is False
    assert rows["sdpa"]["prefill_time_ratio_to_sdpa"] == 1.0
    for r in rows.values():
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
    assert set(data["targets"]) and all("met" in t for t in data["targets"].values())
    assert "provenance" in data
    stats = data["sv_gate_stats"]  # what the gate did in the timed runs (context 20, chunk 8: 1 layer fits)
    assert "warm_pdas_fallback" in stats and stats.get("dense_gram_calls", 0) + stats.get("lazy_gram_calls", 0) > 0
    printed = capsys.readouterr().out
    assert "sv_attention" in printed and "target:" in printed
