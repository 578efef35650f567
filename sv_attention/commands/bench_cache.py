"""``sv-attention bench cache``: the certified KV cache's costs, measured side by side in one run.

On a randomly initialised tiny Llama (default: hidden 256, 4 layers, 8 heads, 2 kv-heads, chunk 64)
with ``attn_implementation="sv_attention"``:

- **deletion latency**: ``cache.forget([p])`` of a random admitted long-range position after a prefill
  of ``--context`` tokens; the per-solver decrement time (one solver per layer x kv-head) and the whole
  call, medians over ``--trials`` deletions, next to a from-scratch refit of one solver's history;
- **eviction cost**: ``cache.evict()`` wall time per evicted token;
- **memory** before/after certified eviction on a *redundant* stream (a short token pattern repeated)
  and on a random stream: ``memory_bytes()`` (the key/value tensors), per-head reserve fraction,
  realised eviction fraction, and every tier of ``memory_report()`` (offload, alpha snapshots, and the
  fp64 solvers: keys, Gram, bordered inverse, evicted-key store), summed as ``all_tiers_bytes``;
- **decode tokens/s**: greedy decode of ``--new-tokens`` tokens after the prompt with the certified
  cache (with and without an eviction after the prefill) vs the model's ``DynamicCache`` (where the
  ``sv_attention`` function fits its own gate), decode steps interleaved across the three caches so
  that the ratios to DynamicCache see the same machine load (target >= 0.5x).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

COMMAND = "bench cache"
HELP = "certified KV cache: deletion latency per layer x head, eviction cost, memory, decode tok/s vs DynamicCache"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", type=int, default=512, help="prompt length (default 512)")
    parser.add_argument("--new-tokens", type=int, default=64, help="decoded tokens (default 64)")
    parser.add_argument("--trials", type=int, default=10, help="deletions timed (default 10)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--nu", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=str, default=None, help="output JSON (default results/bench_cache.json)")


def build_model(hidden: int, layers: int, heads: int, kv_heads: int, chunk: int, nu: float, seed: int,
                max_pos: int) -> Any:
    """A randomly initialised Llama with the ``sv_attention`` attention implementation."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import sv_attention

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos)
    model = LlamaForCausalLM(cfg).eval()
    sv_attention.enable(model, "sv_attention", nu=nu, chunk=chunk)
    return model


def _prefill(model: Any, ids: Any, cache: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(ids, cache=cache, use_cache=True).logits


def bench_deletion(model: Any, ids: Any, trials: int, seed: int) -> dict[str, Any]:
    import numpy as np

    from sv_attention.hf.cache import CertifiedCache
    from sv_attention.svdd import refit

    cache = CertifiedCache(model.config)
    _prefill(model, ids, cache)
    rng = np.random.default_rng(seed)
    admitted = sorted(cache.layers[0].bank.history) if cache.layers[0].bank is not None else []
    if not admitted:
        return {"skipped": "no admitted long-range tokens (context shorter than two chunks?)"}
    victims = rng.choice(admitted, size=min(trials, len(admitted)), replace=False).tolist()
    per_solver: dict[tuple[int, int], list[float]] = {}
    by_kind: dict[str, list[float]] = {"support": [], "reserve": []}
    calls, kkts, snaps = [], [], []
    for p in victims:
        t0 = time.perf_counter()
        [layer.snapshot() for layer in cache.layers]  # what forget's rollback snapshot costs
        snaps.append(time.perf_counter() - t0)
        was_sv = {(layer.layer_idx, j): float(layer.bank.solvers[0][j].alpha_of([int(p)])[0]) > 0
                  for layer in cache.layers for j in range(len(layer.bank.solvers[0]))}
        rep = cache.forget([int(p)])
        calls.append(rep.elapsed_s)
        kkts.append(rep.max_kkt_residual)
        for s in rep.solvers:
            per_solver.setdefault((s.layer, s.head), []).append(s.elapsed_s)
            by_kind["support" if was_sv[(s.layer, s.head)] else "reserve"].append(s.elapsed_s)
    solver = cache.layers[0].bank.solvers[0][0]
    ev = solver.state_dict()["evicted"]
    keys = np.concatenate([solver.keys] + ([np.stack(list(ev.values()))] if ev else []))
    t0 = time.perf_counter()
    refit(keys, C=solver.C, sigma=solver.sigma)
    refit_s = time.perf_counter() - t0
    all_solver = [t for ts in per_solver.values() for t in ts]
    med = statistics.median(all_solver)
    return {
        "admitted_keys": len(admitted),
        "deletions": len(victims),
        "median_solver_decrement_ms": med * 1e3,
        "median_forget_call_ms": statistics.median(calls) * 1e3,
        "median_rollback_snapshot_ms": statistics.median(snaps) * 1e3,
        "per_layer_head_median_ms": {f"L{k[0]}H{k[1]}": statistics.median(v) * 1e3 for k, v in sorted(per_solver.items())},
        "median_support_vector_decrement_ms": statistics.median(by_kind["support"]) * 1e3 if by_kind["support"]
        else None,
        "median_reserve_decrement_ms": statistics.median(by_kind["reserve"]) * 1e3 if by_kind["reserve"] else None,
        "support_vector_decrements": len(by_kind["support"]),
        "solvers_per_deletion": len(per_solver),
        "refit_one_solver_ms": refit_s * 1e3,
        "refit_over_decrement": refit_s / med if med > 0 else None,
        "max_kkt_residual": max(kkts),
    }


def bench_memory(model: Any, ids: Any, label: str) -> dict[str, Any]:
    from sv_attention.hf.cache import CertifiedCache

    cache = CertifiedCache(model.config)
    _prefill(model, ids, cache)
    before = cache.memory_bytes()
    tiers_before = cache.memory_report()
    rep = cache.evict()
    n_ev = rep.n_evicted
    tiers_after = cache.memory_report()
    return {
        "tiers_before": tiers_before,
        "tiers_after": tiers_after,
        "all_tiers_bytes_before": sum(tiers_before.values()),
        "all_tiers_bytes_after": sum(tiers_after.values()),
        "stream": label,
        "tokens": int(ids.shape[1]),
        "memory_bytes_before": before,
        "memory_bytes_after": cache.memory_bytes(),
        "memory_ratio": cache.memory_bytes() / before if before else None,
        "offload_bytes": rep.offload_bytes,
        "mean_reserve_fraction": rep.mean_reserve_fraction,
        "realised_fraction": rep.realised_fraction,
        "per_layer_reserve_fraction": [le.reserve_fraction for le in rep.layers],
        "per_layer_realised_fraction": [le.realised_fraction for le in rep.layers],
        "evicted_tokens": n_ev,
        "evict_ms": rep.elapsed_s * 1e3,
        "evict_us_per_token": rep.elapsed_s * 1e6 / n_ev if n_ev else None,
        "certified": rep.certified,
    }


def bench_decode(model: Any, ids: Any, new_tokens: int) -> dict[str, Any]:
    """Greedy decode with three caches, steps interleaved (dynamic, certified, certified+evicted) so that
    the ratios see the same machine load."""
    import torch
    from transformers import DynamicCache

    from sv_attention.hf.cache import CertifiedCache

    names = ("dynamic", "certified", "certified_evicted")
    out: dict[str, Any] = {}
    caches, toks, secs = {}, {}, dict.fromkeys(names, 0.0)
    for name in names:
        cache = DynamicCache(config=model.config) if name == "dynamic" else CertifiedCache(model.config)
        t0 = time.perf_counter()
        logits = _prefill(model, ids, cache)
        prefill_s = time.perf_counter() - t0
        if name == "certified_evicted":
            cache.evict()
        caches[name] = cache
        toks[name] = [logits[:, -1].argmax(-1, keepdim=True)]
        out[name] = {"prefill_s": prefill_s, "prefill_tok_s": ids.shape[1] / prefill_s}
    with torch.no_grad():
        for _ in range(new_tokens):
            for name in names:
                t0 = time.perf_counter()
                logits = model(toks[name][-1], cache=caches[name], use_cache=True).logits
                secs[name] += time.perf_counter() - t0
                toks[name].append(logits[:, -1].argmax(-1, keepdim=True))
    for name in names:
        out[name].update(decode_s=secs[name], decode_tok_s=new_tokens / secs[name])
    for name in names[1:]:
        out[name]["decode_ratio_to_dynamic"] = out[name]["decode_tok_s"] / out["dynamic"]["decode_tok_s"]
        out[name]["prefill_ratio_to_dynamic"] = out[name]["prefill_tok_s"] / out["dynamic"]["prefill_tok_s"]
    seq = {name: torch.cat(toks[name], dim=1) for name in names}
    out["greedy_tokens_equal_certified_vs_evicted"] = bool(torch.equal(seq["certified"], seq["certified_evicted"]))
    out["greedy_tokens_equal_certified_vs_dynamic"] = bool(torch.equal(seq["certified"], seq["dynamic"]))
    out["memory_bytes_after_decode"] = {name: caches[name].memory_bytes() for name in names[1:]}
    return out


def run_bench(context: int = 512, new_tokens: int = 64, trials: int = 10, hidden: int = 256, layers: int = 4,
              heads: int = 8, kv_heads: int = 2, chunk: int = 64, nu: float = 0.3, seed: int = 0,
              progress: bool = True) -> dict[str, Any]:
    """Run every measurement; returns the JSON payload."""
    import torch
    from tqdm import tqdm

    model = build_model(hidden, layers, heads, kv_heads, chunk, nu, seed, max_pos=context + new_tokens + 8)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (1, context), generator=g)
    pattern = torch.randint(0, 256, (1, 8), generator=g)
    redundant = pattern.repeat(1, context // 8 + 1)[:, :context]
    steps = tqdm(total=4, desc="bench cache", disable=not progress)
    payload: dict[str, Any] = {"model": {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
                                         "chunk": chunk, "nu": nu, "context": context, "new_tokens": new_tokens}}
    payload["deletion"] = bench_deletion(model, ids, trials, seed)
    steps.update()
    payload["memory"] = [bench_memory(model, redundant, "redundant (8-token pattern repeated)")]
    steps.update()
    payload["memory"].append(bench_memory(model, ids, "random tokens"))
    steps.update()
    payload["decode"] = bench_decode(model, ids, new_tokens)
    steps.update()
    steps.close()
    return payload


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f} ms"


def run(args: argparse.Namespace) -> int:
    from sv_attention.results import write_result

    p = run_bench(args.context, args.new_tokens, args.trials, args.hidden, args.layers, args.heads, args.kv_heads,
                  args.chunk, args.nu, args.seed)
    d = p["deletion"]
    print(f"certified cache bench: context {args.context}, {args.layers} layers x {args.kv_heads} kv-heads, "
          f"chunk {args.chunk}")
    if "skipped" in d:
        print(f"deletion: skipped ({d['skipped']})")
    else:
        print(f"deletion ({d['admitted_keys']} admitted keys/solver, {d['deletions']} deletions): median "
              f"{d['median_solver_decrement_ms']:.3f} ms per solver (support vectors: "
              f"{_ms(d['median_support_vector_decrement_ms'])}, reserve: {_ms(d['median_reserve_decrement_ms'])}), "
              f"{d['median_forget_call_ms']:.2f} ms per forget "
              f"call ({d['solvers_per_deletion']} solvers, of which {d['median_rollback_snapshot_ms']:.2f} ms is the "
              f"rollback snapshot); one-solver refit {d['refit_one_solver_ms']:.2f} ms "
              f"({d['refit_over_decrement']:.0f}x); max KKT residual {d['max_kkt_residual']:.1e}")
    print(f"{'stream':<38} {'kv before':>10} {'after':>9} {'ratio':>6} {'reserve':>8} {'realised':>9} {'us/token':>9} "
          f"{'all tiers before':>17} {'after':>9}")
    for m in p["memory"]:
        per = m["evict_us_per_token"]
        print(f"{m['stream']:<38} {m['memory_bytes_before']:>10} {m['memory_bytes_after']:>9} "
              f"{m['memory_ratio']:>6.3f} {m['mean_reserve_fraction']:>8.3f} {m['realised_fraction']:>9.3f} "
              f"{'' if per is None else f'{per:.1f}':>9} {m['all_tiers_bytes_before']:>17} "
              f"{m['all_tiers_bytes_after']:>9}")
    dec = p["decode"]
    print(f"{'cache':<18} {'prefill tok/s':>13} {'decode tok/s':>13} {'decode vs dynamic':>18}")
    for name in ("dynamic", "certified", "certified_evicted"):
        r = dec[name].get("decode_ratio_to_dynamic", 1.0)
        print(f"{name:<18} {dec[name]['prefill_tok_s']:>13.1f} {dec[name]['decode_tok_s']:>13.1f} {r:>17.2f}x")
    out = write_result("bench_cache", p, path=args.json)
    print(f"wrote {out}")
    return 0
