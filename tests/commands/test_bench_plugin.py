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
    assert "warm_pdas_fallback" in stats
    assert stats.get("dense_gram_calls", 0) + stats.get("lazy_gram_calls", 0) + stats.get("chain_fits", 0) > 0
    prof = data["profile_sv_prefill"]  # one profiled prefill, then the same prefill with its fits replayed
    labels = {r["label"]: r for r in prof["rows"]}
    assert prof["context"] == 20 and labels["sv.gate"]["ms"] > 0 and labels["total (profiled call)"]["share"] == 1.0
    assert sum(r["share"] for r in prof["rows"] if r["label"] in ("sv.gate", "sv.readout")) <= 1.0 + 1e-6
    assert 0 < prof["prefill_s_gates_replayed"] and prof["gates_replayed_time_ratio_to_sdpa"] == (
        prof["prefill_s_gates_replayed"] / prof["sdpa_prefill_s"])
    printed = capsys.readouterr().out
    assert "sv_attention" in printed and "target:" in printed and "gates replayed" in printed
