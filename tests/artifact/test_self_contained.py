"""The exported artifact loads and runs where sv_attention (and the optional packages) cannot be imported.

One child process (``sys.meta_path`` import blocker for sv_attention, mlx, accelerate, datasets,
matplotlib; fresh ``HF_MODULES_CACHE``; ``HF_HUB_OFFLINE=1``) loads a tiny gating sv model exported into
tmp_path and the committed ``hf_artifact/`` through ``AutoConfig`` / ``AutoTokenizer`` /
``AutoModelForCausalLM`` / ``pipeline`` and records logits and generations (greedy, sampled, left-padded
batch, beams); this process computes the same with the repository's classes and they must agree.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from configuration_sv import SVConfig
from modeling_sv import SVForCausalLM
from sv_attention.artifact.clean_env import (
    BLOCKED,
    compare_probes,
    make_clean_env,
    package_probe,
    run_probe,
    verify_clean_env,
)
from sv_attention.artifact.export import export_artifact
from sv_attention.errors import ArtifactError

ROOT = Path(__file__).resolve().parents[2]
ART = ROOT / "hf_artifact"
HAVE_COMMITTED = (ART / "MANIFEST.json").is_file()


def tiny_sv_model() -> SVForCausalLM:
    """An sv model that gates within its block (chunk 16 < 64), with weights large enough to matter."""
    torch.manual_seed(3)
    config = SVConfig(operator="sv", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      max_position_embeddings=64, operator_config={"chunk": 16, "n0": 16})
    return SVForCausalLM(config).eval()


@pytest.fixture(scope="module")
def blocked_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("selfcontained") / "tiny-sv"
    export_artifact(tiny_sv_model(), folder, command="pytest export", results_dir=None)
    folders = [folder] + ([ART] if HAVE_COMMITTED else [])
    result = run_probe(folders, blocked=BLOCKED, timeout=600)
    records = {Path(k).name: v for k, v in result["folders"].items()}
    return result, records, folder


def test_the_child_could_import_none_of_the_blocked_packages(blocked_run):
    result, _, _ = blocked_run
    assert result["importable"] == dict.fromkeys(BLOCKED, False)


def test_tiny_sv_artifact_loads_as_remote_code_and_equals_the_package_path(blocked_run):
    _, records, folder = blocked_run
    rec = records["tiny-sv"]
    for kind in ("config", "tokenizer", "model"):
        assert rec["classes"][kind].startswith("transformers_modules."), rec["classes"]
    assert compare_probes(rec, package_probe(folder)) == []
    assert rec["padding_side"] == "left" and rec["padded_mask"][1][0] == 0  # the batch really is left-padded
    assert len(rec["beams"]) == len(rec["greedy"])


def test_the_model_names_its_gate_path_in_one_log_line(blocked_run):
    _, records, _ = blocked_run
    lines = records["tiny-sv"]["backend_log"]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "gate solver 'batched'" in lines[0] and "partition finder torch" in lines[0]
    assert "MLX finder not installed" in lines[0]  # mlx is blocked: the optional finder is reported absent


def test_empty_prompt_raises_the_shipped_invalid_input_error(blocked_run):
    _, records, _ = blocked_run
    err = records["tiny-sv"]["empty_prompt_error"]
    assert err["type"] == "InvalidInputError" and err["module"].endswith(".sv_errors")
    assert "empty input" in err["message"]


@pytest.mark.skipif(not HAVE_COMMITTED, reason="no committed artifact")
def test_committed_artifact_loads_without_sv_attention(blocked_run):
    _, records, _ = blocked_run
    rec = records[ART.name]
    assert rec["classes"]["model"].startswith("transformers_modules.")
    assert compare_probes(rec, package_probe(ART)) == []


# ------------------------------------------------------------------------------------------ clean virtualenv
@pytest.mark.slow
def test_clean_virtualenv_loads_the_artifact(exported, tmp_path):
    """A real ``python -m venv`` with only torch, transformers and safetensors (about 1-2 minutes here)."""
    venv = Path(os.environ.get("SV_CLEAN_ENV_DIR", tmp_path / "venv"))
    try:
        make_clean_env(venv)
    except ArtifactError as exc:
        if "pip install" in str(exc):
            pytest.skip(f"the pinned packages cannot be installed here: {str(exc)[:200]}")
        raise
    result = verify_clean_env(exported[1], venv=venv)
    assert result["ok"], result["problems"]
    assert result["importable"]["sv_attention"] is False
    assert result["max_logits_difference"] <= 1e-5
