"""The smallest setting of ``sv-attention bench gate`` runs and writes a consistent JSON."""

import json

from sv_attention.cli import main


def test_bench_gate_smallest_setting(tmp_path, capsys):
    out = tmp_path / "gate.json"
    rc = main(["bench", "gate", "--kinds", "clustered", "--ns", "20", "--ds", "4", "--nus", "0.5", "--problems", "3",
               "--baseline-iters", "10", "--throughput-gs", "4", "--throughput-ns", "12", "--repeats", "1",
               "--backends", "torch", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    (cell,) = data["accuracy"]
    assert cell["problems"] == 3 and cell["n"] == 20 and cell["C"] == 1 / (0.5 * 20)
    assert 0 <= cell["problem_agreement"] <= cell["token_agreement"] <= 1
    assert data["summary"]["problem_agreement"] == cell["problem_agreement"]
    assert cell["reference"] == ["refit"] and cell["reference_max_kkt"] < 1e-9
    # the default (ridged) coefficients are an approximation; ridge 0 on an agreeing partition is exact
    if cell["problem_agreement"] == 1.0:
        assert cell["max_abs_alpha_err_ridge0"] < 1e-5
    (thr,) = data["throughput"]
    assert thr["G"] == 4 and abs(thr["torch_problems_per_s"] * thr["torch_s"] - 4) < 1e-6
    assert "provenance" in data and "overall: problem agreement" in capsys.readouterr().out
