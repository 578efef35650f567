import json

import numpy as np

from sv_attention.cli import main
from sv_attention.experiments.capacity import near_orthogonal_keys, run_capacity


def test_near_orthogonal_keys_are_orthogonal_up_to_d_and_a_tight_frame_beyond():
    rng = np.random.default_rng(0)
    x = near_orthogonal_keys(8, 16, rng)
    g = x @ x.T
    assert np.allclose(g, 16 * np.eye(8), atol=1e-10)
    y = near_orthogonal_keys(40, 16, rng)
    assert np.allclose(np.linalg.norm(y, axis=1), 4.0)
    # A tight frame's frame operator is a multiple of the identity (before the row renormalisation it is
    # exactly I; after it, close to (n/d) * d I = n I).
    s = np.linalg.eigvalsh(y.T @ y)
    assert s.max() / s.min() < 3.0


def test_capacity_smallest_setting(tmp_path):
    p = run_capacity(items=(8,), trials=1)
    (tr,) = p["trials"]["8"]
    assert tr["kkt_max"] < 1e-9 and tr["items_in_support"] <= tr["support"]
    assert p["summary"]["per_items"]["8"]["deltanet_state_floats"] == 256
    out = tmp_path / "cap.json"
    assert main(["reproduce", "capacity", "--items", "8", "--trials", "1", "--json", str(out), "--quiet"]) == 0
    assert json.loads(out.read_text())["published"]["sv_support"] == [9, 37]
