"""The model card (``README.md`` of the artifact, ``MODEL_CARD.md`` at the repository root), rendered with
``huggingface_hub.ModelCard.from_template`` from the jinja template ``model_card.md.j2`` next to this file.

Nothing in the card is typed by hand: the model's shape, parameter counts, hashes, versions and training
record come from the manifest; the results table comes from ``results/*.json`` through
:mod:`sv_attention.published` (the headline rows), and those JSON files ship inside the artifact under
``results/`` (with the twins' training-curve figure), so the card links them instead of dumping them.
:func:`refresh_card` re-renders the card of an exported folder from its manifest and the current results
(``sv-attention render-readme`` calls it) and re-hashes the folder's files in the manifest.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from sv_attention.artifact.manifest import hash_files, read_manifest, write_manifest
from sv_attention.published import fmt, headline_rows, measured_cell

TEMPLATE = Path(__file__).with_name("model_card.md.j2")
RESULTS_SUBDIR = "results"
CURVES_JSON = "train_twins.json"
CURVES_FIGURE = "train_twins.png"
"""The twins' training curves (``sv-attention plot-twins`` draws the figure from the JSON)."""
MAX_LIMITS = 6
REPO_PLACEHOLDER = "ORG/NAME"
PROMPT = "Once upon a time"

_OPERATOR_LIMITS = {
    "sv": ["The gates computed in `forward` and `generate` come from the batched training solver and carry "
           "no deletion certificate; certified eviction and exact deletion need the sv-attention package "
           "(`CertifiedCache` and its exact fp64 solver).",
           "In the first chunk ({chunk} bytes) and below ceil(1/C) + 2 keys a layer is plain causal softmax."],
    "ceq": ["ceq is softmax + sum_h (alpha A)^h v with a learnable per-layer alpha (0 at initialisation, where "
            "it is exactly softmax); the hop sum is truncated at `hops`."],
    "ceq_path_sum": ["ceq path-sum is (I + A + ... + A^K) v with no softmax underneath, truncated at `hops`; "
                     "the truncation bound rho^(K+1)/(1-rho) exists only for rho < 1."],
    "smprime": ["smprime's normaliser exponent beta is learnable per layer; a beta the beta test calls pinned "
                "(Lambda <= {chi2}) means beta = 1 was not rejected, not that it equals 1."],
}
_NO_CERTIFICATE = ("No certificate: certified eviction and exact deletion belong to the `sv` operator; deleting "
                   "a token from this model's context is plain masking.")


def dataset_id(training: dict[str, Any]) -> str | None:
    """The card's ``datasets`` entry: a Hub dataset's id, or an honest name for the embedded generated
    corpus (it is not on the Hub); None for local files or no record."""
    kind = training.get("dataset_kind")
    if kind == "hub":
        return training.get("dataset")
    if kind == "embedded":
        source = ((training.get("data") or {}).get("source") or {})
        return f"sv-attention-generated-stories-v{source.get('generator_version', 1)}"
    return None


def card_metadata(manifest: dict[str, Any], *, license: str = "apache-2.0",
                  datasets: list[str] | None = None) -> ModelCardData:
    """YAML metadata: license, language, library, pipeline, tags, datasets and a ``model-index`` with the
    validation bits per byte when the training record has it."""
    model, training = manifest["model"], manifest.get("training") or {}
    op = model["operator"]
    ds = dataset_id(training)
    datasets = datasets if datasets is not None else ([ds] if ds else None)
    evals = None
    if isinstance(training.get("val_bpb"), (int, float)) and datasets:
        source = ((training.get("data") or {}).get("source") or {})
        name = ("generated children's stories (sv_attention.data.stories, not a Hub dataset)"
                if training.get("dataset_kind") == "embedded" else str(training.get("dataset")))
        val_bytes = ((training.get("data") or {}).get("validation") or {}).get("n_bytes")
        split = f"validation (last {val_bytes:,} bytes)" if isinstance(val_bytes, int) else "validation"
        evals = [EvalResult(task_type="text-generation", task_name="Causal language modeling",
                            dataset_type=datasets[0], dataset_name=name, dataset_split=split,
                            dataset_revision=(source.get("sha256") or None),
                            metric_type="bits_per_byte", metric_name="validation bits per byte",
                            metric_value=round(float(training["val_bpb"]), 4))]
    return ModelCardData(
        language="en", license=license, library_name="transformers", pipeline_tag="text-generation",
        tags=["custom_code", "sv-attention", "byte-level", f"operator-{op}", "causal-lm"],
        datasets=datasets or None, model_name=f"sv-attention byte LM ({op})" if evals else None,
        eval_results=evals,
    )


def limits(manifest: dict[str, Any]) -> list[str]:
    """At most :data:`MAX_LIMITS` short bullets: the model's size, its data, the operator's caveats, timings."""
    from sv_attention.analysis.beta_test import CHI2_95_1DOF

    model, training = manifest["model"], manifest.get("training") or {}
    op, knobs = model["operator"], model.get("operator_config") or {}
    out = [f"Small byte-level research model: {manifest['parameters']['total']:,} parameters, "
           f"{model['num_hidden_layers']} layers of width {model['hidden_size']}, a context of "
           f"{model['max_position_embeddings']} bytes (longer inputs are refused), no safety tuning."]
    if training.get("dataset_kind") == "embedded":
        out.append("Trained only on a generated English story corpus with a vocabulary of a few hundred words: "
                   "outside such stories it writes fluent-looking nonsense, and its bits per byte are far below "
                   "what natural text gives.")
    elif training:
        out.append(f"Trained only on {training.get('dataset')}; not evaluated on anything else.")
    out += [s.format(chunk=knobs.get("chunk"), chi2=CHI2_95_1DOF) for s in _OPERATOR_LIMITS.get(op, [])]
    if op == "sv" and knobs.get("detach_gate", True):
        out.append("As published, the gate is detached in training: it shapes attention but is not trained.")
    if op != "sv":
        out.append(_NO_CERTIFICATE)
    out.append("Timings are from a shared CPU machine; ratios measured side by side in one run are the "
               "meaningful quantity.")
    return out[:MAX_LIMITS]


def _training_lines(training: dict[str, Any]) -> list[str]:
    if not training:
        return ["No training record was given (weights as exported)."]
    data = training.get("data") or {}
    source = data.get("source") or {}
    cfg = training.get("train_config") or {}
    lines = [f"data: {source.get('description') or training.get('dataset')}"]
    tr, va = data.get("train") or {}, data.get("validation") or {}
    if tr:
        split = f"split: {tr['n_bytes']:,} training bytes"
        if va:
            split += f", the last {va['n_bytes']:,} bytes for validation (sha256 `{str(va.get('sha256'))[:16]}...`)"
        lines.append(split)
    budget = f"{training.get('steps')} steps"
    if cfg:
        budget += (f" x {cfg.get('batch_size')} sequences x {cfg.get('block_size')} bytes, AdamW lr {cfg.get('lr')} "
                   f"(warm-up {cfg.get('warmup_steps')} steps, cosine to {cfg.get('min_lr_ratio')}x), weight decay "
                   f"{cfg.get('weight_decay')}, seed {cfg.get('seed')}")
    if isinstance(training.get("tokens_seen"), int):
        budget += f"; {training['tokens_seen']:,} bytes seen"
    lines.append(budget)
    if isinstance(training.get("val_bpb"), (int, float)):
        lines.append(f"validation bits per byte at export: {training['val_bpb']:.4f}")
    return lines


def _tree_note(prov: dict[str, Any]) -> str:
    if prov.get("code_files_committed") is False:
        return " (the shipped code files differ from that commit: their sha256 in MANIFEST.json is authoritative)"
    if prov.get("git_dirty"):
        return " (other files of the checkout had uncommitted changes; the code files match the commit)"
    return ""


def _intro(manifest: dict[str, Any]) -> str:
    model, training = manifest["model"], manifest.get("training") or {}
    op = model["operator"]
    what = {"sv": "support-vector attention (`sv`): softmax attention gated by the support coefficients of a "
                  "one-class SVM (SVDD) fitted on the keys",
            "ceq": "`ceq`: softmax plus signed causal path-sum hops",
            "ceq_path_sum": "the signed causal path sum `ceq_path_sum`",
            "smprime": "`smprime`, exp attention with a complex path-product gate",
            "softmax": "plain causal softmax", "swa": "sliding-window softmax"}.get(op, f"`{op}`")
    text = (f"A {model['num_hidden_layers']}-layer, width-{model['hidden_size']}, "
            f"{model['num_attention_heads']}-head byte-level causal language model "
            f"({manifest['parameters']['total']:,} parameters) whose attention is {what}. ")
    if training:
        bpb = training.get("val_bpb")
        text += (f"It was trained for {training.get('steps')} steps on "
                 f"{'a generated English story corpus' if training.get('dataset_kind') == 'embedded' else training.get('dataset')}"
                 + (f" (validation {bpb:.3f} bits per byte)" if isinstance(bpb, (int, float)) else "")
                 + ", next to softmax and sliding-window twins with the same backbone. ")
    return text + ("It is a research artifact of the sv-attention project for comparing attention operators, "
                   "not a general-purpose model.")


def copy_results(results_dir: str | Path | None, out: str | Path) -> list[str]:
    """Copy ``results_dir/*.json`` and the curves figure into ``out/results`` (replacing what was there);
    return the copied names."""
    dst = Path(out) / RESULTS_SUBDIR
    if dst.exists():
        shutil.rmtree(dst)
    if results_dir is None or not Path(results_dir).is_dir():
        return []
    src = Path(results_dir)
    names = sorted(p.name for p in src.glob("*.json")) + ([CURVES_FIGURE] if (src / CURVES_FIGURE).is_file() else [])
    if names:
        dst.mkdir(parents=True)
    for name in names:
        shutil.copyfile(src / name, dst / name)
    return names


def render_card(manifest: dict[str, Any], *, results_dir: str | Path | None = None, license: str = "apache-2.0",
                datasets: list[str] | None = None, repo_id: str | None = None) -> ModelCard:
    """Render the model card from the manifest and the result files.

    Parameters
    ----------
    manifest : dict
        As written by :func:`sv_attention.artifact.manifest.build_manifest`.
    results_dir : path, optional
        The ``results/`` folder the card's table reads (the artifact's own copy when exporting); links in the
        card point at ``results/NAME`` relative to the card. None: no results table.
    license, datasets, repo_id
        Card metadata (``datasets`` defaults to :func:`dataset_id` of the training record) and the repository
        id shown in the usage snippet (default a placeholder).

    Returns
    -------
    huggingface_hub.ModelCard
    """
    params, model = manifest["parameters"], manifest["model"]
    rows = []
    if results_dir is not None and Path(results_dir).is_dir() and any(Path(results_dir).glob("*.json")):
        rows = [{"label": r["label"], "published": fmt(r["published"]).replace("|", "\\|"),
                 "measured": measured_cell(r)} for r in headline_rows(results_dir)]
    has_figure = results_dir is not None and (Path(results_dir) / CURVES_FIGURE).is_file()
    files = manifest.get("files", {})
    weights = ", ".join(f"`{k}` sha256 `{v['sha256']}` ({v['size']:,} bytes)"
                        for k, v in sorted(files.items()) if k.endswith(".safetensors"))
    versions = manifest.get("versions", {})
    prov = manifest.get("provenance", {})
    counts = [("total (the tied head counted once)", params["total"]),
              ("excluding the tied head (token embedding)", params["excluding_tied_head"]),
              ("excluding embeddings (token + position)", params["excluding_embeddings"]),
              ("operator-specific", params["operator_specific_total"])]
    card = ModelCard.from_template(
        card_metadata(manifest, license=license, datasets=datasets), template_path=str(TEMPLATE),
        title=f"sv-attention byte-level LM (`{model['operator']}` operator)", intro=_intro(manifest),
        repo=repo_id or REPO_PLACEHOLDER, prompt=PROMPT,
        new_tokens=max(1, min(64, model["max_position_embeddings"] - len(PROMPT.encode()))), limits=limits(manifest), rows=rows,
        figure=f"{RESULTS_SUBDIR}/{CURVES_FIGURE}" if has_figure else None,
        curves_json=f"{RESULTS_SUBDIR}/{CURVES_JSON}", training=_training_lines(manifest.get("training") or {}),
        params=[(k, f"{v:,}") for k, v in counts],
        reading=(params.get("published_reading") or {}).get("explanation", ""),
        weights=weights or "(hashed in MANIFEST.json)",
        versions=f"transformers {versions.get('transformers')}, torch {versions.get('torch')}, "
                 f"sv-attention {versions.get('sv_attention')}",
        command=prov.get("command"), commit=prov.get("git_commit"), tree_note=_tree_note(prov),
    )
    return ModelCard(re.sub(r"\n{3,}", "\n\n", str(card)))


def write_card(out: str | Path, manifest: dict[str, Any], *, results_dir: str | Path | None,
               license: str = "apache-2.0", datasets: list[str] | None = None,
               repo_id: str | None = None) -> ModelCard:
    """Copy the results into ``out/results``, render the card and save it as ``out/README.md``."""
    out = Path(out)
    copy_results(results_dir, out)
    shipped = out / RESULTS_SUBDIR
    card = render_card(manifest, results_dir=shipped if shipped.is_dir() else None, license=license,
                       datasets=datasets, repo_id=repo_id)
    card.save(out / "README.md")
    return card


def refresh_card(artifact_dir: str | Path, results_dir: str | Path, *, card_copy: str | Path | None = None,
                 write: bool = True) -> list[str]:
    """Re-render an exported folder's card (and its ``results/``) from its manifest and ``results_dir``.

    Weights, code, config and tokenizer are untouched; the manifest's ``files`` entries are re-hashed so that
    the folder still verifies. License and datasets are kept from the current card.

    Parameters
    ----------
    artifact_dir : the exported folder (with ``MANIFEST.json``)
    results_dir : the repository's ``results/``
    card_copy : also keep this file (e.g. ``MODEL_CARD.md``) equal to the card
    write : False only compares (nothing is written)

    Returns
    -------
    list of str
        The paths that differ (write=False) or were rewritten (write=True); empty when up to date.
    """
    import filecmp
    import tempfile

    art = Path(artifact_dir)
    manifest = read_manifest(art)
    old_card = art / "README.md"
    license = "apache-2.0"
    if old_card.is_file():
        license = ModelCard.load(old_card).data.license or license
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp)
        copy_results(results_dir, stage)
        card_text = str(render_card(manifest, license=license, results_dir=stage / RESULTS_SUBDIR
                                    if (stage / RESULTS_SUBDIR).is_dir() else None))
        new_res = {p.name: p for p in (stage / RESULTS_SUBDIR).glob("*")} if (stage / RESULTS_SUBDIR).is_dir() else {}
        old_res = {p.name: p for p in (art / RESULTS_SUBDIR).glob("*")} if (art / RESULTS_SUBDIR).is_dir() else {}
        changed = [f"{art / RESULTS_SUBDIR / n}" for n in sorted(set(new_res) | set(old_res))
                   if n not in new_res or n not in old_res or not filecmp.cmp(new_res[n], old_res[n], shallow=False)]
        if not old_card.is_file() or old_card.read_text() != card_text:
            changed.append(str(old_card))
        if card_copy is not None and (not Path(card_copy).is_file() or Path(card_copy).read_text() != card_text):
            changed.append(str(card_copy))
        if write and changed:
            copy_results(results_dir, art)
            old_card.write_text(card_text)
            if card_copy is not None:
                Path(card_copy).write_text(card_text)
        if write or not changed:
            files = hash_files(art)
            if files != manifest.get("files"):
                if not write:
                    changed.append(str(art / "MANIFEST.json"))
                else:
                    manifest["files"] = files
                    write_manifest(art, manifest)
                    changed.append(str(art / "MANIFEST.json"))
    return changed
