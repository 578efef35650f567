"""The model card: Hub metadata (model-index, datasets, language), a short reader's layout, numbers from
results/ with the results shipped in the folder, a usage snippet that runs as written, re-rendering."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from huggingface_hub import ModelCard

from sv_attention.artifact.card import MAX_LIMITS, copy_results, refresh_card, render_card, write_card
from sv_attention.artifact.manifest import read_manifest
from sv_attention.artifact.verify import verify_artifact
from sv_attention.published import HEADLINE
from sv_attention.results import repo_root, write_result

RESULTS = repo_root() / "results"
TRAINING = {"dataset": "embedded", "dataset_kind": "embedded", "steps": 300, "tokens_seen": 614400,
            "val_bpb": 1.23456, "data": {"source": {"kind": "embedded", "generator_version": 1, "sha256": "ab" * 32,
                                                    "description": "generated stories"},
                                         "train": {"n_bytes": 950, "sha256": "cd" * 32},
                                         "validation": {"n_bytes": 50, "sha256": "ef" * 32}}}


def _manifest(exported, **extra):
    return {**read_manifest(exported[1]), **extra}


def _section(text: str, name: str) -> str:
    return text.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]


def test_metadata_round_trips_with_a_model_index(tmp_path, exported):
    card = render_card(_manifest(exported, training=TRAINING), results_dir=None)
    card.save(tmp_path / "README.md")
    data = ModelCard.load(tmp_path / "README.md").data
    assert (data.library_name, data.pipeline_tag, data.license, data.language) == \
        ("transformers", "text-generation", "apache-2.0", "en")
    assert {"custom_code", "operator-ceq", "byte-level"} <= set(data.tags)
    assert data.datasets == ["sv-attention-generated-stories-v1"]  # not passed off as a Hub dataset
    (ev,) = data.eval_results
    assert (ev.metric_type, ev.metric_value, ev.task_type) == ("bits_per_byte", 1.2346, "text-generation")
    assert ev.dataset_type == "sv-attention-generated-stories-v1" and "not a Hub dataset" in ev.dataset_name
    assert ev.dataset_split == "validation (last 50 bytes)"
    hub = render_card(_manifest(exported, training={**TRAINING, "dataset_kind": "hub", "dataset": "org/ds"}))
    assert hub.data.datasets == ["org/ds"] and hub.data.eval_results[0].dataset_type == "org/ds"


def test_first_screen_and_length(exported):
    text = render_card(_manifest(exported, training=TRAINING), results_dir=RESULTS).text
    assert len(str(render_card(_manifest(exported, training=TRAINING), results_dir=RESULTS)).splitlines()) <= 150
    head = text.split("## Limits")[0]
    assert "AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)" in head
    assert 'path = "ORG/NAME"' in head and "pip install" not in text
    bullets = [line for line in _section(text, "Limits").splitlines() if line.startswith("- ")]
    assert 1 <= len(bullets) <= MAX_LIMITS
    assert "–" not in text and "see results/" not in text


def test_snippet_runs_as_written(exported):
    text = render_card(read_manifest(exported[1])).text
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    code = code.replace('"ORG/NAME"', repr(str(exported[1])))
    exec(compile(code, "card-snippet", "exec"), {"print": lambda *a: None})


def test_one_results_table_from_results_with_missed_targets_explained(exported):
    text = render_card(_manifest(exported, training=TRAINING), results_dir=RESULTS).text
    results = _section(text, "Results")
    assert results.count("| metric | published | this model |") == 1
    assert text.count("sv-attention reproduce") + text.count("sv-attention bench") == 0  # the command once, as a script
    assert "scripts/reproduce_all.sh" in results
    rows = [line for line in results.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(HEADLINE)
    assert not [r for r in rows if "not measured" in r]
    ceq = next(r for r in rows if r.startswith("| ceq / SDPA training step"))
    bench = json.loads((RESULTS / "bench_ceq.json").read_text())
    assert f"| {bench['targets']['op_wall_ratio_at_512']['value']:.3g} (missed; CPU product floor" in ceq
    forgetting = json.loads((RESULTS / "forgetting.json").read_text())
    assert f"{forgetting['regimes']['learned']['median_deviation']:.2e}" in results


def test_missing_results_say_so(tmp_path, exported):
    write_result("secret", {"table": [{"metric": "secret retrieved after exact deletion", "published": 0.0,
                                       "ours": 0.0}]}, path=tmp_path / "secret.json", command="x")
    results = _section(render_card(_manifest(exported), results_dir=tmp_path).text, "Results")
    assert "| planted secret retrieved after exact deletion | 0 | 0 |" in results
    assert "not measured (results/lm.json" not in results  # lm is not a headline row
    assert "not measured (results/bench_ceq.json has no such row)" in results
    assert "No `results/*.json`" in render_card(_manifest(exported)).text


def test_results_and_figure_ship_in_the_folder_and_are_hashed(tmp_path, exported):
    res = tmp_path / "results"
    res.mkdir()
    for name in ("secret.json", "bench_ceq.json"):
        shutil.copyfile(RESULTS / name, res / name)
    (res / "train_twins.png").write_bytes(b"\x89PNG fake")
    (res / "other.png").write_bytes(b"\x89PNG other")  # figures of other experiments stay out
    art = tmp_path / "art"
    shutil.copytree(exported[1], art)
    assert refresh_card(art, res, write=False)  # stale: the folder has no results yet
    changed = refresh_card(art, res)
    assert sorted(p.name for p in (art / "results").iterdir()) == ["bench_ceq.json", "secret.json", "train_twins.png"]
    assert {"README.md", "MANIFEST.json"} <= {p.rsplit("/", 1)[-1] for p in changed}
    files = read_manifest(art)["files"]
    assert {"results/secret.json", "results/bench_ceq.json", "results/train_twins.png"} <= set(files)
    text = (art / "README.md").read_text()
    assert "![validation bits per byte" in text and "(results/train_twins.png)" in text
    assert refresh_card(art, res, write=False) == []  # now up to date
    assert verify_artifact(art, load=False).ok


def test_write_card_copies_results(tmp_path, exported):
    out = tmp_path / "out"
    out.mkdir()
    assert copy_results(None, out) == []
    write_card(out, read_manifest(exported[1]), results_dir=RESULTS)
    assert (out / "results" / "bench_ceq.json").read_bytes() == (RESULTS / "bench_ceq.json").read_bytes()
    assert "| metric | published | this model |" in (out / "README.md").read_text()


@pytest.mark.parametrize("op, words", [("sv", "no deletion certificate"), ("ceq", "No certificate"),
                                       ("smprime", "not that it equals 1"), ("softmax", "plain masking"),
                                       ("ceq_path_sum", "no softmax underneath")])
def test_limits_are_operator_specific(exported, op, words):
    m = _manifest(exported)
    m["model"] = {**m["model"], "operator": op, "operator_config": {"chunk": 16}}
    limits = _section(render_card(m).text, "Limits")
    assert words in limits
    assert len([ln for ln in limits.splitlines() if ln.startswith("- ")]) <= MAX_LIMITS


def test_beta_wording_uses_the_beta_test_constant(exported, monkeypatch):
    import sv_attention.analysis.beta_test as bt

    monkeypatch.setattr(bt, "CHI2_95_1DOF", 9.25)
    m = _manifest(exported)
    m["model"] = {**m["model"], "operator": "smprime"}
    assert "Lambda <= 9.25" in _section(render_card(m).text, "Limits")


def test_committed_card_is_fresh():
    art = repo_root() / "hf_artifact"
    if not (art / "MANIFEST.json").is_file():
        pytest.skip("no committed artifact")
    stale = refresh_card(art, RESULTS, card_copy=repo_root() / "MODEL_CARD.md", write=False)
    assert not stale, f"{stale} out of date with results/: run `sv-attention render-readme`"
    card = ModelCard.load(art / "README.md")
    assert card.data.eval_results and card.data.eval_results[0].metric_type == "bits_per_byte"
    assert len(str(card).splitlines()) <= 150 and "–" not in card.text
