import json

import numpy as np

from sv_attention.cli import main
from sv_attention.experiments.selective_copy import baseline_readouts, run_selective_copy


def test_selective_copy_smallest_setting():
    p = run_selective_copy(fillers=(8,), trials=1)
    (tr,) = p["trials"]["8"]
    assert tr["informative_in_support"] + tr["filler_in_support"] == tr["support"] <= 16
    assert tr["kkt_max"] < 1e-9 and not tr["fallback"]
    for m in ("sv", "softmax", "linear", "deltanet"):
        assert 0.0 <= tr[m] <= 1.0
    assert p["summary"]["per_fillers"]["8"]["support_mean"] == tr["support"]


def test_baseline_readouts_return_the_value_of_a_single_matching_key():
    # With one key and query equal to it, every normalised readout returns that key's value exactly
    # (softmax, linear attention), and DeltaNet (beta=1, unit-normalised) stores it exactly.
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 4))
    v = rng.standard_normal((1, 3))
    out = baseline_readouts(k, v, k.copy())
    for name in ("softmax", "linear", "deltanet"):
        assert np.allclose(out[name], v, atol=1e-12), name


def test_reproduce_selective_copy_cli(tmp_path):
    out = tmp_path / "sc.json"
    assert main(["reproduce", "selective-copy", "--fillers", "8", "--trials", "1", "--json", str(out), "--quiet"]) == 0
    assert "sv_recall" in json.loads(out.read_text())["summary"]["per_fillers"]["8"]
    assert out.with_suffix(".png").exists()
