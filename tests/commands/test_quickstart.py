import json
import math
from pathlib import Path

import pytest

from sv_attention.train.quickstart import QuickstartOptions, run_quickstart

OPERATORS = ["sv", "softmax"]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SV_ATTENTION_CACHE", str(tmp_path_factory.getbasetemp() / "corpus-cache"))


def test_tiny_quickstart_end_to_end(tmp_path, capsys):
    opts = QuickstartOptions(run_dir=str(tmp_path / "qs"), steps=4, batch_size=4, hidden_size=32, num_layers=1,
                             num_heads=2, block_size=48, chunk=16, warmup_steps=1, eval_every=4, eval_bytes=256,
                             embedded_bytes=60_000, operators=list(OPERATORS), sample_bytes=8, progress=False)
    s = run_quickstart(opts)
    out = capsys.readouterr().out
    assert all(f"[{i}/7]" in out for i in range(1, 8))
    assert s["ok"] and s["verify"]["exit_code"] == 0
    assert set(s["val_bpb"]) == set(OPERATORS) and all(math.isfinite(v) for v in s["val_bpb"].values())
    assert s["reload"]["max_logit_difference"] <= 1e-5 and s["reload"]["sample"].startswith(opts.prompt)
    ev, de = s["certified"]["eviction"], s["certified"]["deletion"]
    assert ev["certified"] and ev["n_evicted"] > 0 and ev["kkt_max"] < 1e-9
    assert ev["next_token_logit_change"] <= 1e-5  # certified eviction leaves the output unchanged
    assert de["paths"] == {"1": "exact decrement"} and de["max_refit_deviation"] < 1e-8
    paths = s["paths"]
    art = Path(paths["artifact"])
    card = (art / "README.md").read_text()
    assert "validation bits per byte" in card.lower() and "not comparable" in card
    training = json.loads((art / "MANIFEST.json").read_text())["training"]
    assert training["steps"] == 4 and training["dataset"] == "embedded"
    assert training["data"]["validation"]["start"] == training["data"]["train"]["end"]
    assert json.loads(Path(paths["verify_report"]).read_text())["ok"] is True
    saved = json.loads((tmp_path / "qs" / "quickstart.json").read_text())
    assert saved["val_bpb"] == s["val_bpb"] and saved["provenance"]["git_commit"] is not None
