"""The committed artifact (hf_artifact/), when present: consistent with its manifest and with this code."""

from __future__ import annotations

from pathlib import Path

import pytest

from sv_attention.artifact.remote import CODE_FILES
from sv_attention.artifact.verify import verify_artifact

ROOT = Path(__file__).resolve().parents[2]
ART = ROOT / "hf_artifact"
pytestmark = pytest.mark.skipif(not (ART / "MANIFEST.json").is_file(), reason="no committed artifact yet")


def test_committed_artifact_matches_its_manifest():
    report = verify_artifact(ART, load=False)
    assert report.ok, "hf_artifact/ does not match its MANIFEST.json:\n" + "\n".join(report.problems)


def test_committed_artifact_ships_this_repository_code():
    stale = [n for n in CODE_FILES if (ART / n).read_bytes() != (ROOT / n).read_bytes()]
    assert not stale, f"hf_artifact/ ships outdated {stale}; re-run `sv-attention export ... --out hf_artifact`"


def test_model_card_at_the_root_is_the_committed_card():
    card = ROOT / "MODEL_CARD.md"
    assert card.is_file(), "MODEL_CARD.md is missing; export with --card-copy MODEL_CARD.md"
    assert card.read_text() == (ART / "README.md").read_text(), (
        "MODEL_CARD.md differs from hf_artifact/README.md; re-export with --card-copy MODEL_CARD.md")
