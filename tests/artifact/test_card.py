"""The model card: YAML metadata, limits first, numbers from data with their command, round trip."""

from __future__ import annotations

import json

from huggingface_hub import ModelCard

from sv_attention.artifact.card import load_results, render_card, render_results
from sv_attention.results import write_result


def _manifest(exported):
    return json.loads((exported[1] / "MANIFEST.json").read_text())


def test_exported_card_metadata_and_order(exported):
    card = ModelCard.load(exported[1] / "README.md")
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation"
    assert card.data.license == "apache-2.0"
    assert "custom_code" in card.data.tags and "operator-ceq" in card.data.tags
    text = card.text
    order = [text.index(h) for h in ("## Limits", "## Usage", "## Parameters", "## Results",
                                     "## Manifest summary", "## Security note")]
    assert order == sorted(order)
    assert "trust_remote_code=True" in text and "revision" in text


def test_card_numbers_come_from_the_manifest(exported):
    manifest = _manifest(exported)
    text = (exported[1] / "README.md").read_text()
    p = manifest["parameters"]
    for key in ("total", "trainable", "excluding_tied_head", "excluding_embeddings"):
        assert f"{p[key]:,}" in text
    assert manifest["files"]["model.safetensors"]["sha256"] in text
    assert f"files: {len(manifest['files'])} hashed" in text
    assert "`model.layers.0.attn.ceq_alpha` | 1 |" in text


def test_results_rendered_with_command_beside_each_number(tmp_path, exported):
    write_result("bench_demo", {"speedup": 2.5, "rows": [{"n": 64, "agree": 0.97}], "ok": True},
                 path=tmp_path / "bench_demo.json", command="sv-attention bench demo --n 64")
    (tmp_path / "broken.json").write_text("{not json")
    results = load_results(tmp_path)
    md = render_results(results)
    assert "| speedup | 2.5 | `sv-attention bench demo --n 64` |" in md
    assert "| rows[0].n | 64 | `sv-attention bench demo --n 64` |" in md
    assert "| rows[0].agree | 0.97 | `sv-attention bench demo --n 64` |" in md
    assert "ok" not in [line.split("|")[1].strip() for line in md.splitlines() if line.startswith("| ")]
    assert "unreadable" in md
    card = render_card(_manifest(exported), results=results)
    assert "| speedup | 2.5 | `sv-attention bench demo --n 64` |" in card.text


def test_published_rows_come_first(tmp_path):
    write_result("secret", {"table": [{"metric": "recovered", "published": 0.0, "ours": 0.0}]},
                 path=tmp_path / "secret.json", command="sv-attention reproduce secret")
    write_result("zz_bench", {"ratio": 3.25}, path=tmp_path / "zz_bench.json", command="sv-attention bench zz")
    md = render_results(load_results(tmp_path))
    assert md.index("Published vs this implementation") < md.index("### zz_bench")
    assert "`sv-attention reproduce secret`" in md and "| ratio | 3.25 | `sv-attention bench zz` |" in md
    assert "### secret" not in md  # not repeated as a raw table


def test_limits_are_operator_specific(exported):
    manifest = _manifest(exported)
    for op, words in (("sv", "no deletion certificate"), ("sv", "deleted by masking"), ("sv", "pinned"),
                      ("smprime", "pinned"), ("ceq_path_sum", "no softmax underneath"),
                      ("ceq", "No certificate for this operator"), ("softmax", "plain masking")):
        m = {**manifest, "model": {**manifest["model"], "operator": op}}
        text = render_card(m, results=[]).text
        limits = text[text.index("## Limits"):text.index("## Usage")]
        assert words in limits, (op, words)
    m = {**manifest, "model": {**manifest["model"], "operator": "sv", "operator_config": {"solver": "exact"}}}
    text = render_card(m, results=[]).text
    assert "come from the exact fp64 solver" in text and "Detached gate" in text


def test_card_round_trip(tmp_path, exported):
    card = render_card(_manifest(exported), results=[], datasets=["roneneldan/TinyStories"], repo_id="org/name")
    card.save(tmp_path / "README.md")
    again = ModelCard.load(tmp_path / "README.md")
    assert again.data.datasets == ["roneneldan/TinyStories"]
    assert 'repo = "org/name"' in again.text


def test_beta_wording_uses_the_beta_test_constants(exported, monkeypatch):
    import sv_attention.ops.beta_test as bt

    monkeypatch.setattr(bt, "CHI2_95_1DOF", 9.25)  # rendered from the test's constant, not typed in the card
    m = {**_manifest(exported), "model": {**_manifest(exported)["model"], "operator": "smprime"}}
    limits = render_card(m, results=[]).text.split("## Usage")[0]
    assert "Lambda <= 9.25" in limits and "sqrt(9.25 / I)" in limits and "3.841" not in limits
    assert "not rejected" in limits and "never an exact value" in limits


def test_usage_snippet_runs_as_written_and_tree_state_is_reported(exported):
    manifest = _manifest(exported)
    text = render_card(manifest, results=[]).text
    assert "<pin" not in text and 'revision = "main"' in text
    prov = {**manifest["provenance"], "git_dirty": True, "code_files_committed": False}
    text = render_card({**manifest, "provenance": prov}, results=[]).text
    assert "the shipped code files differ from that commit" in text
