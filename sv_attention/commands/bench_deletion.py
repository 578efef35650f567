"""``sv-attention bench deletion``: exact deletion (decrement) vs from-scratch refit, timed side by side.

Setting (the paper's): d = 6, keys ``1.5 * N(0, 1)``, nu = 0.4, sigma = 2, ``C = 1/(nu * n)`` fixed at the
size n, a uniformly chosen victim per trial. Per size: the median wall time of one exact deletion
(``IncrementalSVDD.remove``), the median wall time of a from-scratch ``refit`` of the retained keys (Gram
build included), their ratio (measured in the same run, trial by trial, interleaved), the same three
numbers in process CPU time (steadier on a shared machine), the time to admit the n keys one at a time,
and the worst decision-function deviation between the two (a correctness check riding along). A victim
in the reserve set costs no walk (alpha = 0); ``victim_was_reserve`` gives that fraction, and the
``*_sv`` fields repeat the medians over support-vector victims only.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import numpy as np

COMMAND = "bench deletion"
HELP = "exact SVDD deletion vs from-scratch refit (median times and ratio per size)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[120, 256, 384, 512], help="key counts n")
    parser.add_argument("--trials", type=int, default=30, help="deletions (and refits) per size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="output JSON path (default results/bench_deletion.json)")


def bench_size(n: int, trials: int, rng: np.random.Generator, progress: Any = None) -> dict[str, Any]:
    """Benchmark one size; returns medians (seconds), the ratio and the worst deviation."""
    from sv_attention.svdd import IncrementalSVDD, refit

    d, nu, sigma = 6, 0.4, 2.0
    X = 1.5 * rng.standard_normal((n, d))
    s = IncrementalSVDD.from_nu(nu=nu, n0=n, sigma=sigma)
    c0, t0 = time.process_time(), time.perf_counter()
    for k in range(n):
        s.add(X[k : k + 1])
    admit_s, admit_cpu = time.perf_counter() - t0, time.process_time() - c0
    del_t, ref_t, del_c, ref_c, devs, events, is_sv, fallbacks = [], [], [], [], [], [], [], 0
    for _ in range(trials):
        work = copy.deepcopy(s)  # a fresh state per deletion (not timed)
        victim = int(rng.integers(n))
        is_sv.append(bool(s.alpha_of([victim])[0] > 0))
        c0, t0 = time.process_time(), time.perf_counter()
        rec = work.remove([victim])
        del_t.append(time.perf_counter() - t0)
        del_c.append(time.process_time() - c0)
        keep = np.delete(np.arange(n), victim)
        c0, t0 = time.process_time(), time.perf_counter()
        ref = refit(X[keep], C=s.C, sigma=sigma, ids=keep)
        ref_t.append(time.perf_counter() - t0)
        ref_c.append(time.process_time() - c0)
        devs.append(float(np.abs(work.decision_function(X) - ref.decision_function(X)).max()))
        events.append(rec.events)
        fallbacks += int(rec.fallback)
        if progress is not None:
            progress.update(1)
    md, mr = float(np.median(del_t)), float(np.median(ref_t))
    sv = np.array(is_sv)
    sv_stats: dict[str, Any] = {"sv_victims": int(sv.sum())}
    if sv.any():  # deletions of support vectors (alpha > 0): the ones that walk
        d_sv, c_sv = float(np.median(np.array(del_t)[sv])), float(np.median(np.array(del_c)[sv]))
        sv_stats.update({
            "median_delete_sv_ms": 1e3 * d_sv, "median_delete_sv_cpu_ms": 1e3 * c_sv,
            "ratio_sv": float(np.median(np.array(ref_t)[sv])) / d_sv,
            "ratio_sv_cpu": float(np.median(np.array(ref_c)[sv])) / max(c_sv, 1e-9),
        })
    return {
        "n": n, "C": s.C, "trials": trials, "partition_sizes": s.partition.sizes,
        "median_delete_ms": 1e3 * md, "median_refit_ms": 1e3 * mr, "ratio": mr / md,
        "p90_delete_ms": 1e3 * float(np.percentile(del_t, 90)), "admit_all_s": admit_s, "admit_all_cpu_s": admit_cpu,
        "median_delete_cpu_ms": 1e3 * float(np.median(del_c)), "median_refit_cpu_ms": 1e3 * float(np.median(ref_c)),
        "ratio_cpu": float(np.median(ref_c)) / max(float(np.median(del_c)), 1e-9),
        "victim_was_reserve": float(np.mean([e == 0 for e in events])),
        "max_abs_f_deviation": float(max(devs)), "median_events": float(np.median(events)),
        "fallbacks": fallbacks, **sv_stats,
    }


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from sv_attention.errors import InvalidInputError
    from sv_attention.results import write_result

    if args.trials < 1 or any(n < 8 for n in args.sizes):
        raise InvalidInputError("--trials must be >= 1 and every size >= 8")
    rng = np.random.default_rng(args.seed)
    rows = []
    with tqdm(total=args.trials * len(args.sizes), desc="bench deletion", leave=False) as bar:
        for n in args.sizes:
            rows.append(bench_size(n, args.trials, rng, bar))
    print(f"{'n':>5} {'delete ms':>10} {'refit ms':>10} {'ratio':>8} {'cpu ratio':>10} {'admit n (s)':>12} "
          f"{'admit cpu s':>12} {'max|df|':>10}")
    for r in rows:
        print(f"{r['n']:>5} {r['median_delete_ms']:>10.3f} {r['median_refit_ms']:>10.2f} {r['ratio']:>7.0f}x "
              f"{r['ratio_cpu']:>9.0f}x {r['admit_all_s']:>12.3f} {r['admit_all_cpu_s']:>12.3f} "
              f"{r['max_abs_f_deviation']:>10.1e}")
    print("support-vector victims only (alpha > 0, the deletions that walk):")
    print(f"{'n':>5} {'victims':>8} {'delete ms':>10} {'ratio':>8} {'cpu ratio':>10}")
    for r in rows:
        if r["sv_victims"]:
            print(f"{r['n']:>5} {r['sv_victims']:>8} {r['median_delete_sv_ms']:>10.3f} {r['ratio_sv']:>7.0f}x "
                  f"{r['ratio_sv_cpu']:>9.0f}x")
    payload = {
        "setting": {"d": 6, "keys": "1.5*N(0,1)", "nu": 0.4, "sigma": 2.0, "C": "1/(nu*n)", "victim": "uniform",
                    "refit": "SMO (second-order WSS) + exact polish, Gram build included", "seed": args.seed},
        "rows": rows,
        "published_apple_m3_ultra": {"delete_ms": [0.30, 1.04], "ratio": [24, 223]},
    }
    path = write_result("bench_deletion", payload, path=args.json)
    print(f"wrote {path}")
    return 0
