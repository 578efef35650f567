import json

from sv_attention.cli import main
from sv_attention.experiments.recall import run_recall


def test_recall_smallest_setting(tmp_path):
    p = run_recall(trials=2)
    for r in p["trials"]:
        assert r["kkt_max"] < 1e-9 and not r["fallback"]
        # Query token j sees 10 + j + 1 tokens; the support is a subset of them.
        sup = r["with_query_tokens_support"]
        assert all(1 <= s <= 11 + j for j, s in enumerate(sup))
        assert all(0.0 <= x <= 1.0 for x in r["with_query_tokens_alpha_on_query_tokens"])
    out = tmp_path / "r.json"
    assert main(["reproduce", "recall", "--trials", "1", "--json", str(out), "--quiet"]) == 0
    assert set(json.loads(out.read_text())["summary"]["pairs"]) == {"gated", "gate_off", "softmax"}
