"""``sv-attention bench ceq``: training-step wall time and peak memory of the ceq hybrid vs torch SDPA.

Both sides run the same shapes in the same process, interleaved (sdpa, ceq, sdpa, ceq, ...), so the
ratios see the same machine load. Two levels:

``op``
    the attention operator alone: forward + backward of ``<out, g>`` w.r.t. q, k, v (and alpha).
``block``
    one pre-norm transformer block (q/k/v/o projections + 4x MLP) whose attention is either SDPA or the
    ceq hybrid: forward + backward of a token loss w.r.t. all parameters (a training step without the
    optimizer update).

Wall: the minimum over ``--repeats`` interleaved runs (the least-disturbed run; the median is stored
too). CPU time (``time.process_time``, all threads of this process) is recorded beside it: on a shared
machine it is the steadier cost measure, since waiting for a core does not count. Peak memory: ``torch.profiler`` with ``profile_memory=True`` records every CPU allocator
allocation and free during one step; the running sum of those byte deltas, maximised, is the step's peak
memory above what existed before it (inputs and parameters excluded, their gradients included). This
counts tensor memory exactly (not RSS, which the allocator and other processes blur).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention

COMMAND = "bench ceq"
HELP = "ceq hybrid (hops=2) vs torch SDPA: training-step wall time and peak memory over sequence lengths"

TARGET_WALL_SEQ, TARGET_WALL = 512, 1.3
TARGET_MEM_SEQ, TARGET_MEM = 1024, 2.0
PUBLISHED = {"wall_ratio": 1.32, "peak_memory_ratio_range": [1.44, 4.45], "seq_range": [128, 1024]}
#: Why the operator-level wall target is out of reach on a CPU, and what the ``sdpa_x2`` column measures.
TWO_SDPA_FLOOR = {
    "sdpa_products": 6,
    "ceq_products": 12,
    "explanation": (
        "products of an [s, s] matrix with [s, d] operands (causal halves skipped on both sides): SDPA does QK^T "
        "and PV forward, dP, dV, dQ, dK backward = 6. The sgate hybrid at hops=2 shares one QK^T for the "
        "stock softmax and A, then needs P+ v, P- v (stock and A v from them), A (A v) forward = 4, and "
        "backward d(A v) = A^T g (1), dA and dP from [d(Av), g] against [v, Av] (3), dV through P+ and P- (2), "
        "dQ and dK (2) = 8: 12 in all, twice SDPA's. On a CPU both sides are bound by these products (SDPA's "
        "fused kernel runs them at the BLAS rate), so an exact implementation costs at least ~2x SDPA; "
        "sdpa_x2 (two causal SDPA calls, forward + backward) measures that floor in the same run. The "
        "published 1.32x is consistent with a GPU, where attention at these sizes is bound by memory "
        "traffic rather than by products."),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seqs", type=int, nargs="+", default=[128, 256, 512, 1024],
                        help="sequence lengths (default 128 256 512 1024)")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per side and length (default 5)")
    parser.add_argument("--level", choices=["op", "block", "both"], default="both",
                        help="operator alone, a transformer block, or both (default both)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for the run (default: leave torch's setting)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--json", type=str, default=None, help="output path (default results/bench_ceq.json)")


def peak_bytes(fn: Callable[[], None]) -> int:
    """Peak tensor memory (bytes) allocated by ``fn`` above the level before it, from profiler events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    mem = [e for e in events if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0]
    mem.sort(key=lambda e: (e.get("ts", 0), e["args"].get("Ev Idx", 0)))
    run = peak = 0
    for e in mem:
        run += int(e["args"]["Bytes"])
        peak = max(peak, run)
    return peak


class Block(nn.Module):
    """Pre-norm transformer block; ``attn`` is ``"sdpa"`` or ``"ceq"`` (hybrid, sgate, hops=2)."""

    def __init__(self, heads: int, head_dim: int, attn: str) -> None:
        super().__init__()
        d = heads * head_dim
        self.heads, self.attn = heads, attn
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.alpha = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from sv_attention.ops.ceq import ceq_attention

        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(self.n1(x)).chunk(3, -1))
        if self.attn == "sdpa":
            a = scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            a = ceq_attention(q, k, v, alpha=self.alpha, hops=2)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.n2(x))


def _op_step(kind: str, b: int, h: int, s: int, d: int, seed: int) -> tuple[Callable[[], None], Callable[[], None]]:
    from sv_attention.ops.ceq import ceq_attention

    g = torch.Generator().manual_seed(seed)
    q, k, v, go = (torch.randn(b, h, s, d, generator=g) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    alpha = torch.tensor(0.5, requires_grad=True)

    def reset() -> None:
        for t in (q, k, v, alpha):
            t.grad = None

    def step() -> None:
        if kind == "sdpa":
            out = scaled_dot_product_attention(q, k, v, is_causal=True)
        elif kind == "sdpa_x2":  # the floor: two attentions' worth of products (see TWO_SDPA_FLOOR)
            out = scaled_dot_product_attention(q, k, v, is_causal=True) + scaled_dot_product_attention(
                k, q, v, is_causal=True)
        else:
            out = ceq_attention(q, k, v, alpha=alpha, hops=2)
        (out * go).sum().backward()

    return reset, step


def _block_step(kind: str, b: int, h: int, s: int, d: int, seed: int,
                ) -> tuple[Callable[[], None], Callable[[], None]]:
    torch.manual_seed(seed)
    block = Block(h, d, kind)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, h * d, generator=g)

    def reset() -> None:
        block.zero_grad(set_to_none=True)

    def step() -> None:
        block(x).pow(2).mean().backward()

    return reset, step


def measure(level: str, seq: int, args: argparse.Namespace) -> dict:
    """Wall and peak memory for both sides at one sequence length."""
    make = _op_step if level == "op" else _block_step
    kinds = ("sdpa", "ceq", "sdpa_x2") if level == "op" else ("sdpa", "ceq")
    steps = {kind: make(kind, args.batch, args.heads, seq, args.head_dim, args.seed) for kind in kinds}
    for reset, f in steps.values():  # warm-up (allocator, kernels)
        reset()
        f()
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.repeats):
        for kind, (reset, f) in steps.items():
            reset()
            c0, t0 = time.process_time(), time.perf_counter()
            f()
            times[kind].append(time.perf_counter() - t0)
            cpu[kind].append(time.process_time() - c0)
    mem = {}
    for kind, (reset, f) in ((k, steps[k]) for k in ("sdpa", "ceq")):
        reset()  # gradients freed before the profiled step: the step's peak includes allocating them
        mem[kind] = peak_bytes(f)
    wall = {kind: min(ts) for kind, ts in times.items()}
    cpu_min = {kind: min(ts) for kind, ts in cpu.items()}
    return {
        "level": level, "seq": seq,
        "sdpa_wall_s": wall["sdpa"], "ceq_wall_s": wall["ceq"],
        "sdpa_wall_median_s": statistics.median(times["sdpa"]), "ceq_wall_median_s": statistics.median(times["ceq"]),
        "wall_ratio": wall["ceq"] / wall["sdpa"],
        "sdpa_cpu_s": cpu_min["sdpa"], "ceq_cpu_s": cpu_min["ceq"],
        "cpu_ratio": cpu_min["ceq"] / max(cpu_min["sdpa"], 1e-12),
        "sdpa_peak_bytes": mem["sdpa"], "ceq_peak_bytes": mem["ceq"],
        "peak_memory_ratio": mem["ceq"] / max(mem["sdpa"], 1),
        "sdpa_x2_wall_s": wall.get("sdpa_x2"),
        "wall_ratio_to_sdpa_x2": wall["ceq"] / wall["sdpa_x2"] if "sdpa_x2" in wall else None,
    }


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from sv_attention.results import write_result

    if args.threads is not None:
        if args.threads < 1:
            from sv_attention.errors import InvalidHyperparameterError

            raise InvalidHyperparameterError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)  # no linear solves in this process (DESIGN §2.4 caveat)
    levels = ["op", "block"] if args.level == "both" else [args.level]
    rows = []
    jobs = [(lv, s) for lv in levels for s in args.seqs]
    for lv, s in tqdm(jobs, desc="bench ceq", disable=len(jobs) < 3):
        rows.append(measure(lv, s, args))
    print(f"{'level':<6}{'seq':>6}{'sdpa ms':>10}{'ceq ms':>10}{'wall x':>8}{'cpu x':>8}"
          f"{'sdpa MB':>10}{'ceq MB':>10}{'mem x':>8}{'vs 2xSDPA':>11}")
    for r in rows:
        print(f"{r['level']:<6}{r['seq']:>6}{1e3 * r['sdpa_wall_s']:>10.2f}{1e3 * r['ceq_wall_s']:>10.2f}"
              f"{r['wall_ratio']:>8.2f}{r['cpu_ratio']:>8.2f}{r['sdpa_peak_bytes'] / 2**20:>10.2f}"
              f"{r['ceq_peak_bytes'] / 2**20:>10.2f}{r['peak_memory_ratio']:>8.2f}"
              + (f"{r['wall_ratio_to_sdpa_x2']:>11.2f}" if r["wall_ratio_to_sdpa_x2"] is not None else f"{'-':>11}"))
    targets = {}
    for lv in levels:
        by = {r["seq"]: r for r in rows if r["level"] == lv}
        if TARGET_WALL_SEQ in by:
            r = by[TARGET_WALL_SEQ]
            targets[f"{lv}_wall_ratio_at_{TARGET_WALL_SEQ}"] = {
                "value": r["wall_ratio"], "target": TARGET_WALL, "met": r["wall_ratio"] <= TARGET_WALL}
            targets[f"{lv}_cpu_ratio_at_{TARGET_WALL_SEQ}"] = {
                "value": r["cpu_ratio"], "target": TARGET_WALL, "met": r["cpu_ratio"] <= TARGET_WALL}
        if TARGET_MEM_SEQ in by:
            targets[f"{lv}_peak_memory_ratio_at_{TARGET_MEM_SEQ}"] = {
                "value": by[TARGET_MEM_SEQ]["peak_memory_ratio"], "target": TARGET_MEM,
                "met": by[TARGET_MEM_SEQ]["peak_memory_ratio"] <= TARGET_MEM}
    for name, t in targets.items():
        print(f"target {name}: {t['value']:.2f} (target <= {t['target']}) {'met' if t['met'] else 'NOT met'}")
    payload = {
        "config": {"batch": args.batch, "heads": args.heads, "head_dim": args.head_dim, "seqs": args.seqs,
                   "repeats": args.repeats, "operator": "sgate", "form": "hybrid", "hops": 2, "alpha": 0.5,
                   "dtype": "float32", "torch_threads": torch.get_num_threads(), "seed": args.seed},
        "method": {"wall": "min over interleaved repeats of forward+backward (median stored too)",
                   "cpu": "min over the same repeats of time.process_time (all threads of the process)",
                   "peak_memory": "max running sum of CPU allocator alloc/free bytes from torch.profiler "
                                  "(profile_memory=True) during one step"},
        "rows": rows, "targets": targets, "published": PUBLISHED, "two_sdpa_floor": TWO_SDPA_FLOOR,
    }
    path = write_result("bench_ceq", payload, args.json)
    print(f"wrote {path}")
    return 0
