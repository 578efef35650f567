"""``sv-attention bench cache``: the smallest setting end to end (no timing assertions)."""

from __future__ import annotations

import json

from sv_attention.cli import main


def test_bench_cache_smallest_setting(tmp_path, capsys) -> None:
    out = tmp_path / "bench_cache.json"
    rc = main(["bench", "cache", "--context", "24", "--new-tokens", "4", "--trials", "2", "--hidden", "32",
               "--layers", "2", "--heads", "4", "--kv-heads", "2", "--chunk", "8", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    d = data["deletion"]
    assert d["deletions"] == 2 and d["solvers_per_deletion"] == 2 * 2
    assert set(d["per_layer_head_median_ms"]) == {"L0H0", "L0H1", "L1H0", "L1H1"}
    assert d["max_kkt_residual"] < 1e-9 and d["median_rollback_snapshot_ms"] > 0
    for m in data["memory"]:
        assert m["certified"]
        assert m["memory_bytes_after"] <= m["memory_bytes_before"]
        assert 0.0 <= m["realised_fraction"] <= m["mean_reserve_fraction"] + 1e-12 <= 1.0 + 1e-12
        assert m["tiers_after"]["kv_bytes"] == m["memory_bytes_after"]
        assert m["all_tiers_bytes_after"] == sum(m["tiers_after"].values()) > m["memory_bytes_after"]
        # what leaves the kv tensors (keys, values, an int64 position per slot) lands in the offload tier
        freed = m["memory_bytes_before"] - m["memory_bytes_after"]
        assert m["tiers_after"]["offload_bytes"] == freed - 8 * m["evicted_tokens"]
    dec = data["decode"]
    assert dec["greedy_tokens_equal_certified_vs_evicted"]  # certified eviction changes no token
    for name in ("certified", "certified_evicted"):
        assert dec[name]["decode_ratio_to_dynamic"] > 0
    assert "decode vs dynamic" in capsys.readouterr().out
