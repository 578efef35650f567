"""``sv-attention reproduce forgetting``: fixed-C exact decrement vs refit-without, in four key regimes; the
study itself is :mod:`sv_attention.experiments.forgetting`."""

from __future__ import annotations

import argparse

COMMAND = "reproduce forgetting"
HELP = "fixed-C exact decrement vs refit-without in four key regimes (+ coefficient-decay baseline)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sv_attention.experiments.forgetting import REGIMES

    parser.add_argument("--trials", type=int, default=300, help="trials per regime")
    parser.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=REGIMES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="output JSON path (default results/forgetting.json)")


def run(args: argparse.Namespace) -> int:
    import warnings

    from tqdm import tqdm

    from sv_attention.errors import InvalidInputError
    from sv_attention.experiments.forgetting import run_forgetting
    from sv_attention.results import write_result

    if args.trials < 1:
        raise InvalidInputError("--trials must be >= 1")
    with tqdm(total=args.trials * len(args.regimes), desc="forgetting", leave=False) as bar, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fallbacks are counted in the summary instead
        payload = run_forgetting(list(args.regimes), args.trials, args.seed, progress=lambda: bar.update(1))
    summary = payload["regimes"]
    print(f"{'regime':<15} {'done':>8} {'median|df|':>11} {'worst|df|':>10} {'part.agree':>10} "
          f"{'decay med':>10} {'decay worst':>11} {'targets':>8}")
    for regime, r in summary.items():
        print(f"{regime:<15} {r['completed']:>4}/{r['trials']:<3} {r['median_deviation']:>11.1e} "
              f"{r['worst_deviation']:>10.1e} {r['partition_agreement']:>10.3f} {r['decay_median_deviation']:>10.1e} "
              f"{r['decay_worst_deviation']:>11.1e} {'met' if r['meets_targets'] else 'MISSED':>8}")
    path = write_result("forgetting", payload, path=args.json)
    print(f"wrote {path}")
    return 0
