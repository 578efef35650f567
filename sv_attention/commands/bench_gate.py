"""``sv-attention bench gate``: accuracy and throughput of the batched training gate.

Accuracy: for Gaussian and clustered keys, every n, d and nu of the grid, ``--problems`` random SVDD
problems (RBF, median bandwidth, ``C = 1/(nu n)``) are solved by :func:`sv_attention.svdd.solve_batched`
(fp32, default settings) and by the exact fp64 from-scratch solver (the ``refit`` of
:mod:`sv_attention.svdd`); reported: problem-level partition agreement (whole partition identical),
token-level agreement (per-key label identical), ``max |alpha - alpha_exact|`` for the default ridged
coefficients and for ridge 0, and the solve status counts. The FISTA finder alone (``--baseline-iters``
iterations, no polish) is reported beside it for comparison.

Throughput: problems/s of ``solve_batched`` for each backend (torch, MLX when importable) and each
(G, n), timed interleaved in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

COMMAND = "bench gate"
HELP = "accuracy (vs the exact solver) and throughput (torch vs MLX) of the batched SVDD training gate"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kinds", default="gaussian,clustered", help="key families (default gaussian,clustered)")
    parser.add_argument("--ns", type=_ints, default=[64, 128, 256], help="problem sizes (default 64,128,256)")
    parser.add_argument("--ds", type=_ints, default=[16, 32], help="key dims (default 16,32)")
    parser.add_argument("--nus", type=_floats, default=[0.1, 0.3, 0.5], help="nu values (default 0.1,0.3,0.5)")
    parser.add_argument("--problems", type=int, default=32, help="problems per grid cell (default 32)")
    parser.add_argument("--baseline-iters", type=int, default=80,
                        help="FISTA iterations of the finder-only baseline; 0 skips it (default 80)")
    parser.add_argument("--throughput-gs", type=_ints, default=[64, 512, 4096],
                        help="batch sizes G of the throughput table (default 64,512,4096)")
    parser.add_argument("--throughput-ns", type=_ints, default=[64, 256], help="n of the throughput table "
                        "(default 64,256)")
    parser.add_argument("--max-gram-mb", type=float, default=300.0,
                        help="skip throughput cells whose fp32 Gram exceeds this (default 300 MB; G=4096, n=256 "
                        "is 1 GB: raise it to include that cell)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per throughput cell (default 3)")
    parser.add_argument("--backends", default="torch,mlx", help="backends to time (default torch,mlx; mlx is "
                        "skipped when not importable)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--json", default=None, help="output path (default results/bench_gate.json)")


def _problems(kind: str, G: int, n: int, d: int, seed: int) -> tuple[Any, Any]:
    import torch

    from sv_attention.kernels import median_bandwidth, rbf_gram
    from sv_attention.svdd.batched_reference import clustered_keys, gaussian_keys

    g = torch.Generator().manual_seed(seed)
    X = (gaussian_keys if kind == "gaussian" else clustered_keys)(G, n, d, g)
    sig = median_bandwidth(X)
    return X, rbf_gram(X, sigma=sig[:, None, None])


def accuracy_cell(kind: str, n: int, d: int, nu: float, G: int, seed: int, baseline_iters: int) -> dict[str, Any]:
    """Agreement of the batched solve with the exact solver on one grid cell."""
    import numpy as np
    import torch

    from sv_attention.svdd.batched import solve_batched
    from sv_attention.svdd.batched_reference import reference_solution
    from sv_attention.svdd.polish import fixed_partition_solve

    _, K = _problems(kind, G, n, d, seed)
    C = 1.0 / (nu * n)
    refs = [reference_solution(K[i], C) for i in range(G)]
    ref_part = np.stack([r.partition for r in refs])
    ref_alpha = np.stack([r.alpha for r in refs])
    mask = torch.ones(G, n, dtype=torch.bool)
    K32 = K.float()
    t0 = time.perf_counter()
    sol = solve_batched(K32, mask, C)
    elapsed = time.perf_counter() - t0
    # ridge 0 on the same partition: the exact optimum of the partition found
    alpha0 = fixed_partition_solve(K32, mask, sol.margin, sol.error, torch.full((G,), C), 0.0).alpha
    part = (sol.margin.int() + 2 * sol.error.int()).numpy()
    row = {
        "kind": kind, "n": n, "d": d, "nu": nu, "C": C, "problems": G,
        "problem_agreement": float((part == ref_part).all(1).mean()),
        "token_agreement": float((part == ref_part).mean()),
        "max_abs_alpha_err": float(np.abs(sol.alpha.double().numpy() - ref_alpha).max()),
        "max_abs_alpha_err_ridge0": float(np.abs(alpha0.double().numpy() - ref_alpha).max()),
        "polish_steps": sol.polish_steps, "fallbacks": sol.fallbacks, "status_counts": sol.counts,
        "solve_s": elapsed, "reference": sorted({r.method for r in refs}),
        "reference_max_kkt": float(max(r.kkt_residual for r in refs)),
    }
    if baseline_iters > 0:
        base = solve_batched(K32, mask, C, fista_iters=baseline_iters, polish_steps=0, ridge=0.0)
        bpart = (base.margin.int() + 2 * base.error.int()).numpy()
        row["baseline_fista_only"] = {
            "iters": baseline_iters,
            "problem_agreement": float((bpart == ref_part).all(1).mean()),
            "token_agreement": float((bpart == ref_part).mean()),
        }
    del torch
    return row


def throughput(Gs: list[int], ns: list[int], backends: list[str], repeats: int, max_gram_mb: float,
               seed: int) -> list[dict[str, Any]]:
    """problems/s per (backend, G, n), backends interleaved per cell."""
    import torch
    from tqdm import tqdm

    from sv_attention.svdd.batched import solve_batched

    rows = []
    cells = [(n, G) for n in ns for G in Gs]
    for n, G in tqdm(cells, desc="throughput", leave=False):
        mb = G * n * n * 4 / 2**20
        if mb > max_gram_mb:
            rows.append({"n": n, "G": G, "skipped": f"fp32 Gram {mb:.0f} MB > --max-gram-mb {max_gram_mb:.0f}"})
            continue
        _, K = _problems("gaussian", G, n, 16, seed)
        K = K.float()
        mask = torch.ones(G, n, dtype=torch.bool)
        C = 1.0 / (0.3 * n)
        times: dict[str, list[float]] = {b: [] for b in backends}
        for b in backends:  # warm-up (MLX import, allocator)
            solve_batched(K[: min(G, 8)], mask[: min(G, 8)], C, backend=b)
        for _ in range(repeats):
            for b in backends:
                t0 = time.perf_counter()
                solve_batched(K, mask, C, backend=b)
                times[b].append(time.perf_counter() - t0)
        row: dict[str, Any] = {"n": n, "G": G}
        for b in backends:
            med = statistics.median(times[b])
            row[f"{b}_problems_per_s"] = G / med
            row[f"{b}_s"] = med
        rows.append(row)
    return rows


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from sv_attention.svdd.batched import mlx_available, select_backend

    kinds = [k for k in args.kinds.split(",") if k]
    cells = [(k, n, d, nu) for k in kinds for n in args.ns for d in args.ds for nu in args.nus]
    acc = []
    for i, (k, n, d, nu) in enumerate(tqdm(cells, desc="accuracy", leave=False)):
        acc.append(accuracy_cell(k, n, d, nu, args.problems, args.seed + i, args.baseline_iters))
    tot_p = sum(r["problems"] for r in acc)
    summary = {
        "problem_agreement": sum(r["problem_agreement"] * r["problems"] for r in acc) / tot_p,
        "token_agreement": sum(r["token_agreement"] * r["problems"] * r["n"] for r in acc)
        / sum(r["problems"] * r["n"] for r in acc),
        "min_cell_problem_agreement": min(r["problem_agreement"] for r in acc),
        "max_abs_alpha_err": max(r["max_abs_alpha_err"] for r in acc),
        "max_abs_alpha_err_ridge0": max(r["max_abs_alpha_err_ridge0"] for r in acc),
        "targets": {"problem_agreement": 0.95, "token_agreement": 0.995},
    }
    per_kind = {}
    for k in kinds:
        rs = [r for r in acc if r["kind"] == k]
        pk = sum(r["problems"] for r in rs)
        per_kind[k] = {"problem_agreement": sum(r["problem_agreement"] * r["problems"] for r in rs) / pk,
                       "token_agreement": sum(r["token_agreement"] * r["problems"] * r["n"] for r in rs)
                       / sum(r["problems"] * r["n"] for r in rs)}
        if args.baseline_iters > 0:
            per_kind[k]["baseline_problem_agreement"] = sum(
                r["baseline_fista_only"]["problem_agreement"] * r["problems"] for r in rs) / pk
            per_kind[k]["baseline_token_agreement"] = sum(
                r["baseline_fista_only"]["token_agreement"] * r["problems"] * r["n"] for r in rs) / sum(
                r["problems"] * r["n"] for r in rs)
    summary["per_kind"] = per_kind
    backends = [b for b in args.backends.split(",") if b and (b != "mlx" or mlx_available())]
    thr = throughput(args.throughput_gs, args.throughput_ns, backends, args.repeats, args.max_gram_mb, args.seed)
    import torch

    return {"settings": "solve_batched defaults (fp32 Gram)", "auto_backend": select_backend("auto", torch.device("cpu")),
            "summary": summary, "accuracy": acc, "throughput": thr, "backends": backends,
            "torch_threads": torch.get_num_threads()}


def run(args: argparse.Namespace) -> int:
    from sv_attention.results import write_result

    res = measure(args)
    s = res["summary"]
    print(f"{'kind':<10} {'n':>4} {'d':>3} {'nu':>4} {'problem':>8} {'token':>7} {'max|da|':>9} {'ridge0':>9} "
          f"{'FISTA-only p/t':>15}")
    for r in res["accuracy"]:
        b = r.get("baseline_fista_only")
        bs = f"{b['problem_agreement']:.2f}/{b['token_agreement']:.3f}" if b else "-"
        print(f"{r['kind']:<10} {r['n']:>4} {r['d']:>3} {r['nu']:>4} {r['problem_agreement']:>8.3f} "
              f"{r['token_agreement']:>7.4f} {r['max_abs_alpha_err']:>9.2e} {r['max_abs_alpha_err_ridge0']:>9.2e} "
              f"{bs:>15}")
    print(f"\noverall: problem agreement {s['problem_agreement']:.4f} (target >= 0.95), token agreement "
          f"{s['token_agreement']:.5f} (target >= 0.995), max |alpha - alpha_exact| {s['max_abs_alpha_err']:.2e} "
          f"(ridge 0: {s['max_abs_alpha_err_ridge0']:.2e})")
    for k, v in s["per_kind"].items():
        extra = (f"; FISTA-only: {v['baseline_problem_agreement']:.3f} / {v['baseline_token_agreement']:.4f}"
                 if "baseline_problem_agreement" in v else "")
        print(f"  {k}: problem {v['problem_agreement']:.3f}, token {v['token_agreement']:.4f}{extra}")
    print(f"\nthroughput (problems/s; auto backend here = {res['auto_backend']})")
    for r in res["throughput"]:
        if "skipped" in r:
            print(f"  n={r['n']:>4} G={r['G']:>5}: skipped ({r['skipped']})")
            continue
        cols = "  ".join(f"{b} {r[f'{b}_problems_per_s']:>9.1f}" for b in res["backends"])
        print(f"  n={r['n']:>4} G={r['G']:>5}: {cols}")
    path = write_result("bench_gate", res, args.json)
    print(f"\nwrote {path}")
    return 0
