"""Render the model card (``README.md`` of the artifact, ``MODEL_CARD.md`` at the repository root) from data.

Nothing in the card is typed by hand: parameter counts, hashes, versions and provenance come from the
manifest; result tables come from ``results/*.json`` (written by :func:`sv_attention.results.write_result`)
and every number sits next to the command that produced it. Limits come first.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

MAX_ROWS_PER_RESULT = 24

_OPERATOR_LIMITS = {
    "sv": [
        "**Certified vs not.** Only the exact fp64 maintained solver (`sv_attention.svdd.IncrementalSVDD`) "
        "issues certificates: reserve tokens with alpha exactly 0 (evicting them provably leaves the output "
        "unchanged) and exact deletion (a decrement reaches the state a refit without the token reaches, "
        "same fixed C). The gates this model computes in its forward pass, in training and in `generate`, "
        "come from the **batched training path** (a batched partition finder + a ridged bordered-KKT "
        "solve): a stabilised approximation that carries **no deletion certificate**.",
        "**The local window is deleted by masking.** Deleting a token of the current chunk masks its slot "
        "and renormalises; there is no SV certificate for it. Only long-range (gated-prefix) deletions use "
        "the exact decrement.",
        "**Certificates are momentary.** Reserve inertness is certified at the moment of eviction; a later "
        "admission can revive an evicted key. The certified cache re-checks evicted keys at every admission; "
        "a failed check is reported, never hidden.",
        "**Warm-up.** Below ceil(1/C) + 2 keys (and in chunk 0) the layer is plain causal softmax and no "
        "certificate exists.",
    ],
    "ceq": [
        "**ceq (hybrid).** stock softmax + sum_h (alpha A)^h v with a learnable per-layer alpha initialised "
        "at 0 (at initialisation the model is exactly softmax attention). The hop sum is truncated at "
        "`hops`; the truncation bound rho^(K+1)/(1-rho) only exists for rho < 1.",
    ],
    "ceq_path_sum": [
        "**ceq path-sum.** (I + A + ... + A^K) v with no softmax underneath, truncated at `hops`; the "
        "truncation bound rho^(K+1)/(1-rho) only exists for rho < 1 (the sgate default rho = 1.5 has none).",
    ],
    "smprime": [
        "**smprime.** W_ij = G_ij exp(qk q_i.k_j/sqrt(d)) / Z_i^beta with a complex path product G; beta, qk "
        "and g are learnable per layer (initialised from the config). Decoding recomputes the new rows from "
        "the cached queries and gates (O(s^2) per step, exact, not a recurrent state).",
    ],
}

_NON_SV_CERTIFICATE = (
    "**No certificate for this operator.** sv-attention's certified eviction and exact deletion come from "
    "the exact fp64 SVDD solver of the `sv` operator (and the certified cache); a `{op}` model carries "
    "no such guarantee: deleting a token from its context is plain masking."
)


def beta_limit() -> str:
    """The pinned-vs-exact wording for beta, with the test's constants from :mod:`sv_attention.ops.beta_test`."""
    from sv_attention.ops.beta_test import CHI2_95_1DOF

    return (
        "**beta: pinned is not exact.** smprime's normaliser exponent beta is a learnable scalar per layer. "
        "The project's beta test (`sv_attention.ops.beta_test.beta_lrt`) calls a layer "
        f"PINNED when the likelihood-ratio statistic Lambda <= {CHI2_95_1DOF} (the chi-square(1) 0.95 "
        "quantile): beta = 1 is *not rejected* on that held-out batch, which is not a measurement that beta "
        f"equals 1 exactly; the smallest deviation the batch could detect is sqrt({CHI2_95_1DOF} / I) (I: the "
        "observed information from the exact second derivative). MOVED means Lambda > ln n (n scored tokens); "
        "in between, beta = 1 is rejected at 0.95 but below description length. A pinned beta in a results "
        "table is a test verdict with its resolution, never an exact value."
    )


_GENERAL_LIMITS = [
    "**Small byte-level research model.** Vocabulary of 256 bytes, context of {block} bytes (longer inputs "
    "are refused), {layers} layers of width {width}. It is a vehicle for comparing attention operators with "
    "an identical backbone, not a general-purpose language model; it has no safety tuning and will produce "
    "fluent-looking nonsense.",
    "**Numbers are from this repository's commands** on the machine named in each result's provenance; "
    "CPU timings on a shared machine are noisy, ratios measured side by side in one run are the meaningful "
    "quantity.",
]


def load_results(results_dir: str | Path | None) -> list[dict[str, Any]]:
    """Every ``*.json`` result in ``results_dir`` (sorted by name); unreadable files are skipped with a note."""
    if results_dir is None:
        return []
    d = Path(results_dir)
    if not d.is_dir():
        return []
    out = []
    for p in sorted(d.glob("*.json")):
        try:
            data = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            out.append({"name": p.stem, "_error": f"unreadable: {exc}", "_file": p.name})
            continue
        if isinstance(data, dict):
            data.setdefault("name", p.stem)
            data["_file"] = p.name
            out.append(data)
    return out


def _numbers(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Numeric leaves of a JSON object as (dotted path, value), provenance excluded."""
    rows: list[tuple[str, Any]] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("provenance", "name") or str(k).startswith("_"):
                continue
            rows += _numbers(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list):
        if len(obj) <= 64:
            for i, v in enumerate(obj):
                rows += _numbers(v, f"{prefix}[{i}]")
    elif isinstance(obj, bool):
        return rows
    elif isinstance(obj, (int, float)):
        rows.append((prefix, obj))
    elif isinstance(obj, str) and obj in ("nan", "inf", "-inf"):
        rows.append((prefix, obj))
    return rows


def _fmt(v: Any) -> str:
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return repr(v)
        return f"{v:.4g}"
    return str(v)


def _published_rows(results: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], set[str]]:
    """Published-vs-ours rows (:mod:`sv_attention.experiments.summary`) and the files that gave rows."""
    try:
        from sv_attention.experiments.summary import rows_for
    except ImportError:  # pragma: no cover - the experiments layer is optional for the card
        return [], set()
    rows: list[dict[str, Any]] = []
    used: set[str] = set()
    for res in results:
        if "_error" in res:
            continue
        got = rows_for(str(res.get("name", res["_file"])), res)
        if got:
            rows += got
            used.add(res["_file"])
    return rows, used


def render_results(results: list[dict[str, Any]]) -> str:
    """Markdown: the published-vs-this-implementation table (files with ``table`` / ``published``), then
    one table per other result file; the producing command sits beside every number."""
    if not results:
        return "_No results/*.json were present when this card was rendered._\n"
    parts = []
    rows, used = _published_rows(results)
    if rows:
        from sv_attention.experiments.summary import render_markdown

        parts.append("### Published vs this implementation\n")
        parts.append(render_markdown(rows))
    for res in results:
        if res.get("_file") in used:
            continue
        name = res.get("name", res.get("_file", "?"))
        parts.append(f"### {name}\n")
        if "_error" in res:
            parts.append(f"`{res['_file']}`: {res['_error']}\n")
            continue
        prov = res.get("provenance") or {}
        command = prov.get("command", "(command not recorded)")
        rows = _numbers(res)
        if not rows:
            parts.append(f"`{res['_file']}` holds no numbers.\n")
            continue
        parts.append("| quantity | value | command |\n|---|---|---|")
        for path, value in rows[:MAX_ROWS_PER_RESULT]:
            parts.append(f"| {path} | {_fmt(value)} | `{command}` |")
        extra = len(rows) - MAX_ROWS_PER_RESULT
        tail = f"{extra} more numbers in `results/{res['_file']}`; " if extra > 0 else ""
        parts.append(
            f"\n{tail}source `results/{res['_file']}`, git commit `{prov.get('git_commit')}`, "
            f"sv-attention {prov.get('sv_attention')}, torch {prov.get('torch')}, "
            f"{prov.get('machine')} x{prov.get('cpu_count')}, {prov.get('timestamp_utc')}.\n"
        )
    return "\n".join(parts) + "\n"


def _param_table(params: dict[str, Any]) -> str:
    rows = [
        ("total (unique; tied head counted once)", params["total"]),
        ("trainable", params["trainable"]),
        ("excluding the tied head (token embedding)", params["excluding_tied_head"]),
        ("excluding embeddings (token + position)", params["excluding_embeddings"]),
        ("operator-specific", params["operator_specific_total"]),
    ]
    lines = ["| count | parameters |", "|---|---|"] + [f"| {k} | {v:,} |" for k, v in rows]
    lines += ["", "| top-level module | parameters |", "|---|---|"]
    tied = params.get("tied") or {}
    for mod, n in params["per_module"].items():
        note = ""
        for head, src in tied.items():
            if head.rsplit(".", 1)[0] == mod:
                note = f" (tied to `{src}`)"
        lines.append(f"| `{mod}` | {n:,}{note} |")
    if params["operator_specific"]:
        lines += ["", "| operator-specific tensor | parameters |", "|---|---|"]
        lines += [f"| `{k}` | {v:,} |" for k, v in params["operator_specific"].items()]
    return "\n".join(lines) + "\n"


def _training_line(training: dict[str, Any]) -> str:
    if not training:
        return "no training record was given (weights as exported; see the producing command)"
    parts = [f"data: {training.get('dataset')} ({training.get('dataset_kind')})"]
    data = training.get("data")
    if isinstance(data, dict):
        tr = data.get("train") or {}
        if tr:
            parts.append(f"{tr.get('n_bytes'):,} training bytes (sha256 `{str(tr.get('sha256'))[:16]}...`)")
    parts.append(f"steps: {training.get('steps')}")
    if isinstance(training.get("tokens_seen"), int):
        parts.append(f"tokens seen: {training['tokens_seen']:,}")
    if isinstance(training.get("val_bpb"), (int, float)):
        parts.append(f"validation bits/byte at export: {training['val_bpb']:.4f}")
    return "; ".join(parts)


def _tree_note(prov: dict[str, Any]) -> str:
    if prov.get("code_files_committed") is False:
        return " (the shipped code files differ from that commit: their sha256 in MANIFEST.json is authoritative)"
    if prov.get("git_dirty"):
        return " (other files of the checkout had uncommitted changes; the code files match the commit)"
    return ""


def _operator_limits(op: str, knobs: dict[str, Any]) -> list[str]:
    lines = list(_OPERATOR_LIMITS.get(op, []))
    if op == "sv":
        if knobs.get("solver") == "exact":
            lines[0] = lines[0].replace(
                "come from the **batched training path** (a batched partition finder + a ridged bordered-KKT "
                "solve): a stabilised approximation that carries **no deletion certificate**.",
                "come from the exact fp64 solver (`solver=\"exact\"`, no gradient); the batched training "
                "path, used when training, carries **no deletion certificate**.")
        if knobs.get("detach_gate", True):
            lines.append("**Detached gate.** As published, no gradient flows through alpha in training: the "
                         "gate shapes the attention but is not itself trained.")
    else:
        lines.append(_NON_SV_CERTIFICATE.format(op=op))
    return lines + [beta_limit()]


def render_card(manifest: dict[str, Any], *, results: list[dict[str, Any]] | None = None,
                results_dir: str | Path | None = None, license: str = "apache-2.0",
                datasets: list[str] | None = None, repo_id: str | None = None) -> ModelCard:
    """Render the model card from the manifest and result files.

    Parameters
    ----------
    manifest : dict
        As written by :func:`sv_attention.artifact.manifest.build_manifest` (``files`` may be empty when
        the card is rendered before the folder is hashed).
    results : list of result dicts, optional
        Defaults to :func:`load_results` of ``results_dir``.
    license, datasets, repo_id : card metadata; ``datasets`` defaults to the training record's.

    Returns
    -------
    huggingface_hub.ModelCard with YAML metadata (license, library_name, pipeline_tag, tags, datasets).
    """
    if results is None:
        results = load_results(results_dir)
    model = manifest["model"]
    params = manifest["parameters"]
    training = manifest.get("training") or {}
    if datasets is None:  # only Hub datasets belong in the metadata
        datasets = [training["dataset"]] if training.get("dataset_kind") == "hub" and training.get("dataset") else []
    op = model["operator"]
    data = ModelCardData(
        license=license, library_name="transformers", pipeline_tag="text-generation",
        tags=["custom_code", "sv-attention", "byte-level", f"operator-{op}", "causal-lm"],
        datasets=datasets or None,
    )
    repo = repo_id or "ORG/NAME"
    limits = [s.format(block=model["max_position_embeddings"], layers=model["num_hidden_layers"],
                       width=model["hidden_size"]) for s in _GENERAL_LIMITS]
    limits = _operator_limits(op, model["operator_config"]) + limits
    if op == "ceq_path_sum" and model["operator_config"].get("rho", 0) < 1:
        limits[0] = limits[0].replace(" (the sgate default rho = 1.5 has none)", "")
    prov = manifest.get("provenance", {})
    versions = manifest.get("versions", {})
    files = manifest.get("files", {})
    weights = {k: v for k, v in files.items() if k.endswith(".safetensors")}
    code = {k: v for k, v in files.items() if k.endswith(".py")}
    reading = params.get("published_reading", {})
    train_lines = _training_line(training)
    body = f"""
# sv-attention byte-level LM (`{op}` operator)

A {model['num_hidden_layers']}-layer, width-{model['hidden_size']}, {model['num_attention_heads']}-head pre-norm
byte-level decoder (block {model['max_position_embeddings']}, GELU MLP {model['intermediate_size']}, learned
positional embeddings, weight-tied head) whose attention operator is `{op}` with
`{json.dumps(model['operator_config'], sort_keys=True)}`. The backbone is identical for every operator of the
sv-attention project (`sv`, `ceq`, `ceq_path_sum`, `smprime`, `softmax`, `swa`).

## Limits (read first)

""" + "\n".join(f"- {s}" for s in limits) + f"""

## Usage

```bash
pip install sv-attention=={versions.get('sv_attention')}
```

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

repo = "{repo}"  # or a local folder
revision = "main"  # replace with a commit hash (see the security note)
tok = AutoTokenizer.from_pretrained(repo, trust_remote_code=True, revision=revision)
model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True, revision=revision)
ids = tok("Once upon a time", return_tensors="pt").input_ids
print(tok.decode(model.generate(ids, max_new_tokens=64, do_sample=False)[0]))
```

The modeling code imports its operators from the installed `sv_attention` package; without it
transformers stops with its own "pip install" message. Check a downloaded copy with
`sv-attention verify DIR` (hashes, tensors, parameter counts, an offline load, a forward pass and a
certificate self-check).

## Parameters

{_param_table(params)}
{reading.get('explanation', '')}

## Results

{render_results(results)}
## Manifest summary

- files: {len(files) + (0 if "README.md" in files else 1)} hashed in `MANIFEST.json` (sha256 + size; this card included), code files: {', '.join(f'`{k}`' for k in sorted(code)) or 'none'}
- weights: """ + (", ".join(f"`{k}` sha256 `{v['sha256']}` ({v['size']:,} bytes)" for k, v in sorted(weights.items()))
                  or "(hashed after the card is written: see MANIFEST.json)") + f"""
- tensors: {len(manifest.get('tensors', {}))} (name, shape, dtype, sha256 each)
- versions: sv-attention {versions.get('sv_attention')}, transformers {versions.get('transformers')}, torch {versions.get('torch')}
- produced by: `{prov.get('command')}` at git commit `{prov.get('git_commit')}`{_tree_note(prov)}
- training: {train_lines}

## Security note: `trust_remote_code`

`trust_remote_code=True` runs `configuration_sv.py`, `modeling_sv.py` and `tokenization_sv.py` from this
repository on your machine. Pin a `revision` (a commit hash, not a branch), read the code files, and check
their sha256 against `MANIFEST.json` (`sv-attention verify DIR` does all of it and refuses to execute code
whose hash does not match).
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")
