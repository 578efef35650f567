import json

import numpy as np
import pytest

from sv_attention.experiments.lm_probe import paired_test, record_gate_support, run_lm, verdict


def test_paired_test_matches_scipy_ttest_rel():
    stats = pytest.importorskip("scipy.stats")
    a = np.array([2.31, 2.40, 2.35, 2.38])
    b = np.array([2.20, 2.33, 2.30, 2.31])
    res = paired_test((a - b).tolist())
    ref = stats.ttest_rel(a, b)
    assert abs(res["t"] - ref.statistic) < 1e-10 and abs(res["p_two_sided"] - ref.pvalue) < 1e-10
    assert res["df"] == 3 and paired_test([0.1])["t"] is None


def test_record_gate_support_counts_positive_alpha_per_active_gate():
    import torch

    from sv_attention.ops.settings import SVSettings
    from sv_attention.ops.sv_gate import sv_gate_attention
    from sv_attention.ops.sv_gate.gate import _OBSERVERS

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1, 24, 4, generator=g) for _ in range(3))
    vis = torch.tril(torch.ones(24, 24, dtype=torch.bool))[None].expand(2, 24, 24)
    with record_gate_support() as sizes:
        res = sv_gate_attention(q, k, v, vis, SVSettings(chunk=8, C=0.25))
    expect = []
    for s in (8, 16):
        expect += (res.gate.alphas[s] > 0).sum(-1).reshape(-1).tolist()
    assert sorted(sizes) == sorted(expect) and len(sizes) == len(expect) > 0
    assert not _OBSERVERS  # removed on exit


@pytest.mark.slow
def test_lm_probe_smallest_setting(tmp_path):
    import torch

    # Two seeds x three tiny trainings (SV, SWA, softmax) of two steps each, plus the support measurement.
    threads_before = torch.get_num_threads()
    p = run_lm(seeds=(0, 1), steps=2, hidden_size=16, num_layers=1, num_heads=1, block_size=32, batch_size=2,
               chunk=8, n0=8, eval_bytes=64, embedded_bytes=20_000, run_root=tmp_path / "runs", threads=1)
    assert torch.get_num_threads() == threads_before  # restored
    assert [r["seed"] for r in p["trials"]] == [0, 1]
    for r in p["trials"]:
        assert r["swa_window"] == round(r["support"]["mean"]) + 8
        assert set(r["val_bpb"]) == {"sv", "swa", "softmax"} and all(np.isfinite(list(r["val_bpb"].values())))
        assert len(set(r["parameters"].values())) == 1  # identical backbone for the three operators
        assert set(r["wall_s"]) == {"sv", "swa", "softmax"} and all(v > 0 for v in r["wall_s"].values())
    s = p["summary"]
    d = [r["val_bpb"]["swa"] - r["val_bpb"]["sv"] for r in p["trials"]]
    assert s["paired"]["swa_minus_sv"]["diffs"] == pytest.approx(d) and s["paired"]["swa_minus_sv"]["df"] == 1
    assert "SV lower in" in s["paired"]["softmax_minus_sv"]["verdict"]
    # two untrained models sit near the unigram level (byte frequencies), which is far below 8 bits
    assert 3.0 < s["unigram_bpb"] < 8.0
    assert s["wall_s_total"] >= sum(sum(r["wall_s"].values()) for r in p["trials"])
    assert "NOT enwik8" in s["corpus"] and len(p["table"]) == 3
    json.dumps(p)


def test_verdict_says_within_noise_unless_p_is_small():
    assert "within noise" in verdict(paired_test([0.1, -0.05, 0.02]))
    v = verdict(paired_test([0.30, 0.28, 0.31]))
    assert v.startswith("SV lower in 3/3 seeds") and "SV better" in v
    assert "the baseline better" in verdict(paired_test([-0.30, -0.28, -0.31]))
    assert "one seed, no test" in verdict(paired_test([0.1]))
