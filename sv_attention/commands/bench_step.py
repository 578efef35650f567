"""``sv-attention bench step``: training-step time of a small decoder, SV attention vs torch SDPA.

One training step = zero_grad, forward, cross-entropy, backward (no optimizer update; it is identical
for both). The same pre-norm byte-level decoder (default 4 layers, d_model 256, 4 heads, block 256,
batch 16) is built twice from one seed, once with :class:`sv_attention.ops.CausalSVAttention` (batched
solver, chunk 64) and once with the same q/k/v/o projections around
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``. The two are timed interleaved in
one run (median of ``--repeats`` after ``--warmup`` steps), and one extra SV step is profiled with
``torch.profiler`` to say where the time goes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

COMMAND = "bench step"
HELP = "training-step time of a small decoder: CausalSVAttention (batched) vs torch SDPA, with a profile"

#: Profiler labels emitted by the SV path (see sv_attention.ops.causal and sv_attention.svdd.batched).
PROFILE_LABELS = ("sv.gram", "sv.finder", "sv.polish", "sv.active_set", "sv.solve", "sv.readout", "sv.gate")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--d-model", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--block", type=int, default=256, help="sequence length (default 256)")
    parser.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    parser.add_argument("--chunk", type=int, default=64, help="SV chunk length (default 64)")
    parser.add_argument("--nu", type=float, default=0.5, help="SV gate nu, C = 1/(nu*chunk) (default 0.5)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per arm (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per arm first (default 1)")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "mlx"),
                        help="batched finder backend (default auto)")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled steps (one per size)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--no-demo-row", action="store_true",
                        help="skip the second row: the `make demo` model (2 layers, d_model 128, block 128, chunk 32)")
    parser.add_argument("--no-checkpoint-row", action="store_true",
                        help="skip the third row: the published checkpoint (hf_artifact, trained weights) on text")
    parser.add_argument("--json", default=None, help="output path (default results/bench_step.json)")


def build_decoder(attn: str, *, layers: int, d_model: int, heads: int, block: int, chunk: int, nu: float,
                  backend: str = "auto", vocab: int = 256, seed: int = 0) -> Any:
    """A pre-norm decoder whose attention is ``attn`` ("sv" or "sdpa"); identical weights per seed."""
    import torch
    from torch import nn

    from sv_attention.ops.causal import CausalSVAttention

    class SDPAAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.h, self.hd = heads, d_model // heads
            self.q_proj = nn.Linear(d_model, d_model, bias=False)
            self.k_proj = nn.Linear(d_model, d_model, bias=False)
            self.v_proj = nn.Linear(d_model, d_model, bias=False)
            self.o_proj = nn.Linear(d_model, d_model, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape

            def sp(t: torch.Tensor) -> torch.Tensor:
                return t.view(b, s, self.h, self.hd).transpose(1, 2)

            o = torch.nn.functional.scaled_dot_product_attention(sp(self.q_proj(x)), sp(self.k_proj(x)),
                                                                 sp(self.v_proj(x)), is_causal=True)
            return self.o_proj(o.transpose(1, 2).reshape(b, s, d_model))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.attn = (CausalSVAttention(d_model, heads, nu=nu, n0=chunk, chunk=chunk,
                                           gate_backend=backend)
                         if attn == "sv" else SDPAAttention())
            self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.n1(x))
            return x + self.mlp(self.n2(x))

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d_model)
            self.pos = nn.Parameter(torch.zeros(block, d_model))
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
            self.norm = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.emb(idx) + self.pos[: idx.shape[1]]
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x))

    torch.manual_seed(seed)
    return Decoder()


def train_step(model: Any, idx: Any) -> float:
    """zero_grad, forward, cross-entropy (next byte), backward; returns the loss."""
    import torch

    model.zero_grad(set_to_none=True)
    out = model(idx[:, :-1])
    logits = getattr(out, "logits", out)  # a transformers model returns an output object
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    loss.backward()
    return float(loss.detach())


def profile_call(fn: Any, rest_label: str, total_label: str = "total (profiled call)") -> list[dict[str, Any]]:
    """Profile one call of ``fn()``; rows ``{"label", "ms", "share"}`` for the SV labels
    (:data:`PROFILE_LABELS`), the rest (``rest_label``: what is not under ``sv.gate`` / ``sv.readout``) and the
    whole call (``total_label``)."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    total_ms = (time.perf_counter() - t0) * 1e3
    agg: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.key in PROFILE_LABELS:
            agg[ev.key] = agg.get(ev.key, 0.0) + ev.cpu_time_total / 1e3
    rows = [{"label": lab, "ms": round(agg.get(lab, 0.0), 2),
             "share": round(agg.get(lab, 0.0) / total_ms, 4) if total_ms > 0 else 0.0} for lab in PROFILE_LABELS]
    gate = agg.get("sv.gate", 0.0) + agg.get("sv.readout", 0.0)
    rows.append({"label": rest_label, "ms": round(total_ms - gate, 2),
                 "share": round(1 - gate / total_ms, 4) if total_ms > 0 else 0.0})
    rows.append({"label": total_label, "ms": round(total_ms, 2), "share": 1.0})
    return rows


def profile_step(model: Any, idx: Any) -> list[dict[str, Any]]:
    """Profile one training step (:func:`profile_call`)."""
    return profile_call(lambda: train_step(model, idx), "rest (projections, MLP, backward, ...)",
                        "total (profiled step)")


#: The model `make demo` trains (sv_attention.train.quickstart defaults), measured as the second row.
DEMO_CONFIG = {"layers": 2, "d_model": 128, "heads": 4, "block": 128, "chunk": 32}
#: SV / SDPA step-time targets per row (issue 17).
TARGETS = {"published 3.22M": 1.5, "make demo": 2.0}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark: the configuration of the flags (the published one by default) with a profile,
    then the `make demo` configuration as a second row (``rows``); returns the JSON payload."""
    first = _measure_one(args)
    rows = [{"name": "published 3.22M" if _is_published(args) else "flags", **_row(first)}]
    if not args.no_demo_row:
        demo = argparse.Namespace(**{**vars(args), **{k.replace("-", "_"): v for k, v in DEMO_CONFIG.items()}})
        rows.append({"name": "make demo", **_row(_measure_one(demo))})
    if not args.no_checkpoint_row:
        trained = _measure_checkpoint(args)
        if trained is not None:
            rows.append({"name": CHECKPOINT_ROW, **trained})
    for row in rows:
        row["target_ratio"] = TARGETS.get(row["name"])
    return {**first, "rows": rows}


#: The third row: the published checkpoint's own weights on text, SV operator vs the same weights with the
#: softmax operator (torch SDPA inside). The gate's cost depends on the keys' geometry: random-init keys of
#: the deeper layers are nearly collinear (flat Grams, slow to fit); trained ones are not.
CHECKPOINT_ROW = "published checkpoint (trained weights, text)"


def _measure_checkpoint(args: argparse.Namespace) -> dict[str, Any] | None:
    """The checkpoint row (None, with a note, when ``hf_artifact/`` is not in this checkout)."""
    import sys

    import torch

    from sv_attention.data.loading import load_corpus
    from sv_attention.readme import ARTIFACT_DIR
    from sv_attention.results import repo_root

    root = repo_root()
    path = root / ARTIFACT_DIR
    if not (path / "model.safetensors").exists():
        print(f"no {path}/model.safetensors: checkpoint row skipped")
        return None
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from modeling_sv import SVForCausalLM

    models = {"sv": SVForCausalLM.from_pretrained(path),
              "sdpa": SVForCausalLM.from_pretrained(path, operator="softmax", operator_config={})}
    block = models["sv"].config.max_position_embeddings
    data = load_corpus("embedded").data[: args.batch * (block + 1)]
    idx = torch.tensor(list(data), dtype=torch.long).view(args.batch, block + 1)

    for m in models.values():
        m.train()
    times, losses, counts = _time_arms(models, idx, args.warmup, args.repeats, "bench step (checkpoint)")
    med = {k: statistics.median(v) for k, v in times.items()}
    cfg = models["sv"].config
    return {"config": {"checkpoint": ARTIFACT_DIR, "layers": cfg.num_hidden_layers, "d_model": cfg.hidden_size,
                       "heads": cfg.num_attention_heads, "block": block, "batch": args.batch,
                       "data": "embedded corpus, first bytes", "sdpa_arm": "same weights, operator 'softmax'",
                       "repeats": args.repeats, "warmup": args.warmup, "torch_threads": torch.get_num_threads()},
            "step_s": med, "ratio_sv_over_sdpa": med["sv"] / med["sdpa"], "loss": losses,
            "gate_stats_timed_steps": counts}


def _time_arms(models: dict[str, Any], idx: Any, warmup: int, repeats: int, desc: str,
               ) -> tuple[dict[str, list[float]], dict[str, float], dict[str, int]]:
    """Time :func:`train_step` of every model on ``idx``: ``warmup`` untimed steps each, then ``repeats``
    rounds interleaved (every arm once per round, so all arms see the same machine load).

    Returns
    -------
    (step seconds per arm, last loss per arm, gate counters of the timed steps)
    """
    from tqdm import tqdm

    from sv_attention.ops.sv_gate import gate_stats

    losses: dict[str, float] = {}
    for _ in range(warmup):
        for name, m in models.items():
            losses[name] = train_step(m, idx)
    stats0 = gate_stats()
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in tqdm(range(repeats), desc=desc, leave=False):
        for name, m in models.items():
            t0 = time.perf_counter()
            losses[name] = train_step(m, idx)
            times[name].append(time.perf_counter() - t0)
    counts = {key: val - stats0.get(key, 0) for key, val in gate_stats().items() if val != stats0.get(key, 0)}
    return times, losses, counts


def _is_published(args: argparse.Namespace) -> bool:
    return (args.layers, args.d_model, args.heads, args.block) == (4, 256, 4, 256)


def _row(res: dict[str, Any]) -> dict[str, Any]:
    return {"config": res["config"], "step_s": res["step_s"], "ratio_sv_over_sdpa": res["ratio_sv_over_sdpa"],
            "gate_stats_timed_steps": res["gate_stats_timed_steps"], "profile_sv_step": res["profile_sv_step"]}


def _measure_one(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration: both arms interleaved (median of ``--repeats``), the profile unless disabled."""
    import torch

    cfg = dict(layers=args.layers, d_model=args.d_model, heads=args.heads, block=args.block, chunk=args.chunk,
               nu=args.nu, backend=args.backend, seed=args.seed)
    models = {"sv": build_decoder("sv", **cfg), "sdpa": build_decoder("sdpa", **cfg)}
    g = torch.Generator().manual_seed(args.seed)
    idx = torch.randint(0, 256, (args.batch, args.block + 1), generator=g)
    times, losses, counts = _time_arms(models, idx, args.warmup, args.repeats, "bench step")
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = args.batch * args.block
    prof = [] if args.no_profile else profile_step(models["sv"], idx)
    return {
        "config": {**cfg, "batch": args.batch, "repeats": args.repeats, "warmup": args.warmup,
                   "torch_threads": torch.get_num_threads()},
        "step_s": {"sv": med["sv"], "sdpa": med["sdpa"]},
        "all_step_s": times,
        "tokens_per_s": {k: tokens / v for k, v in med.items()},
        "ratio_sv_over_sdpa": med["sv"] / med["sdpa"],
        "target_ratio": TARGETS["published 3.22M"] if _is_published(args) else None,
        "loss": losses,
        "profile_sv_step": prof,
        "gate_stats_timed_steps": counts,
    }


def run(args: argparse.Namespace) -> int:
    from sv_attention.results import write_result

    res = measure(args)
    print(f"{'arm':<6} {'step s':>9} {'tokens/s':>10}")
    for k in ("sv", "sdpa"):
        print(f"{k:<6} {res['step_s'][k]:>9.3f} {res['tokens_per_s'][k]:>10.0f}")
    for row in res["rows"]:
        target = f" (target <= {row['target_ratio']})" if row["target_ratio"] else ""
        print(f"{row['name']:<18} ratio sv/sdpa = {row['ratio_sv_over_sdpa']:.2f}{target}")
    if res["profile_sv_step"]:
        print(f"\n{'where the SV step time goes':<40} {'ms':>9} {'share':>7}")
        for row in res["profile_sv_step"]:
            print(f"{row['label']:<40} {row['ms']:>9.1f} {100 * row['share']:>6.1f}%")
    path = write_result("bench_step", res, args.json)
    print(f"\nwrote {path}")
    return 0
