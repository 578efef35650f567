"""The smallest setting of ``sv-attention bench step`` runs and writes a consistent JSON."""

import json

import torch

from sv_attention.cli import main
from sv_attention.commands.bench_step import build_decoder


def test_both_arms_share_the_backbone():
    cfg = dict(layers=2, d_model=16, heads=2, block=24, chunk=8, nu=0.5, seed=3)
    sv, sdpa = build_decoder("sv", **cfg), build_decoder("sdpa", **cfg)
    a, b = sv.state_dict(), sdpa.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bench_step_smallest_setting(tmp_path, capsys):
    out = tmp_path / "step.json"
    rc = main(["bench", "step", "--layers", "1", "--d-model", "16", "--heads", "2", "--block", "24", "--batch", "2",
               "--chunk", "8", "--repeats", "1", "--warmup", "0", "--backend", "torch", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    st = data["step_s"]
    assert abs(data["ratio_sv_over_sdpa"] - st["sv"] / st["sdpa"]) < 1e-12
    assert abs(data["tokens_per_s"]["sv"] - 2 * 24 / st["sv"]) < 1e-6
    labels = [r["label"] for r in data["profile_sv_step"]]
    assert "sv.finder" in labels and labels[-1].startswith("total")
    assert data["profile_sv_step"][-1]["ms"] > 0
    assert "ratio sv/sdpa" in capsys.readouterr().out
    # the second row: the model `make demo` trains, measured the same way
    first, demo, trained = data["rows"]
    assert first["name"] == "flags" and first["ratio_sv_over_sdpa"] == data["ratio_sv_over_sdpa"]
    assert demo["name"] == "make demo" and demo["target_ratio"] == 2.0
    assert {k: demo["config"][k] for k in ("layers", "d_model", "heads", "block", "chunk")} == \
        {"layers": 2, "d_model": 128, "heads": 4, "block": 128, "chunk": 32}
    assert abs(demo["ratio_sv_over_sdpa"] - demo["step_s"]["sv"] / demo["step_s"]["sdpa"]) < 1e-12
    demo_profile = {r["label"]: r["ms"] for r in demo["profile_sv_step"]}  # profiled at both sizes
    assert demo_profile["sv.gate"] > 0 and demo_profile["total (profiled step)"] >= demo_profile["sv.gate"]
    # the third row: the published checkpoint's trained weights on text, SV vs the same weights with softmax
    assert trained["name"] == "published checkpoint (trained weights, text)" and trained["target_ratio"] is None
    assert trained["config"]["checkpoint"] == "hf_artifact" and trained["config"]["batch"] == 2
    assert abs(trained["ratio_sv_over_sdpa"] - trained["step_s"]["sv"] / trained["step_s"]["sdpa"]) < 1e-12
    # the weights were trained with the SV operator: its loss is far below log(256) = 5.5 nats per byte (the
    # softmax arm runs the same weights with another operator, so only its time is comparable)
    assert 0.0 < trained["loss"]["sv"] < 2.0 and 0.0 < trained["loss"]["sdpa"] < 10.0
    assert trained["gate_stats_timed_steps"]["pdas_problems"] > 0
