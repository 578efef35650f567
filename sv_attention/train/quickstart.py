"""The main job (``make demo`` = ``sv-attention quickstart``), as a function.

Seven steps, each printed as it runs:

1. the embedded corpus (generated once, cached);
2. train the SV-Attention model and its softmax twin (identical backbone, data and budget), print both
   validation bits-per-byte and the SV / softmax throughput ratio (interleaved measurement);
3. export the SV model as a Hub artifact (weights, code, tokenizer, card, MANIFEST.json);
4. reload it with ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` (offline), check its
   logits against the trained checkpoint, and generate a sample;
5. certified eviction and an exact deletion on a validation context, with receipts: the reloaded model
   decodes through the exact fp64 gate (``sv_attention.enable(model, "sv_attention")`` +
   :class:`sv_attention.CertifiedCache`), evicts every certified-inert key, checks that the next-token
   logits did not move, then forgets a long-range token by the exact decrement and checks it against a
   from-scratch refit;
6. the checks of ``sv-attention verify`` on the artifact (:func:`sv_attention.artifact.verify.verify_artifact`,
   called directly; its report is written as ``run_dir/verify.json``);
7. a summary of where everything went (also written as JSON).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sv_attention.train.config import TrainConfig


@dataclass
class QuickstartOptions:
    """Knobs of the quickstart (defaults: a quiet 2-core CPU finishes in minutes).

    The defaults are the training setting of the committed artifact (``hf_artifact/``, see
    ``results/train_twins.json``), so ``make demo`` retrains that SV model and its softmax twin.

    Attributes
    ----------
    run_dir : str
    steps, batch_size, hidden_size, num_layers, num_heads, block_size : int
        The shared budget and size of both twins.
    chunk : int
        The SV layer's chunk (its gate refreshes every ``chunk`` positions; also the local window).
    lr, warmup_steps, eval_every, eval_bytes, embedded_bytes, seed
        As in :class:`TrainConfig`.
    operators : list of str
        Twins to train (``sv`` first; ``swa`` may be added).
    sample_bytes : int
        Length of the generated sample.
    prompt : str
    progress : bool
    """

    run_dir: str = "runs/quickstart"
    steps: int = 500
    batch_size: int = 16
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    block_size: int = 128
    chunk: int = 32
    lr: float = 3e-3
    warmup_steps: int = 40
    eval_every: int = 125
    eval_bytes: int = 65_536
    embedded_bytes: int = 4_000_000
    seed: int = 0
    operators: list[str] = field(default_factory=lambda: ["sv", "softmax"])
    sample_bytes: int = 80
    prompt: str = "Once upon a time, there was"
    progress: bool = True

    def train_config(self) -> TrainConfig:
        return TrainConfig(
            run_dir=str(Path(self.run_dir) / "train"), operator="sv",
            operator_config={"chunk": self.chunk, "n0": self.chunk}, hidden_size=self.hidden_size,
            num_layers=self.num_layers, num_heads=self.num_heads, block_size=self.block_size, steps=self.steps,
            batch_size=self.batch_size, lr=self.lr, warmup_steps=min(self.warmup_steps, max(self.steps - 1, 0)),
            eval_every=self.eval_every, eval_bytes=self.eval_bytes, log_every=10,
            embedded_bytes=self.embedded_bytes, seed=self.seed)


def _say(msg: str) -> None:
    print(msg, flush=True)


def _step(i: int, n: int, title: str) -> float:
    _say(f"\n[{i}/{n}] {title}")
    return time.perf_counter()


def certified_context_demo(model: torch.nn.Module, context: bytes, chunk: int, nu: float, n0: int) -> dict[str, Any]:
    """Certified eviction and an exact deletion on ``context`` with the model's exact gate.

    The model is switched (in place) to the ``"sv_attention"`` attention function, which reads the gate
    from a :class:`~sv_attention.CertifiedCache`: the exact fp64 maintained solver per layer and head.

    Returns
    -------
    dict with the eviction receipt summary, the largest next-token logit change after eviction (two
    caches fed the same continuation), and the deletion receipt summary.
    """
    import sv_attention
    from sv_attention.hf.cache import CertifiedCache

    sv_attention.enable(model, "sv_attention", chunk=chunk, nu=nu, n0=n0)
    ids = torch.tensor([list(context)])
    with torch.no_grad():
        ref = CertifiedCache(model.config)
        model(ids[:, :-1], cache=ref, use_cache=True)
        ev = CertifiedCache(model.config)
        model(ids[:, :-1], cache=ev, use_cache=True)
        ev_rep = ev.evict()
        nxt = ids[:, -1:]
        change = float((model(nxt, cache=ref, use_cache=True).logits
                        - model(nxt, cache=ev, use_cache=True).logits).abs().max())
        # exact deletion of the first long-range (admitted) token of the context
        fg = CertifiedCache(model.config)
        model(ids, cache=fg, use_cache=True)
        del_rep = fg.forget([1], verify=True)
    layers = ev_rep.layers
    return {
        "context_bytes": len(context),
        "eviction": {
            "certified": bool(ev_rep.certified), "n_evicted": int(ev_rep.n_evicted),
            "slots_before": [le.n_slots_before for le in layers], "slots_after": [le.n_slots_after for le in layers],
            "kkt_max": max(le.kkt_max for le in layers),
            "memory_bytes_before": ev_rep.memory_bytes_before, "memory_bytes_after": ev_rep.memory_bytes_after,
            "next_token_logit_change": change,
        },
        "deletion": {
            "positions": list(del_rep.positions), "paths": {str(k): v for k, v in del_rep.paths.items()},
            "max_kkt_residual": del_rep.max_kkt_residual, "max_refit_deviation": del_rep.max_refit_deviation,
            "verified": bool(del_rep.verified), "scope": del_rep.scope,
        },
    }


def run_quickstart(opts: QuickstartOptions) -> dict[str, Any]:
    """Run the seven steps (see the module docstring); return the summary that is also written to
    ``run_dir/quickstart.json``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sv_attention.artifact.export import export_artifact
    from sv_attention.artifact.verify import verify_artifact
    from sv_attention.data import embedded_corpus
    from sv_attention.results import write_result
    from sv_attention.train.model import load_pretrained
    from sv_attention.train.twins import interleaved_throughput, train_twins, twins_summary

    t_start = time.perf_counter()
    n = 7
    run_dir = Path(opts.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    base = opts.train_config()
    summary: dict[str, Any] = {"options": {k: v for k, v in opts.__dict__.items()}}
    timings: dict[str, float] = {}

    t = _step(1, n, "embedded corpus")
    ec = embedded_corpus(opts.embedded_bytes, seed=base.data_seed)
    _say(f"  {ec.description}\n  cached at {ec.path} (sha256 {ec.sha256[:16]}...)")
    timings["corpus_s"] = time.perf_counter() - t

    t = _step(2, n, f"train {' and '.join(opts.operators)} twins: {opts.steps} steps x {opts.batch_size} x "
                    f"{opts.block_size} bytes, d={opts.hidden_size}, {opts.num_layers} layers, SV chunk {opts.chunk}")
    results = train_twins(base, list(opts.operators), progress=opts.progress)
    tps = interleaved_throughput(results, repeats=3)
    twins = twins_summary(results, tps)
    res_dir = run_dir / "results"
    twins_path = write_result("quickstart_twins", twins, path=res_dir / "quickstart_twins.json")
    _say(f"  {'operator':<10}{'val bpb':>9}{'params':>10}{'bytes/s':>10}")
    for op, r in results.items():
        _say(f"  {op:<10}{r.val_bpb:>9.4f}{r.summary['parameters']['total']:>10,}{tps[op]:>10,.0f}")
    if "throughput_ratio_sv_over_softmax" in twins:
        _say(f"  throughput SV / softmax: {twins['throughput_ratio_sv_over_softmax']:.3f} (interleaved, same batch)")
    _say("  (bits-per-byte on the embedded story corpus: not enwik8, not comparable with published numbers)")
    timings["train_s"] = time.perf_counter() - t

    main_op = opts.operators[0]
    t = _step(3, n, f"export the {main_op} model as a Hub artifact")
    art = run_dir / "artifact"
    sv_ckpt = results[main_op].checkpoint
    manifest = export_artifact(sv_ckpt, art, command=f"sv-attention export {sv_ckpt} --out {art}",
                               results_dir=res_dir, overwrite=True)
    _say(f"  {art}: {len(manifest['files'])} files, {manifest['parameters']['total']:,} parameters, "
         f"card {art / 'README.md'}")
    timings["export_s"] = time.perf_counter() - t

    t = _step(4, n, "reload with AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True) and generate")
    model = AutoModelForCausalLM.from_pretrained(art, trust_remote_code=True, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(art, trust_remote_code=True, local_files_only=True)
    trained = load_pretrained(TrainConfig.from_json(results[main_op].summary["train_config"]), sv_ckpt).eval()
    probe = torch.tensor([list(opts.prompt.encode())])
    with torch.no_grad():
        logit_diff = float((model(probe, use_cache=False).logits - trained(probe, use_cache=False).logits).abs().max())
    ids = tok(opts.prompt, return_tensors="pt").input_ids
    max_new = max(1, min(opts.sample_bytes, opts.block_size - ids.shape[1]))
    torch.manual_seed(opts.seed)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new, do_sample=True, top_k=8, temperature=0.8)
    sample = tok.decode(out[0], skip_special_tokens=True)
    _say(f"  loaded {type(model).__name__}; max |logit difference| vs the trained checkpoint: {logit_diff:.2e}")
    _say(f"  sample (top-k 8, temperature 0.8): {sample!r}")
    summary["reload"] = {"class": type(model).__name__, "max_logit_difference": logit_diff, "sample": sample}
    timings["reload_generate_s"] = time.perf_counter() - t

    t = _step(5, n, "certified eviction and an exact deletion on a validation context, with receipts")
    val_start = results[main_op].summary["data"]["validation"]["start"]
    context = ec.path.read_bytes()[val_start:val_start + opts.block_size]
    sv_knobs = model.config.operator_config if model.config.operator == "sv" else {}
    demo = certified_context_demo(model, context, chunk=int(sv_knobs.get("chunk", opts.chunk)),
                                  nu=float(sv_knobs.get("nu") or 0.5),
                                  n0=int(sv_knobs.get("n0") or sv_knobs.get("chunk") or opts.chunk))
    e, d = demo["eviction"], demo["deletion"]
    _say(f"  eviction: certified={e['certified']}, {e['n_evicted']} (layer, token) slots evicted, slots per layer "
         f"{e['slots_before']} -> {e['slots_after']}, KV memory {e['memory_bytes_before']:,} -> "
         f"{e['memory_bytes_after']:,} bytes, KKT residual {e['kkt_max']:.1e}")
    _say(f"  next-token logits with vs without eviction: max |difference| = {e['next_token_logit_change']:.2e}")
    _say(f"  deletion of position {d['positions']}: path {d['paths']}, KKT residual {d['max_kkt_residual']:.1e}, "
         f"deviation from a from-scratch refit {d['max_refit_deviation']:.1e}")
    _say(f"  {d['scope']}")
    summary["certified"] = demo
    timings["certified_s"] = time.perf_counter() - t

    t = _step(6, n, f"sv-attention verify {art}")
    verify_json = run_dir / "verify.json"
    report = verify_artifact(art)
    verify_json.write_text(json.dumps({"ok": report.ok, "problems": report.problems, "findings": report.findings,
                                       "checks": report.checks}, indent=2, default=str) + "\n")
    for line in [*(f"NOTE: {f}" for f in report.findings), *(f"MISMATCH: {p}" for p in report.problems)]:
        _say(f"  {line}")
    rc = 0 if report.ok else 1  # the exit code `sv-attention verify` gives for this report
    summary["verify"] = {"exit_code": rc, "ok": report.ok, "problems": report.problems, "report": str(verify_json)}
    timings["verify_s"] = time.perf_counter() - t

    _step(7, n, "summary")
    timings["total_s"] = time.perf_counter() - t_start
    summary.update({
        "val_bpb": twins["val_bpb"], "throughput_ratio_sv_over_softmax": twins.get("throughput_ratio_sv_over_softmax"),
        "paths": {
            "run_dir": str(run_dir), "corpus": str(ec.path),
            "runs": {op: str(r.run_dir) for op, r in results.items()},
            "checkpoints": {op: str(r.checkpoint) for op, r in results.items()},
            "logs": {op: str(r.run_dir / "log.jsonl") for op, r in results.items()},
            "twins_result": str(twins_path), "artifact": str(art), "card": str(art / "README.md"),
            "manifest": str(art / "MANIFEST.json"), "verify_report": str(verify_json),
        },
        "timings": timings,
    })
    out = write_result("quickstart", summary, path=run_dir / "quickstart.json")
    for k, v in summary["paths"].items():
        _say(f"  {k:<14}{json.dumps(v) if isinstance(v, dict) else v}")
    _say(f"  {'summary':<14}{out}")
    _say(f"  total {timings['total_s']:.0f} s; verify {'passed' if rc == 0 else 'FAILED'}")
    summary["ok"] = rc == 0 and logit_diff <= 1e-5
    return summary
