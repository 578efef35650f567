import json

from sv_attention.cli import main
from sv_attention.experiments.latency import run_latency


def test_latency_smallest_setting_is_exact(tmp_path):
    p = run_latency(sizes=(12,), trials=2)
    assert p["summary"]["max_decision_deviation"] <= 1e-8 and p["summary"]["meets_target"]
    assert p["trials"][0]["n"] == 12 and p["summary"]["ratio"]["12"] > 0
    out = tmp_path / "lat.json"
    assert main(["reproduce", "latency", "--sizes", "12", "--trials", "1", "--json", str(out), "--quiet"]) == 0
    assert json.loads(out.read_text())["published"]["max_decision_deviation"] == 5.3e-4
    assert out.with_suffix(".png").exists()
