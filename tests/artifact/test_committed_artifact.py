"""The committed artifact (hf_artifact/), when present: consistent with its manifest and with this code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sv_attention.artifact.remote import CODE_FILES
from sv_attention.artifact.siblings import stale_files
from sv_attention.artifact.verify import verify_artifact

ROOT = Path(__file__).resolve().parents[2]
ART = ROOT / "hf_artifact"
pytestmark = pytest.mark.skipif(not (ART / "MANIFEST.json").is_file(), reason="no committed artifact yet")


def test_committed_artifact_matches_its_manifest():
    report = verify_artifact(ART, load=False)
    assert report.ok, "hf_artifact/ does not match its MANIFEST.json:\n" + "\n".join(report.problems)


def test_committed_artifact_ships_this_repository_code():
    """The remote code (entry points + flat siblings) equals a fresh generation from this checkout."""
    stale = stale_files(ART)
    command = json.loads((ART / "MANIFEST.json").read_text())["provenance"]["command"]
    assert not stale, ("hf_artifact/ ships outdated remote code:\n  " + "\n  ".join(stale)
                       + f"\nre-export it: {command}")
    manifest = json.loads((ART / "MANIFEST.json").read_text())
    assert sorted(manifest["code"]["entry_points"]) == sorted(CODE_FILES)


def test_model_card_at_the_root_is_the_committed_card():
    card = ROOT / "MODEL_CARD.md"
    assert card.is_file(), "MODEL_CARD.md is missing; export with --card-copy MODEL_CARD.md"
    assert card.read_text() == (ART / "README.md").read_text(), (
        "MODEL_CARD.md differs from hf_artifact/README.md; re-export with --card-copy MODEL_CARD.md")


def test_committed_artifact_is_the_published_shape_and_count():
    """The shipped model is the paper's 3.22M configuration: d_model 256, 4 layers, 4 heads, block 256, byte
    vocabulary, tied head; 3,220,992 parameters excluding the tied head, counted from the weights."""
    from safetensors import safe_open

    cfg = json.loads((ART / "config.json").read_text())
    shape = {k: cfg[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                 "max_position_embeddings", "intermediate_size", "tie_word_embeddings")}
    assert shape == {"vocab_size": 256, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                     "max_position_embeddings": 256, "intermediate_size": 1024, "tie_word_embeddings": True}
    assert cfg["operator"] == "sv"
    with safe_open(str(ART / "model.safetensors"), framework="pt") as f:
        stored = {name: f.get_slice(name).get_shape() for name in f.keys()}
    total = sum(int(torch_numel(shape)) for shape in stored.values())
    assert "lm_head.weight" not in stored  # tied: stored once, as the token embedding
    assert total - 256 * 256 == 3_220_992  # excluding the tied head (= the token-embedding matrix)
    params = json.loads((ART / "MANIFEST.json").read_text())["parameters"]
    assert params["excluding_tied_head"] == 3_220_992 and params["published_reading"]["matches"]


def torch_numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
