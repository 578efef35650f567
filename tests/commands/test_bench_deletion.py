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
