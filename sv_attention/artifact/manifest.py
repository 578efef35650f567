"""MANIFEST.json: what an artifact folder contains, hashed, so a reader can check it before running it.

Layout::

    {
      "format": "sv-attention-manifest/1",
      "files":   {relative path: {"sha256", "size"}}          every file but MANIFEST.json (code included)
      "tensors": {name: {"file", "shape", "dtype", "sha256"}}  raw stored bytes of each safetensors tensor
      "parameters": count_parameters(model) (+ "published_reading")
      "model": {"operator", "operator_config", "model_type", ...}
      "versions": {"sv_attention", "transformers", "torch", "python"}
      "provenance": {"command", "git_commit", "created_utc"}
      "training": {"data", "steps", ...} or null
      "reference_forward": {"input_bytes", "logits_sha256", "logits_head", "logits_sum"}
      "code": {"generator", "entry_points", "siblings", "sources"}   the remote code: the three entry points,
               the generated flat sibling files (sv_attention.artifact.siblings) and each file's source
    }

Every code file is also in ``files`` (hashed like any other file, so verify refuses a changed one).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from sv_attention.errors import ArtifactError

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_FORMAT = "sv-attention-manifest/1"
_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


#: what a Hub download adds next to the artifact's own files (git metadata, the Hub's LFS rules, the
#: ``hf download --local-dir`` cache); never executed, so neither hashed nor reported as unlisted
IGNORED_TOP_LEVEL = (".git", ".gitattributes", ".cache")


def is_ignored(rel: str) -> bool:
    """True for a relative path that :func:`hash_files` leaves out (``__pycache__`` and :data:`IGNORED_TOP_LEVEL`)."""
    parts = rel.split("/")
    return parts[0] in IGNORED_TOP_LEVEL or "__pycache__" in parts


def hash_files(root: str | Path) -> dict[str, dict[str, Any]]:
    """``{relative posix path: {"sha256", "size"}}`` for every regular file under ``root`` except the manifest
    and what :func:`is_ignored` leaves out."""
    root = Path(root)
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.name == MANIFEST_NAME and p.parent == root:
            continue
        rel = p.relative_to(root).as_posix()
        if is_ignored(rel):
            continue
        out[rel] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    return out


def read_safetensors_header(path: str | Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the byte offset where its data starts.

    Raises
    ------
    ArtifactError
        A truncated or malformed file.
    """
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ArtifactError(f"{path.name}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise ArtifactError(f"{path.name}: implausible safetensors header length {n}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ArtifactError(f"{path.name}: safetensors header is not valid JSON ({exc})") from exc
    return header, 8 + n


def hash_tensors(root: str | Path) -> dict[str, dict[str, Any]]:
    """``{tensor name: {"file", "shape", "dtype", "sha256"}}`` over every ``*.safetensors`` under ``root``.

    The hash is over the tensor's stored bytes (as written: little-endian, row-major), read from the
    offsets in the header, so it does not depend on torch.
    """
    root = Path(root)
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(root.glob("*.safetensors")):
        header, start = read_safetensors_header(path)
        size = path.stat().st_size
        with open(path, "rb") as f:
            for name, info in sorted(header.items()):
                if name == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                if start + end > size or begin > end:
                    raise ArtifactError(f"{path.name}: tensor {name} lies beyond the end of the file (truncated)")
                f.seek(start + begin)
                data = f.read(end - begin)
                out[name] = {"file": path.name, "shape": list(info["shape"]), "dtype": info["dtype"],
                             "sha256": hashlib.sha256(data).hexdigest()}
    return out


def build_manifest(root: str | Path, *, parameters: dict[str, Any], model: dict[str, Any],
                   versions: dict[str, Any], provenance: dict[str, Any], training: dict[str, Any] | None,
                   reference_forward: dict[str, Any] | None,
                   code: dict[str, Any] | None = None) -> dict[str, Any]:
    """Assemble the manifest of the folder ``root`` (hashing its files and tensors now)."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "files": hash_files(root),
        "tensors": hash_tensors(root),
        "parameters": parameters,
        "model": model,
        "versions": versions,
        "provenance": provenance,
        "training": training,
        "reference_forward": reference_forward,
    }
    if code is not None:
        manifest["code"] = code
    return manifest


def write_manifest(root: str | Path, manifest: dict[str, Any]) -> Path:
    path = Path(root) / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return path


def read_manifest(root: str | Path) -> dict[str, Any]:
    """Read ``MANIFEST.json``.

    Raises
    ------
    ArtifactError
        Missing, not JSON, or not this format.
    """
    path = Path(root) / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(f"{path}: missing; this folder is not an sv-attention artifact (run sv-attention export)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise ArtifactError(f"{path}: unknown manifest format {data.get('format') if isinstance(data, dict) else None!r}")
    return data
