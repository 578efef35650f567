"""``sv-attention bench deletion``: exact deletion (decrement) vs from-scratch refit, timed side by side.

Setting (the paper's): d = 6, keys ``1.5 * N(0, 1)``, nu = 0.4, sigma = 2, ``C = 1/(nu * n)`` fixed at the
size n, a uniformly chosen victim per trial. Per size: the median wall time of one exact deletion
(``IncrementalSVDD.remove``), the median wall time of a from-scratch ``refit`` of the retained keys (Gram
build included), their ratio (measured in the same run, trial by trial, interleaved), the same three
numbers in process CPU time (steadier on a shared machine), the time to admit the n keys one at a time,
and the worst decision-function deviation between the two (a correctness check riding along). A victim
in the reserve set costs no walk (alpha = 0); ``victim_was_reserve`` gives that fraction, and the
``*_sv`` fields repeat the medians over support-vector victims only.

Near-duplicate regime (``near_duplicate`` in the JSON; repeated tokens make near-duplicate keys the normal
case in a KV cache): the same setting, but only n/3 keys are fresh ``1.5 * N(0, 1)`` draws and every
other key (at random stream positions) is a copy of a uniformly chosen earlier key, either exact
(``exact``) or with ``1e-3 * N(0, 1)`` jitter (``jitter_1e-3``). The refit of every trial must report
``converged`` (``refits_converged``).
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import numpy as np

from sv_attention.cli import positive_int

COMMAND = "bench deletion"
HELP = "exact SVDD deletion vs from-scratch refit (median times and ratio per size; Gaussian and near-duplicate keys)"
REGIMES = ("gaussian", "exact", "jitter_1e-3")
"""Key regimes: Gaussian keys, and the near-duplicate streams (exact copies, copies with 1e-3 jitter)."""
JITTER = {"exact": 0.0, "jitter_1e-3": 1e-3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=positive_int(8), nargs="+", default=[120, 256, 384, 512],
                        help="key counts n (each >= 8)")
    parser.add_argument("--trials", type=positive_int(1), default=30, help="deletions (and refits) per size")
    parser.add_argument("--near-duplicate-sizes", type=positive_int(8), nargs="*", default=None,
                        help="key counts of the near-duplicate regime (default: the largest of --sizes; none "
                             "to skip it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="output JSON path (default results/bench_deletion.json)")


def near_duplicate_keys(n: int, jitter: float, rng: np.random.Generator, d: int = 6) -> np.ndarray:
    """A stream of n keys ``[n, d]``: n/3 fresh ``1.5 * N(0, 1)`` keys at random positions (the first key is
    fresh), every other key a copy of a uniformly chosen earlier key plus ``jitter * N(0, 1)``."""
    fresh = np.zeros(n, dtype=bool)
    fresh[0] = True
    fresh[1 + rng.permutation(n - 1)[: max(0, n // 3 - 1)]] = True
    X = np.empty((n, d))
    for k in range(n):
        if fresh[k]:
            X[k] = 1.5 * rng.standard_normal(d)
        else:
            X[k] = X[rng.integers(k)] + (jitter * rng.standard_normal(d) if jitter else 0.0)
    return X


def bench_size(n: int, trials: int, rng: np.random.Generator, progress: Any = None,
               regime: str = "gaussian") -> dict[str, Any]:
    """Benchmark one size of one key regime (:data:`REGIMES`); returns medians (seconds), the ratio and
    the worst deviation."""
    import warnings

    from sv_attention.svdd import IncrementalSVDD, refit

    d, nu, sigma = 6, 0.4, 2.0
    X = 1.5 * rng.standard_normal((n, d)) if regime == "gaussian" else near_duplicate_keys(n, JITTER[regime], rng, d)
    s = IncrementalSVDD.from_nu(nu=nu, n0=n, sigma=sigma)
    c0, t0 = time.process_time(), time.perf_counter()
    for k in range(n):
        s.add(X[k : k + 1])
    admit_s, admit_cpu = time.perf_counter() - t0, time.process_time() - c0
    del_t, ref_t, del_c, ref_c, devs, events, is_sv, fallbacks, converged = [], [], [], [], [], [], [], 0, 0
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
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # counted below (refits_converged)
            ref = refit(X[keep], C=s.C, sigma=sigma, ids=keep)
        ref_t.append(time.perf_counter() - t0)
        ref_c.append(time.process_time() - c0)
        converged += int(ref.converged)
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
        "n": n, "regime": regime, "C": s.C, "trials": trials, "partition_sizes": s.partition.sizes,
        "median_delete_ms": 1e3 * md, "median_refit_ms": 1e3 * mr, "ratio": mr / md,
        "p90_delete_ms": 1e3 * float(np.percentile(del_t, 90)), "admit_all_s": admit_s, "admit_all_cpu_s": admit_cpu,
        "median_delete_cpu_ms": 1e3 * float(np.median(del_c)), "median_refit_cpu_ms": 1e3 * float(np.median(ref_c)),
        "ratio_cpu": float(np.median(ref_c)) / max(float(np.median(del_c)), 1e-9),
        "victim_was_reserve": float(np.mean([e == 0 for e in events])),
        "max_abs_f_deviation": float(max(devs)), "median_events": float(np.median(events)),
        "fallbacks": fallbacks, "refits_converged": converged, **sv_stats,
    }


def _print_rows(rows: list[dict[str, Any]]) -> None:
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


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from sv_attention.results import write_result

    nd_sizes = [max(args.sizes)] if args.near_duplicate_sizes is None else list(args.near_duplicate_sizes)
    rng = np.random.default_rng(args.seed)
    rows, nd_rows = [], []
    total = args.trials * (len(args.sizes) + 2 * len(nd_sizes))
    with tqdm(total=total, desc="bench deletion", leave=False) as bar:
        for n in args.sizes:
            rows.append(bench_size(n, args.trials, rng, bar))
        nd_rng = np.random.default_rng([args.seed, 1])
        for n in nd_sizes:
            for regime in REGIMES[1:]:
                nd_rows.append(bench_size(n, args.trials, nd_rng, bar, regime=regime))
    print("Gaussian keys:")
    _print_rows(rows)
    for regime in REGIMES[1:]:
        sel = [r for r in nd_rows if r["regime"] == regime]
        if sel:
            print(f"near-duplicate keys ({regime}: n/3 fresh, the rest copies of earlier keys):")
            _print_rows(sel)
    payload = {
        "setting": {"d": 6, "keys": "1.5*N(0,1)", "nu": 0.4, "sigma": 2.0, "C": "1/(nu*n)", "victim": "uniform",
                    "refit": "SMO (second-order WSS) + exact polish, Gram build included", "seed": args.seed},
        "rows": rows,
        "near_duplicate": {
            "setting": {"keys": "n/3 fresh 1.5*N(0,1) keys at random positions, every other key a copy of a "
                                "uniformly chosen earlier key (exact, or + 1e-3*N(0,1))",
                        "regimes": list(REGIMES[1:]), "seed": [args.seed, 1]},
            "rows": nd_rows,
        },
        "published_apple_m3_ultra": {"delete_ms": [0.30, 1.04], "ratio": [24, 223]},
    }
    path = write_result("bench_deletion", payload, path=args.json)
    print(f"wrote {path}")
    return 0
