"""Load an exported artifact the way a Hub user does and record what it computes (a standalone script).

This file imports only the standard library, torch and transformers, so it also runs, copied into a
temporary folder, in an interpreter where ``sv_attention`` is absent: a clean virtual environment
(``sv-attention verify --clean-env``) or a process whose ``sys.meta_path`` blocks the package and its
optional dependencies (the artifact tests). :func:`probe` is the comparison both sides run: the child on the
folder loaded with ``trust_remote_code=True``, the parent on the same weights loaded with the repository's
classes, and the two records must agree.

Usage (child side)::

    python probe_remote.py OUT.json FOLDER [FOLDER ...]

writes ``{folder: record}``; each record also says whether ``sv_attention`` was importable, which class
modules ran (``transformers_modules...``), the error an empty prompt raised, and the model's backend log line.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import torch

#: the fixed inputs of the probe (longer than a 32-byte chunk, so an sv model gates)
TEXT = "Once upon a time, a small model read bytes one at a time and learned."
PROMPTS = ("Once upon a", "The")
NEW_TOKENS = 6


@torch.no_grad()
def probe(model: Any, tok: Any, text: str = TEXT) -> dict[str, Any]:
    """Logits and generations of ``model`` / ``tok`` on the fixed inputs.

    Returns
    -------
    dict with ``logits`` (``[t, vocab]`` as nested lists, float64 values of the float32 logits),
    ``greedy``, ``sampled`` (seed 0, top-k 20), ``padded`` (a left-padded batch of :data:`PROMPTS`, greedy,
    with its attention mask), ``beams`` (3 beams) and ``pipeline`` (``pipeline("text-generation")`` text).
    """
    from transformers import pipeline

    model.eval()
    block = model.config.max_position_embeddings
    ids = torch.tensor([list(text.encode("utf-8"))[: block - NEW_TOKENS]])
    out: dict[str, Any] = {"logits": model(ids, use_cache=False).logits[0].double().tolist()}
    prompt = ids[:, :16]
    out["greedy"] = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()
    torch.manual_seed(0)
    out["sampled"] = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=20)[0].tolist()
    batch = tok(list(PROMPTS), padding=True, return_tensors="pt")
    out["padding_side"] = tok.padding_side
    out["padded_mask"] = batch["attention_mask"].tolist()
    out["padded"] = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
    out["beams"] = model.generate(prompt, max_new_tokens=NEW_TOKENS, num_beams=3, do_sample=False)[0].tolist()
    quiet = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.CRITICAL)  # "not supported for text-generation" for
    try:  # the repository's classes, which are not registered with the Auto classes
        gen = pipeline("text-generation", model=model, tokenizer=tok)
    finally:
        logging.getLogger("transformers").setLevel(quiet)
    out["pipeline"] = gen(PROMPTS[0], max_new_tokens=NEW_TOKENS, do_sample=False)[0]["generated_text"]
    return out


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def load_and_probe(folder: str) -> dict[str, Any]:
    """The child side: load ``folder`` with the Auto classes and ``trust_remote_code=True``, then :func:`probe`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, pipeline

    lines = _Lines()
    remote_logger = logging.getLogger("transformers_modules")
    remote_logger.addHandler(lines)
    remote_logger.setLevel(logging.INFO)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    remote_logger.removeHandler(lines)
    record: dict[str, Any] = {
        "classes": {"config": type(config).__module__ + "." + type(config).__name__,
                    "tokenizer": type(tok).__module__ + "." + type(tok).__name__,
                    "model": type(model).__module__ + "." + type(model).__name__},
        "backend_log": [line for line in lines.lines if line.startswith("sv_lm:")],
    }
    record.update(probe(model, tok))
    gen = pipeline("text-generation", model=folder, trust_remote_code=True)
    record["pipeline_from_path"] = gen(PROMPTS[0], max_new_tokens=NEW_TOKENS, do_sample=False)[0]["generated_text"]
    try:
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
        record["empty_prompt_error"] = None
    except Exception as exc:  # noqa: BLE001 - the record names whatever was raised
        record["empty_prompt_error"] = {"type": type(exc).__name__, "module": type(exc).__module__,
                                        "message": str(exc)}
    return record


def main(argv: list[str]) -> int:
    out_path, folders = argv[0], argv[1:]
    result: dict[str, Any] = {
        "importable": {name: _importable(name) for name in ("sv_attention", "mlx", "accelerate", "datasets",
                                                            "matplotlib")},
        "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
        "folders": {},
    }
    import transformers

    result["versions"]["transformers"] = transformers.__version__
    for folder in folders:
        result["folders"][folder] = load_and_probe(folder)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
