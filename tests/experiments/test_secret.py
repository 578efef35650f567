import json

import numpy as np

from sv_attention.cli import main
from sv_attention.experiments._common import rbf_readout
from sv_attention.experiments.secret import run_secret


def test_rbf_readout_matches_solver_readout():
    from sv_attention.svdd import IncrementalSVDD

    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 3))
    v = rng.standard_normal((12, 2))
    s = IncrementalSVDD.from_nu(0.5, 12, 1.5)
    s.add(x, ids=np.arange(12))
    q = x + 0.1 * rng.standard_normal(x.shape)
    ours = rbf_readout(q, x, s.alpha_of(np.arange(12)), v, 1.5)
    assert np.abs(ours - s.readout(q, {i: v[i] for i in range(12)})).max() < 1e-13


def test_secret_smallest_setting_exact_deletion_matches_never_saw_it():
    p = run_secret(trials=2, probes_per_key=2)
    s = p["summary"]
    assert s["max_readout_deviation_exact"] < 1e-9
    assert s["max_decision_deviation_exact"] < 1e-9
    assert s["fallbacks"] == 0
    assert len(p["trials"]) == 2
    for r in p["trials"]:
        # Decay leaves the secret's trace: its deviation is far above the exact decrement's.
        for g in ("0.5", "0.1", "0.01"):
            assert r["decay"][g]["deviation"] > 1e3 * r["readout_deviation_exact"]
    assert {row["metric"] for row in p["table"]} >= {"secret retrieved before deletion"}


def test_reproduce_secret_cli_writes_json_and_png(tmp_path):
    out = tmp_path / "secret.json"
    assert main(["reproduce", "secret", "--trials", "1", "--probes-per-key", "1", "--json", str(out),
                 "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert data["name"] == "secret" and "published" in data and "provenance" in data
    assert out.with_suffix(".png").stat().st_size > 1000
