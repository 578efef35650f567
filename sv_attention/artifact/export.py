"""``export_artifact``: write a Hub artifact folder from a model or a checkpoint, optionally publish it.

The folder holds: ``config.json`` (with ``auto_map``), ``generation_config.json``, ``model.safetensors``,
the three remote-code files and their generated flat sibling files (:mod:`sv_attention.artifact.siblings`:
the package modules the model needs, so that it loads with torch + transformers alone),
``tokenizer_config.json``, ``README.md`` (the card), ``results/`` and ``MANIFEST.json``.
It is built in a temporary sibling folder and moved into place only when complete (and, with
``push_to``, only after the upload succeeded), so a failure leaves the target untouched.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from sv_attention.artifact.card import write_card
from sv_attention.artifact.manifest import (
    MANIFEST_NAME,
    build_manifest,
    hash_files,
    hash_tensors,
    read_manifest,
    write_manifest,
)
from sv_attention.artifact.params import count_parameters, published_reading
from sv_attention.artifact.remote import CODE_FILES, model_classes
from sv_attention.artifact.siblings import RemoteCode, generate_repository_code, write_remote_code
from sv_attention.errors import ArtifactError, InvalidInputError, NetworkUnavailableError

#: the fixed input of the recorded reference forward pass (bytes of this text)
REFERENCE_TEXT = "Once upon a time, a small model read bytes."


def load_checkpoint(checkpoint: str | Path) -> tuple[torch.nn.Module, dict[str, Any] | None]:
    """Load a ``save_pretrained`` folder (a training checkpoint or an artifact) with the repository's classes.

    Returns the model (eval mode, CPU) and the training record: the folder's ``trainer_state.json`` (a
    training checkpoint) or, for an exported artifact, its manifest's ``training`` record (so re-exporting an
    artifact from its own weights, e.g. to refresh its generated code, keeps what it was trained on).

    Raises
    ------
    InvalidInputError
        The folder does not exist or has no ``config.json``.
    """
    path = Path(checkpoint)
    if not (path / "config.json").is_file():
        raise InvalidInputError(f"{path} is not a model folder (no config.json); pass a save_pretrained folder")
    _, model_cls, _ = model_classes(path)
    model = model_cls.from_pretrained(path).eval()
    record = None
    if (path / "trainer_state.json").is_file():
        record = json.loads((path / "trainer_state.json").read_text())
    elif (path / MANIFEST_NAME).is_file():
        record = read_manifest(path).get("training")
    return model, record


def training_summary(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """The training data and step count from a training record.

    Accepts a checkpoint's ``trainer_state.json`` (``step``, ``data``, ``metrics``) or a run's ``run.json``
    (``steps``, ``data``, ``tokens_seen``, ``val_bpb``) as :mod:`sv_attention.train` writes them.
    """
    if not record:
        return None
    metrics = record.get("metrics") or {}
    data = record.get("data")
    source = data.get("source") if isinstance(data, dict) else None
    out: dict[str, Any] = {
        "data": data,
        "dataset": (source or {}).get("name") if isinstance(source, dict) else data,
        "dataset_kind": (source or {}).get("kind") if isinstance(source, dict) else None,
        "steps": record.get("step", record.get("steps")),
        "tokens_seen": record.get("tokens_seen", metrics.get("tokens_seen")),
        "val_bpb": record.get("val_bpb", metrics.get("val_bpb")),
    }
    cfg = record.get("train_config")
    if isinstance(cfg, dict):
        out["train_config"] = cfg
    return out


@torch.no_grad()
def reference_forward(model: torch.nn.Module, text: str = REFERENCE_TEXT) -> dict[str, Any]:
    """Logits of a fixed byte string: a hash-free fingerprint ``verify`` recomputes after loading."""
    ids = torch.tensor([list(text.encode("utf-8"))[: model.config.max_position_embeddings]])
    logits = model(ids, use_cache=False).logits[0].double()
    return {"text": text, "logits_sum": float(logits.sum()), "logits_abs_sum": float(logits.abs().sum()),
            "logits_head": [float(x) for x in logits[-1, :8]], "shape": list(logits.shape)}


def _versions() -> dict[str, Any]:
    import transformers

    import sv_attention

    return {"sv_attention": sv_attention.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__, "python": platform.python_version()}


def git_state(code_sources: list[str] | tuple[str, ...] = CODE_FILES) -> dict[str, Any]:
    """Whether the checkout differs from its commit: ``git_dirty`` (any tracked file modified) and
    ``code_files_committed`` (the sources of the shipped code, ``code_sources`` relative to the repository
    root, equal their committed version); None outside a checkout."""
    from sv_attention.results import repo_root

    def differs(*paths: str) -> bool | None:
        try:
            res = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *paths], cwd=repo_root(),
                                 capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return {0: False, 1: True}.get(res.returncode)

    code = differs(*code_sources)
    if code is False:  # a source git does not know (new, untracked) is not committed either
        try:
            res = subprocess.run(["git", "ls-files", "--error-unmatch", "--", *code_sources], cwd=repo_root(),
                                 capture_output=True, timeout=30)
            code = res.returncode != 0
        except (OSError, subprocess.SubprocessError):
            code = None
    return {"git_dirty": differs(), "code_files_committed": None if code is None else not code}


def model_summary(config: Any) -> dict[str, Any]:
    keys = ("model_type", "operator", "operator_config", "vocab_size", "hidden_size", "num_hidden_layers",
            "num_attention_heads", "intermediate_size", "max_position_embeddings", "attention_bias", "mlp_bias",
            "tie_word_embeddings", "sv_attention_version")
    return {k: getattr(config, k) for k in keys}


def as_repository_model(model: torch.nn.Module, cfg_cls: type, model_cls: type) -> torch.nn.Module:
    """Rebuild an sv_lm model loaded from elsewhere (e.g. ``trust_remote_code``) with the repository's
    classes, so the artifact always ships the repository's code files.

    Raises
    ------
    InvalidInputError
        The model is not an sv_lm causal LM, or its weights do not fit the repository's classes.
    """
    config = getattr(model, "config", None)
    if type(model).__name__ != "SVForCausalLM" or getattr(config, "model_type", None) != "sv_lm":
        raise InvalidInputError(f"expected an sv_lm SVForCausalLM, got {type(model).__name__}")
    rebuilt = model_cls(cfg_cls.from_dict(config.to_dict())).eval()
    result = rebuilt.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise InvalidInputError(f"the model's weights do not fit modeling_sv.py: missing {missing}, "
                                f"unexpected {result.unexpected_keys}")
    rebuilt.tie_weights()
    return rebuilt


def write_folder(model: torch.nn.Module, out: Path, *, command: str, training: dict[str, Any] | None,
                 results_dir: str | Path | None, license: str, datasets: list[str] | None,
                 repo_id: str | None) -> dict[str, Any]:
    """Write the artifact into the (empty) folder ``out``; return the manifest."""
    from sv_attention.results import git_commit

    cfg_cls, model_cls, tok_cls = model_classes()
    if type(model) is not model_cls:
        model = as_repository_model(model, cfg_cls, model_cls)
    cfg_cls.register_for_auto_class()
    model_cls.register_for_auto_class("AutoModelForCausalLM")
    tok_cls.register_for_auto_class("AutoTokenizer")
    model.save_pretrained(out, safe_serialization=True)
    tok = tok_cls(model_max_length=model.config.max_position_embeddings)
    tok.save_pretrained(out)
    generation = copy.deepcopy(model.generation_config)  # batched generation pads with the tokenizer's byte 0
    generation.pad_token_id = tok.pad_token_id
    generation.save_pretrained(out)
    # save_pretrained copied the repository's code files, which import the package: replace them with the
    # generated, self-contained remote code (the three files and their flat siblings)
    code: RemoteCode = write_remote_code(out, generate_repository_code())
    params = count_parameters(model)
    params["published_reading"] = published_reading(params, model.config, type(model))
    manifest_args = dict(
        parameters=params, model=model_summary(model.config), versions=_versions(),
        provenance={"command": command, "git_commit": git_commit(),
                    **git_state(sorted(set(code.sources.values()))),
                    "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        training=training, reference_forward=reference_forward(model), code=code.manifest_entry(),
    )
    draft = {"files": hash_files(out), "tensors": hash_tensors(out), **manifest_args}
    write_card(out, draft, results_dir=results_dir, license=license, datasets=datasets, repo_id=repo_id)
    manifest = build_manifest(out, **manifest_args)
    write_manifest(out, manifest)
    return manifest


def push_folder(folder: Path, repo_id: str, private: bool) -> str:
    """``create_repo`` + ``upload_folder`` (never ``model.push_to_hub``, which would replace the card).

    Raises
    ------
    NetworkUnavailableError
        The Hub cannot be reached (offline, no route, DNS) or refuses the request; the message says why.
    """
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                                 commit_message="sv-attention export")
    except Exception as exc:  # noqa: BLE001 - every failure is reported the same clear way
        raise NetworkUnavailableError(
            f"could not publish to the Hub repository {repo_id!r}: {type(exc).__name__}: {exc}. Nothing was "
            "written locally; check the network and `huggingface-cli login`, then re-run the export."
        ) from exc
    return str(getattr(info, "commit_url", info))


def _publish_permissions(root: Path) -> None:
    """Give the folder and its files the umask's ordinary permissions (``mkdtemp`` made the folder 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for p in root.rglob("*"):
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def export_artifact(model_or_checkpoint: torch.nn.Module | str | Path, out_dir: str | Path, *,
                    command: str = "sv-attention export", training_record: dict[str, Any] | None = None,
                    results_dir: str | Path | None = None, license: str = "apache-2.0",
                    datasets: list[str] | None = None, push_to: str | None = None, private: bool = False,
                    overwrite: bool = False) -> dict[str, Any]:
    """Export a Hub artifact folder.

    Parameters
    ----------
    model_or_checkpoint : SVForCausalLM or a ``save_pretrained`` folder (a training checkpoint's
        ``trainer_state.json`` supplies the training data and steps)
    out_dir : target folder; must not exist or be empty unless ``overwrite``
    training_record : a training run JSON (overrides the checkpoint's record)
    results_dir : where ``*.json`` results for the card are read (None: no result tables)
    push_to : ``ORG/NAME`` to publish the folder to; on failure nothing is written locally

    Returns
    -------
    The manifest dict (``manifest["push"]`` holds the commit URL when pushed).
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ArtifactError(f"{out} exists and is not empty; choose another --out or pass --overwrite")
    record = training_record
    if isinstance(model_or_checkpoint, (str, Path)):
        model, ckpt_record = load_checkpoint(model_or_checkpoint)
        record = record if record is not None else ckpt_record
    else:
        model = model_or_checkpoint
    was_training = model.training
    model.eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        manifest = write_folder(model, tmp, command=command, training=training_summary(record),
                                results_dir=results_dir, license=license, datasets=datasets, repo_id=push_to)
        if push_to is not None:
            manifest["push"] = push_folder(tmp, push_to, private)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        _publish_permissions(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
        model.train(was_training)
    return manifest
