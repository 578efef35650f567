import json

from sv_attention.cli import main
from sv_attention.experiments.edit import run_edit


def test_edit_smallest_setting_exact_edit_leaves_no_trace():
    p = run_edit(trials=2, probes_per_key=2)
    s = p["summary"]
    assert s["residual_influence_exact_max"] < 1e-9
    assert s["decision_deviation_exact_max"] < 1e-9
    assert s["old_value_returned_exact"] == s["old_value_returned_reference"]
    # The exact edit answers exactly like the layer that never saw the old binding.
    assert s["new_value_returned_exact"] == s["new_value_returned_reference"]
    for r in p["trials"]:
        for g in r["decay"].values():
            if r["old_alpha_in_joint_fit"] > 0:  # an inert (reserve) old binding leaves no trace either way
                assert g["residual_influence"] > 1e3 * r["residual_influence_exact"]
            else:
                assert g["residual_influence"] < 1e-9


def test_reproduce_edit_cli(tmp_path):
    out = tmp_path / "e.json"
    assert main(["reproduce", "edit", "--trials", "1", "--probes-per-key", "1", "--json", str(out), "--quiet"]) == 0
    assert json.loads(out.read_text())["table"][0]["published"] == 0.0
    assert out.with_suffix(".png").exists()
