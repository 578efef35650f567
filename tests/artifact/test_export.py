"""export: folder contents, remote-code loading, logits equality, tokenizer/pipeline, CLI, failed push."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from sv_attention.artifact.export import export_artifact
from sv_attention.artifact.remote import CODE_FILES
from sv_attention.artifact.siblings import generate_repository_code
from sv_attention.cli import main
from sv_attention.errors import ArtifactError, NetworkUnavailableError
from tests.artifact.conftest import tiny_model

EXPECTED = {"MANIFEST.json", "README.md", "config.json", "generation_config.json", "model.safetensors",
            "tokenizer_config.json", *CODE_FILES}


def expected_files() -> set[str]:
    """The non-code files and every generated remote-code file (entry points + flat siblings)."""
    return EXPECTED | set(generate_repository_code().files)


def test_folder_contents_and_auto_map(exported):
    _, out = exported
    assert {p.name for p in out.iterdir()} == expected_files()
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_sv.SVConfig",
                                  "AutoModelForCausalLM": "modeling_sv.SVForCausalLM"}
    assert config["model_type"] == "sv_lm" and config["sv_attention_version"]
    tok = json.loads((out / "tokenizer_config.json").read_text())
    assert tok["auto_map"]["AutoTokenizer"][0] == "tokenization_sv.SVByteTokenizer"
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert set(manifest["files"]) == expected_files() - {"MANIFEST.json"}
    code = generate_repository_code()
    for name, text in code.files.items():  # the shipped code is the generation from this checkout, exactly
        assert (out / name).read_text() == text
    assert manifest["code"]["entry_points"] == sorted(CODE_FILES)
    assert manifest["code"]["siblings"] == list(code.siblings)
    assert manifest["code"]["sources"]["modeling_sv.py"] == "modeling_sv.py"
    assert manifest["provenance"]["command"] == "pytest export"
    assert set(manifest["versions"]) >= {"sv_attention", "transformers", "torch"}


def test_remote_code_logits_equal_in_memory(exported):
    model, out = exported
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, local_files_only=True).eval()
    assert type(loaded).__module__.startswith("transformers_modules")
    x = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(x, use_cache=False).logits, model(x, use_cache=False).logits)
    assert float(loaded.model.layers[0].attn.ceq_alpha.detach()) == pytest.approx(0.4)


def test_tokenizer_and_pipeline_offline(exported):
    _, out = exported
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True, local_files_only=True)
    ids = tok("héllo")["input_ids"]
    assert ids == list("héllo".encode()) and tok.decode(ids) == "héllo"
    gen = pipeline("text-generation", model=str(out), trust_remote_code=True)
    text = gen("Once", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("Once")
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, local_files_only=True)
    ref = model.generate(torch.tensor([list(b"Once")]), max_new_tokens=5, do_sample=False)[0]
    assert text == tok.decode(ref)


def test_re_export_of_a_remote_code_model(exported, tmp_path):
    model, out = exported
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, local_files_only=True)
    manifest = export_artifact(loaded, tmp_path / "again", results_dir=None)
    first = json.loads((out / "MANIFEST.json").read_text())
    assert manifest["tensors"] == first["tensors"]  # same weights, byte for byte
    assert manifest["files"]["modeling_sv.py"] == first["files"]["modeling_sv.py"]


def test_refuses_non_empty_target(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(ArtifactError, match="not empty"):
        export_artifact(tiny_model("softmax"), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_cli_export_from_training_checkpoint(tmp_path, capsys):
    ckpt = tmp_path / "step_000007"
    tiny_model("swa").save_pretrained(ckpt)
    record = {"format": "sv-attention-checkpoint/1", "step": 7,
              "data": {"source": {"kind": "embedded", "name": "embedded"},
                       "train": {"n_bytes": 1234, "sha256": "ab" * 32}},
              "metrics": {"val_bpb": 4.5, "tokens_seen": 896}}
    (ckpt / "trainer_state.json").write_text(json.dumps(record))
    out = tmp_path / "art"
    assert main(["export", str(ckpt), "--out", str(out), "--no-results"]) == 0
    assert "parameters: total" in capsys.readouterr().out
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert manifest["training"]["steps"] == 7 and manifest["training"]["tokens_seen"] == 896
    assert manifest["model"]["operator"] == "swa"
    assert manifest["provenance"]["command"] == f"sv-attention export {ckpt} --out {out} --no-results"
    card = (out / "README.md").read_text()
    assert "- 7 steps" in card and "1,234 training bytes" in card
    assert main(["verify", str(out)]) == 0


def test_push_without_network_fails_clearly_and_writes_nothing(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_TOKEN", "hf_dummy_token_for_test")
    out = tmp_path / "art"
    with pytest.raises(NetworkUnavailableError, match="Nothing was written locally"):
        export_artifact(tiny_model("softmax"), out, push_to="someone/sv-lm", results_dir=None)
    assert list(tmp_path.iterdir()) == []  # no target, no partial folder


def test_cli_push_failure_exit_status(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_TOKEN", "hf_dummy_token_for_test")
    ckpt = tmp_path / "ckpt"
    tiny_model("softmax").save_pretrained(ckpt)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["export", str(ckpt), "--out", str(tmp_path / "art"), "--push-to", "x/y", "--private",
                 "--no-results"]) == 2
    assert "could not publish" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_shipped_code_has_no_package_import(exported):
    _, out = exported
    for path in out.glob("*.py"):
        text = path.read_text()
        assert "\nfrom sv_attention" not in text and "\nimport sv_attention" not in text, path.name
        assert "    from sv_attention" not in text, path.name  # function-level imports rewritten too


def test_generation_config_provenance_and_permissions(exported):
    import os
    import stat

    _, out = exported
    assert json.loads((out / "generation_config.json").read_text())["pad_token_id"] == 0  # the tokenizer's pad
    prov = json.loads((out / "MANIFEST.json").read_text())["provenance"]
    assert prov["git_dirty"] in (True, False, None) and prov["code_files_committed"] in (True, False, None)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o666 & ~umask


def test_re_export_of_an_artifact_keeps_its_training_record(tmp_path):
    ckpt = tmp_path / "ckpt"
    tiny_model("softmax").save_pretrained(ckpt)
    record = {"step": 7, "data": {"source": {"kind": "embedded", "name": "embedded"}},
              "metrics": {"val_bpb": 4.5, "tokens_seen": 896}}
    (ckpt / "trainer_state.json").write_text(json.dumps(record))
    first = export_artifact(ckpt, tmp_path / "art", results_dir=None)
    again = export_artifact(tmp_path / "art", tmp_path / "art", results_dir=None, overwrite=True)
    assert again["training"] == first["training"] and again["training"]["steps"] == 7
    assert again["tensors"] == first["tensors"]
