"""``verify_artifact``: check an artifact folder against its MANIFEST.json, then load and run it.

Order matters: hashes are checked **before** any code runs. When a code file, the config or the weights
fail their hash, the folder is not loaded (``trust_remote_code`` would execute unverified code); the
report says so. The card (``README.md``) is documentation, not code: a changed or missing card is a
separate, non-fatal finding (``report.findings``), so a metadata edit made on the Hub does not mark the
weights unverified. ``manifest_sha256`` pins the manifest itself to a hash published elsewhere (integrity
plus authenticity): a mismatch stops the check before anything else is trusted. Then: load offline with ``trust_remote_code=True`` (model and tokenizer), recompute the
parameter counts, run the recorded reference forward pass, and a certificate self-check (operator ``sv``:
the exact fp64 solver on the layer-0 keys of the reference text, KKT certificate checked). With
``clean_env``: the folder is loaded once more in a fresh virtual environment holding only torch,
transformers and safetensors, and its logits and generations are compared with the package path's.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sv_attention.artifact.manifest import MANIFEST_NAME, hash_files, hash_tensors, read_manifest
from sv_attention.artifact.params import count_parameters
from sv_attention.errors import ArtifactError, InvalidInputError, SVAttentionError

#: files whose change is reported as a finding, not a failure (documentation, never executed)
NON_FATAL_FILES = ("README.md",)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

#: tolerance on the recorded reference-forward fingerprint (relative to its magnitude)
FORWARD_RTOL = 1e-4


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_artifact`.

    Attributes
    ----------
    ok : bool
        True when every check passed.
    problems : list of str
        One line per mismatch, naming the file / tensor / count (each one fails the check).
    findings : list of str
        Non-fatal observations (a changed model card).
    checks : dict
        What was checked and what was found (for ``--json`` output).
    """

    path: str
    problems: list[str] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_failed(self) -> None:
        if self.problems:
            raise ArtifactError(f"{self.path}: {len(self.problems)} problem(s):\n  " + "\n  ".join(self.problems))


def check_files(root: Path, manifest: dict[str, Any], report: VerifyReport) -> None:
    expected = manifest.get("files", {})
    found = hash_files(root)
    for name, info in sorted(expected.items()):
        got = found.get(name)
        out = report.findings if name in NON_FATAL_FILES else report.problems
        note = " (the model card: documentation, not fatal)" if name in NON_FATAL_FILES else ""
        if got is None:
            out.append(f"missing file: {name}{note}")
        elif got["size"] != info["size"]:
            out.append(f"file size mismatch: {name} ({got['size']} bytes, manifest {info['size']}){note}")
        elif got["sha256"] != info["sha256"]:
            out.append(f"file hash mismatch: {name} (sha256 {got['sha256'][:16]}..., manifest "
                       f"{info['sha256'][:16]}...){note}")
    for name in sorted(set(found) - set(expected)):
        out = report.findings if name in NON_FATAL_FILES else report.problems
        out.append(f"unlisted file: {name} (not in {MANIFEST_NAME}; remove it or re-export)")
    report.checks["files"] = {"expected": len(expected), "found": len(found)}


def check_code(manifest: dict[str, Any], report: VerifyReport) -> None:
    """The manifest's ``code`` record (entry points + generated siblings) names exactly its ``.py`` files.

    Every code file is hashed in ``files`` like any other (:func:`check_files`); this check makes sure no
    Python file of the folder escapes the record of what the remote code is (older manifests without a
    ``code`` record are checked against the three entry points only).
    """
    from sv_attention.artifact.remote import CODE_FILES

    files = {name for name in manifest.get("files", {}) if name.endswith(".py")}
    record = manifest.get("code")
    if record is None:
        listed = set(CODE_FILES)
    else:
        listed = set(record.get("entry_points", [])) | set(record.get("siblings", []))
    for name in sorted(listed - files):
        report.problems.append(f"code record names {name}, which {MANIFEST_NAME} does not hash")
    for name in sorted(files - listed):
        report.problems.append(f"python file {name} is not in the manifest's code record (entry points and "
                               "generated siblings); re-export")
    report.checks["code"] = {"entry_points": len(set(CODE_FILES) & files),
                             "siblings": len(files - set(CODE_FILES))}


def check_tensors(root: Path, manifest: dict[str, Any], report: VerifyReport) -> None:
    expected = manifest.get("tensors", {})
    try:
        found = hash_tensors(root)
    except ArtifactError as exc:
        report.problems.append(f"weights unreadable: {exc}")
        return
    for name, info in sorted(expected.items()):
        got = found.get(name)
        if got is None:
            report.problems.append(f"missing tensor: {name}")
            continue
        for key in ("shape", "dtype", "sha256"):
            if got[key] != info[key]:
                report.problems.append(f"tensor {key} mismatch: {name} ({got[key]!s:.40} vs manifest "
                                       f"{info[key]!s:.40})")
    for name in sorted(set(found) - set(expected)):
        report.problems.append(f"unlisted tensor: {name}")
    report.checks["tensors"] = {"expected": len(expected), "found": len(found)}


def check_counts(model: torch.nn.Module, manifest: dict[str, Any], report: VerifyReport) -> None:
    recorded = manifest.get("parameters", {})
    now = count_parameters(model)
    for key in ("total", "trainable", "excluding_embeddings", "excluding_tied_head", "operator_specific_total"):
        if recorded.get(key) != now[key]:
            report.problems.append(f"parameter count mismatch: {key} = {now[key]:,} in the loaded model, "
                                   f"manifest says {recorded.get(key)!r}")
    for group in ("per_module", "operator_specific"):
        rec, cur = recorded.get(group, {}), now[group]
        for name in sorted(set(rec) | set(cur)):
            if rec.get(name) != cur.get(name):
                report.problems.append(f"parameter count mismatch: {group}[{name}] = {cur.get(name)!r} in the "
                                       f"loaded model, manifest says {rec.get(name)!r}")
    stored = sum(math.prod(t["shape"]) for t in manifest.get("tensors", {}).values())
    report.checks["parameters"] = {"total": now["total"], "stored_tensor_elements": stored}
    if stored != now["total"]:  # tied weights are stored once and buffers are not persistent
        report.problems.append(f"parameter count mismatch: the weights file stores {stored:,} elements, the "
                               f"loaded model has {now['total']:,} unique parameters")


def check_forward(model: torch.nn.Module, manifest: dict[str, Any], report: VerifyReport) -> None:
    from sv_attention.artifact.export import reference_forward

    ref = manifest.get("reference_forward")
    if not ref:
        report.problems.append("manifest has no reference_forward record")
        return
    now = reference_forward(model, ref["text"])
    report.checks["forward"] = {"logits_sum": now["logits_sum"], "recorded": ref["logits_sum"]}
    vals = [now["logits_sum"], now["logits_abs_sum"], *now["logits_head"]]
    if not all(math.isfinite(v) for v in vals):
        report.problems.append("forward pass produced non-finite logits")
        return
    scale = max(1.0, abs(ref["logits_abs_sum"]))
    for key in ("logits_sum", "logits_abs_sum"):
        if abs(now[key] - ref[key]) > FORWARD_RTOL * scale:
            report.problems.append(f"forward pass mismatch: {key} = {now[key]:.6g}, manifest {ref[key]:.6g}")
    head_err = max(abs(a - b) for a, b in zip(now["logits_head"], ref["logits_head"]))
    if head_err > FORWARD_RTOL * max(1.0, max(abs(b) for b in ref["logits_head"])):
        report.problems.append(f"forward pass mismatch: last-position logits differ by {head_err:.3g}")


@torch.no_grad()
def certificate_self_check(model: torch.nn.Module, text: str) -> dict[str, Any]:
    """Operator ``sv``: fit the exact solver to layer 0 / head 0 keys of ``text`` and check its certificate.

    Other operators have no certificate; the result says so (``applicable: False``).
    """
    config = model.config
    if config.operator != "sv":
        return {"applicable": False, "reason": f"operator {config.operator!r} carries no SV certificate"}
    from sv_attention.kernels import median_bandwidth
    from sv_attention.ops.settings import model_operator_settings
    from sv_attention.svdd import IncrementalSVDD

    settings = model_operator_settings(config.operator, config.operator_config)
    block = config.max_position_embeddings
    raw = (text.encode("utf-8") * (block // max(1, len(text)) + 1))[:block]
    ids = torch.tensor([list(raw)])
    seen: dict[str, torch.Tensor] = {}
    layer0 = model.model.layers[0].attn
    handle = layer0.k_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("k", o))
    try:
        model(ids, use_cache=False)
    finally:
        handle.remove()
    keys = seen["k"][0].view(ids.shape[1], config.num_attention_heads, -1)[:, 0].double()
    sigma = settings.sigma or float(median_bandwidth(keys))
    solver = IncrementalSVDD(C=settings.box, sigma=sigma)  # the settings' box (C, or nu * n0 with n0 = chunk)
    solver.add(keys.numpy())
    cert = solver.certificate()
    return {"applicable": True, "certified": bool(cert.certified), "reason": cert.reason, "n": cert.n,
            "kkt_max": cert.kkt.max, "partition": cert.partition_sizes, "C": cert.C, "sigma": cert.sigma}


def normalise_sha256(value: str) -> str:
    """A sha256 as 64 lower-case hex digits (``sha256:`` prefix and surrounding space allowed).

    Raises
    ------
    InvalidInputError
        Anything else.
    """
    text = value.strip().lower().removeprefix("sha256:")
    if not _SHA256.match(text):
        raise InvalidInputError(f"not a sha256 hash: {value!r} (expected 64 hexadecimal digits)")
    return text


def verify_artifact(path: str | Path, *, load: bool = True, manifest_sha256: str | None = None,
                    clean_env: bool = False, clean_env_dir: str | Path | None = None) -> VerifyReport:
    """Verify an artifact folder; never raises for a mismatch (read ``report.problems``).

    Parameters
    ----------
    path : the folder
    load : also load with ``trust_remote_code=True`` (offline) and run the model checks
    manifest_sha256 : the sha256 of ``MANIFEST.json`` as published elsewhere; a mismatch fails the check
        before anything in the folder is trusted
    clean_env : also load the folder in a fresh virtual environment with only torch, transformers and
        safetensors (:func:`sv_attention.artifact.clean_env.verify_clean_env`) and compare its logits and
        generations with the package path's (``checks["clean_env"]``); runs after the other checks passed
    clean_env_dir : where that environment is created (and reused when it already has the pins); default a
        temporary folder

    Raises
    ------
    InvalidInputError
        ``manifest_sha256`` is not a sha256 hash.
    """
    root = Path(path)
    report = VerifyReport(path=str(root))
    pinned = normalise_sha256(manifest_sha256) if manifest_sha256 is not None else None
    if not root.is_dir():
        report.problems.append(f"not a folder: {root}")
        return report
    if (root / MANIFEST_NAME).is_file():
        digest = hashlib.sha256((root / MANIFEST_NAME).read_bytes()).hexdigest()
        report.checks["manifest_sha256"] = digest
        if pinned is not None:
            if digest != pinned:
                report.problems.append(f"manifest sha256 mismatch: {MANIFEST_NAME} has {digest}, the pinned hash is "
                                       f"{pinned}; this is not the published artifact")
                report.checks["load"] = "skipped: the manifest is not the pinned one"
                return report
            report.checks["manifest_pinned"] = True
    try:
        manifest = read_manifest(root)
    except ArtifactError as exc:
        report.problems.append(str(exc))
        return report
    check_files(root, manifest, report)
    check_code(manifest, report)
    check_tensors(root, manifest, report)
    if not load:
        return report
    if report.problems:
        report.checks["load"] = "skipped: hash checks failed, refusing to execute unverified remote code"
        return report
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(root, trust_remote_code=True, local_files_only=True).eval()
        tok = AutoTokenizer.from_pretrained(root, trust_remote_code=True, local_files_only=True)
    except (OSError, ValueError, ImportError, RuntimeError, SVAttentionError) as exc:
        report.problems.append(f"loading with trust_remote_code failed: {type(exc).__name__}: {exc}")
        return report
    report.checks["load"] = {"model": type(model).__name__, "tokenizer": type(tok).__name__}
    sample = "verify: héllo"
    if tok.decode(tok(sample)["input_ids"]) != sample:
        report.problems.append("tokenizer round trip failed")
    check_counts(model, manifest, report)
    check_forward(model, manifest, report)
    try:
        cert = certificate_self_check(model, (manifest.get("reference_forward") or {}).get("text", "x" * 8))
    except SVAttentionError as exc:
        cert = {"applicable": True, "certified": False, "reason": f"{type(exc).__name__}: {exc}"}
    report.checks["certificate"] = cert
    if cert.get("applicable") and not cert.get("certified"):
        report.problems.append(f"certificate self-check failed: {cert.get('reason')}")
    if clean_env:
        check_clean_env(root, report, clean_env_dir)
    return report


def check_clean_env(root: Path, report: VerifyReport, venv: str | Path | None) -> None:
    """Load the folder in a clean virtual environment; every difference from the package path is a problem."""
    from sv_attention.artifact.clean_env import verify_clean_env

    if report.problems:
        report.checks["clean_env"] = "skipped: the folder failed the checks above"
        return
    try:
        result = verify_clean_env(root, venv=venv)
    except ArtifactError as exc:
        report.problems.append(f"clean environment: {exc}")
        return
    report.checks["clean_env"] = {k: v for k, v in result.items() if k not in ("ok", "problems")}
    report.problems.extend(f"clean environment: {p}" for p in result["problems"])
