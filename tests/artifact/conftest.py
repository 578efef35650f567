"""A tiny exported artifact shared by the artifact tests (exported once per session, copied per test)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from configuration_sv import SVConfig
from modeling_sv import SVForCausalLM
from sv_attention.artifact.export import export_artifact

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64)


def tiny_model(operator: str = "ceq", seed: int = 0) -> SVForCausalLM:
    torch.manual_seed(seed)
    model = SVForCausalLM(SVConfig(operator=operator, **TINY)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.attn, "ceq_alpha"):
                layer.attn.ceq_alpha.fill_(0.4)
    return model


@pytest.fixture(scope="session")
def exported(tmp_path_factory) -> tuple[SVForCausalLM, Path]:
    model = tiny_model()
    out = tmp_path_factory.mktemp("artifact") / "sv-lm"
    export_artifact(model, out, command="pytest export", results_dir=None)
    return model, out


@pytest.fixture
def artifact_copy(exported, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(exported[1], dst)
    return dst
