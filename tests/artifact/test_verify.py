"""verify: a clean export passes; every kind of tampering is detected and named; code is never run unverified."""

from __future__ import annotations

import json

import pytest
import torch

from sv_attention.artifact.manifest import read_safetensors_header
from sv_attention.artifact.verify import verify_artifact
from sv_attention.cli import main


def test_clean_export_passes(exported):
    report = verify_artifact(exported[1])
    assert report.ok, report.problems
    assert report.checks["load"]["model"] == "SVForCausalLM"
    assert report.checks["load"]["tokenizer"] == "SVByteTokenizer"
    assert report.checks["certificate"]["applicable"] is False  # ceq carries no SV certificate
    n_files = len(json.loads((exported[1] / "MANIFEST.json").read_text())["files"])
    assert report.checks["files"]["expected"] == report.checks["files"]["found"] == n_files
    assert report.checks["code"]["entry_points"] == 3 and report.checks["code"]["siblings"] > 10


def test_edited_sibling_file_is_named_and_not_executed(artifact_copy):
    path = artifact_copy / "sv_ops_sv_gate_gate.py"
    path.write_text(path.read_text().replace("import torch", "import torch  # tampered", 1))
    report = verify_artifact(artifact_copy)
    assert any(p.startswith("file size mismatch: sv_ops_sv_gate_gate.py") for p in report.problems)
    assert "refusing to execute" in report.checks["load"]


def test_python_file_outside_the_code_record_is_named(artifact_copy):
    p = artifact_copy / "MANIFEST.json"
    manifest = json.loads(p.read_text())
    manifest["code"]["siblings"].remove("sv_kernels.py")
    p.write_text(json.dumps(manifest))
    report = verify_artifact(artifact_copy, load=False)
    assert report.problems == ["python file sv_kernels.py is not in the manifest's code record (entry points "
                               "and generated siblings); re-export"]


def test_clean_env_cannot_combine_with_no_load(exported, capsys):
    assert main(["verify", str(exported[1]), "--no-load", "--clean-env"]) == 2
    assert "--clean-env loads the folder" in capsys.readouterr().err


def test_flipped_weight_byte_is_named(artifact_copy):
    path = artifact_copy / "model.safetensors"
    header, start = read_safetensors_header(path)
    name = "model.layers.1.mlp.fc_in.weight"
    begin, _ = header[name]["data_offsets"]
    data = bytearray(path.read_bytes())
    data[start + begin + 5] ^= 0x01
    path.write_bytes(bytes(data))
    report = verify_artifact(artifact_copy)
    assert not report.ok
    assert any(p.startswith("file hash mismatch: model.safetensors") for p in report.problems)
    assert any(p.startswith(f"tensor sha256 mismatch: {name}") for p in report.problems)
    assert sum(p.startswith("tensor ") for p in report.problems) == 1  # only the tampered tensor
    assert report.checks["load"].startswith("skipped")


def test_edited_code_file_is_named_and_not_executed(artifact_copy):
    path = artifact_copy / "modeling_sv.py"
    path.write_text(path.read_text() + "\nraise SystemExit('tampered code ran')\n")
    report = verify_artifact(artifact_copy)
    assert report.problems == [next(p for p in report.problems if "modeling_sv.py" in p)]
    assert report.problems[0].startswith("file size mismatch: modeling_sv.py")
    assert "refusing to execute" in report.checks["load"]


def test_same_size_code_edit_is_a_hash_mismatch(artifact_copy):
    path = artifact_copy / "configuration_sv.py"
    text = path.read_text()
    path.write_text(text.replace("default 256", "default 257", 1))
    report = verify_artifact(artifact_copy)
    assert any(p.startswith("file hash mismatch: configuration_sv.py") for p in report.problems)


def test_missing_and_unlisted_files(artifact_copy):
    (artifact_copy / "tokenization_sv.py").unlink()
    (artifact_copy / "extra.py").write_text("print('hi')\n")
    report = verify_artifact(artifact_copy)
    assert "missing file: tokenization_sv.py" in report.problems
    assert any(p.startswith("unlisted file: extra.py") for p in report.problems)


def test_missing_manifest(artifact_copy):
    (artifact_copy / "MANIFEST.json").unlink()
    report = verify_artifact(artifact_copy)
    assert len(report.problems) == 1 and "MANIFEST.json" in report.problems[0]


def test_wrong_parameter_count_is_named(artifact_copy):
    p = artifact_copy / "MANIFEST.json"
    manifest = json.loads(p.read_text())
    manifest["parameters"]["total"] += 1
    manifest["parameters"]["per_module"]["model.layers"] -= 4
    p.write_text(json.dumps(manifest))
    report = verify_artifact(artifact_copy)
    assert any(x.startswith("parameter count mismatch: total") for x in report.problems)
    assert any(x.startswith("parameter count mismatch: per_module[model.layers]") for x in report.problems)
    assert len(report.problems) == 2


def test_wrong_tensor_shape_record(artifact_copy):
    p = artifact_copy / "MANIFEST.json"
    manifest = json.loads(p.read_text())
    manifest["tensors"]["model.norm.weight"]["shape"] = [33]
    p.write_text(json.dumps(manifest))
    report = verify_artifact(artifact_copy, load=False)
    assert report.problems == ["tensor shape mismatch: model.norm.weight ([32] vs manifest [33])"]


def test_cli_exit_status(exported, artifact_copy, capsys):
    assert main(["verify", str(exported[1])]) == 0
    assert "OK" in capsys.readouterr().out
    (artifact_copy / "tokenizer_config.json").write_text("{}\n")
    assert main(["verify", str(artifact_copy), "--no-load"]) == 1
    err = capsys.readouterr().err
    assert "MISMATCH: file" in err and "tokenizer_config.json" in err


def test_forward_fingerprint_detects_changed_behaviour(artifact_copy):
    # a consistent re-hash of modified weights passes the hash checks but not the recorded forward pass
    from safetensors.torch import load_file, save_file

    from sv_attention.artifact.manifest import hash_files, hash_tensors

    path = artifact_copy / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.bias"] = tensors["model.norm.bias"] + 0.5
    save_file(tensors, path, metadata={"format": "pt"})
    mp = artifact_copy / "MANIFEST.json"
    manifest = json.loads(mp.read_text())
    manifest["files"] = hash_files(artifact_copy)
    manifest["tensors"] = hash_tensors(artifact_copy)
    mp.write_text(json.dumps(manifest))
    report = verify_artifact(artifact_copy)
    assert any(p.startswith("forward pass mismatch") for p in report.problems), report.problems
    assert torch.isfinite(torch.tensor(report.checks["forward"]["logits_sum"]))


def test_sv_export_runs_the_certificate_self_check(tmp_path):
    import torch

    from configuration_sv import SVConfig
    from modeling_sv import SVForCausalLM
    from sv_attention.artifact.export import export_artifact

    torch.manual_seed(0)
    model = SVForCausalLM(SVConfig(operator="sv", operator_config={"chunk": 8, "nu": 0.5, "n0": 8},
                                   hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   max_position_embeddings=32)).eval()
    out = tmp_path / "sv"
    manifest = export_artifact(model, out, results_dir=None)
    assert manifest["parameters"]["excluding_tied_head"] == manifest["parameters"]["total"] - 256 * 32
    report = verify_artifact(out)
    assert report.ok, report.problems
    cert = report.checks["certificate"]
    assert cert["applicable"] and cert["certified"] and cert["n"] == 32
    assert cert["kkt_max"] <= 1e-8 and cert["C"] == 0.25
    text = (out / "README.md").read_text()
    assert "no deletion certificate" in text[text.index("## Limits"):text.index("## Results")]


def test_stored_elements_must_equal_the_parameter_total(exported):
    from sv_attention.artifact.verify import VerifyReport, check_counts

    model, out = exported
    manifest = json.loads((out / "MANIFEST.json").read_text())
    report = VerifyReport(path="x")
    check_counts(model, manifest, report)
    assert report.problems == []
    manifest["tensors"]["model.norm.weight"]["shape"] = [33]
    check_counts(model, manifest, report)
    total = report.checks["parameters"]["total"]
    assert report.checks["parameters"]["stored_tensor_elements"] == total + 1
    assert report.problems == [f"parameter count mismatch: the weights file stores {total + 1:,} elements, the "
                               f"loaded model has {total:,} unique parameters"]


def test_hub_download_metadata_is_ignored(artifact_copy):
    # a git clone / `hf download --local-dir` of the Hub repo adds these; they are never executed
    (artifact_copy / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    (artifact_copy / ".git").mkdir()
    (artifact_copy / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (artifact_copy / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (artifact_copy / ".cache" / "huggingface" / "download" / "config.json.metadata").write_text("x\n")
    (artifact_copy / "sub").mkdir()
    (artifact_copy / "sub" / "helper.py").write_text("print('not listed')\n")
    report = verify_artifact(artifact_copy, load=False)
    assert report.problems == ["unlisted file: sub/helper.py (not in MANIFEST.json; remove it or re-export)"]


def test_edited_card_is_a_finding_not_a_failure(artifact_copy, capsys):
    card = artifact_copy / "README.md"
    card.write_text(card.read_text().replace("license: apache-2.0", "license: mit"))  # a Hub metadata edit
    report = verify_artifact(artifact_copy, load=False)
    assert report.ok and report.problems == []
    assert len(report.findings) == 1 and report.findings[0].startswith("file size mismatch: README.md")
    assert main(["verify", str(artifact_copy), "--no-load"]) == 0
    assert "NOTE: file size mismatch: README.md" in capsys.readouterr().out
    card.unlink()
    assert verify_artifact(artifact_copy, load=False).findings == ["missing file: README.md (the model card: "
                                                                   "documentation, not fatal)"]
    (artifact_copy / "config.json").write_text("{}")  # anything else stays fatal
    assert not verify_artifact(artifact_copy, load=False).ok


def test_pinned_manifest_hash(artifact_copy, capsys):
    import hashlib

    digest = hashlib.sha256((artifact_copy / "MANIFEST.json").read_bytes()).hexdigest()
    report = verify_artifact(artifact_copy, load=False, manifest_sha256=digest.upper())
    assert report.ok and report.checks["manifest_pinned"] is True and report.checks["manifest_sha256"] == digest
    assert main(["verify", str(artifact_copy), "--no-load", "--manifest-sha256", digest]) == 0
    assert "and the pinned manifest hash" in capsys.readouterr().out
    # a re-signed manifest (hashes consistent with edited files) passes integrity but not the pin
    p = artifact_copy / "MANIFEST.json"
    manifest = json.loads(p.read_text())
    manifest["provenance"]["command"] = "someone else"
    p.write_text(json.dumps(manifest))
    assert verify_artifact(artifact_copy, load=False).ok
    report = verify_artifact(artifact_copy, manifest_sha256=digest)
    assert not report.ok and report.problems[0].startswith("manifest sha256 mismatch")
    assert report.checks["load"].startswith("skipped")
    assert main(["verify", str(artifact_copy), "--no-load", "--manifest-sha256", digest]) == 1


@pytest.mark.parametrize("bad", ["abc", "g" * 64, ""])
def test_bad_hash_is_a_one_line_error(artifact_copy, capsys, bad):
    assert main(["verify", str(artifact_copy), "--manifest-sha256", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sv-attention verify: error: not a sha256 hash") and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_missing_folder_is_one_line(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert "not a folder" in err and "Traceback" not in err
