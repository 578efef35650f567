"""Manifest hashing: file hashes, per-tensor hashes of the stored bytes, malformed weights."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import save_file

from sv_attention.artifact.manifest import hash_files, hash_tensors, read_manifest
from sv_attention.errors import ArtifactError


def test_tensor_hash_is_sha256_of_stored_bytes(tmp_path):
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    save_file({"w": t, "b": torch.ones(2, dtype=torch.bfloat16)}, tmp_path / "model.safetensors")
    h = hash_tensors(tmp_path)
    assert h["w"] == {"file": "model.safetensors", "shape": [2, 3], "dtype": "F32",
                      "sha256": hashlib.sha256(t.numpy().tobytes()).hexdigest()}
    assert h["b"]["dtype"] == "BF16" and h["b"]["shape"] == [2]


def test_file_hashes_skip_manifest_and_pycache(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"abc")
    (tmp_path / "MANIFEST.json").write_text("{}")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "x.pyc").write_bytes(b"0")
    assert hash_files(tmp_path) == {"a.txt": {"sha256": hashlib.sha256(b"abc").hexdigest(), "size": 3}}


def test_truncated_weights_raise(tmp_path):
    save_file({"w": torch.zeros(100)}, tmp_path / "model.safetensors")
    p = tmp_path / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(ArtifactError, match="truncated"):
        hash_tensors(tmp_path)


def test_bad_manifest(tmp_path):
    with pytest.raises(ArtifactError, match="missing"):
        read_manifest(tmp_path)
    (tmp_path / "MANIFEST.json").write_text("[1, 2]")
    with pytest.raises(ArtifactError, match="format"):
        read_manifest(tmp_path)
