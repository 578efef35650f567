import json

from sv_attention.cli import main


def test_bench_deletion_smallest_setting(tmp_path, capsys):
    out = tmp_path / "bd.json"
    assert main(["bench", "deletion", "--sizes", "24", "40", "--trials", "3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["n"] for r in data["rows"]] == [24, 40]
    for r in data["rows"]:
        assert r["trials"] == 3 and r["median_delete_ms"] > 0 and r["median_refit_ms"] > 0
        assert r["ratio"] == r["median_refit_ms"] / r["median_delete_ms"]
        assert r["max_abs_f_deviation"] <= 1e-10 and r["fallbacks"] == 0
        assert sum(r["partition_sizes"].values()) == r["n"]
    assert "provenance" in data and "ratio" in capsys.readouterr().out


def test_bench_deletion_near_duplicate_regime(tmp_path, capsys):
    """n/3 fresh keys, the rest copies (exact or 1e-3 jitter): exact deletion, converged refits, no fallback."""
    out = tmp_path / "bd.json"
    assert main(["bench", "deletion", "--sizes", "30", "--near-duplicate-sizes", "45", "--trials", "4",
                 "--json", str(out)]) == 0
    nd = json.loads(out.read_text())["near_duplicate"]
    assert [(r["regime"], r["n"]) for r in nd["rows"]] == [("exact", 45), ("jitter_1e-3", 45)]
    for r in nd["rows"]:
        assert r["max_abs_f_deviation"] <= 1e-9 and r["fallbacks"] == 0 and r["refits_converged"] == r["trials"]
    assert "near-duplicate keys (exact" in capsys.readouterr().out


def test_near_duplicate_stream_has_a_third_fresh_keys():
    import numpy as np

    from sv_attention.commands.bench_deletion import near_duplicate_keys

    X = near_duplicate_keys(90, 0.0, np.random.default_rng(0))
    assert np.unique(X, axis=0).shape[0] == 30  # every other key repeats an earlier one exactly
    J = near_duplicate_keys(90, 1e-3, np.random.default_rng(0))
    assert np.unique(J, axis=0).shape[0] == 90  # jittered copies: all distinct, n/3 of them fresh
