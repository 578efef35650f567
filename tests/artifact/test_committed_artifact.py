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
