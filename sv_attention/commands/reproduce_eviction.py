"""``sv-attention reproduce eviction``: the matched-budget selection study (certified vs H2O, random, recency);
the study itself is :mod:`sv_attention.experiments.eviction`."""

from __future__ import annotations

import argparse
from pathlib import Path

COMMAND = "reproduce eviction"
HELP = "matched-budget eviction study: certified vs H2O, random, recency (rare-group recall), + streamed variant"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trials", type=int, default=60, help="number of trials (default 60)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--no-stream", action="store_true", help="skip the streamed variant")
    parser.add_argument("--json", type=str, default=None, help="output JSON (default results/eviction.json)")
    parser.add_argument("--figure", type=str, default=None,
                        help="output PNG (default: the JSON path with .png); 'none' to skip")


def run(args: argparse.Namespace) -> int:
    from sv_attention.experiments.eviction import PUBLISHED, run_eviction, write_figure
    from sv_attention.results import write_result

    payload = run_eviction(args.trials, args.seed, stream=not args.no_stream)
    print(f"matched-budget eviction study, {args.trials} trials (mean budget "
          f"{payload['batch']['mean_budget']:.1f} of 66 keys)")
    print(f"{'variant':<17} {'policy':<10} {'rare recall':>11} {'dense':>7} {'all':>7} {'published':>10}")
    for panel in ("batch", "streamed", "streamed_shuffled"):
        if panel not in payload:
            continue
        for name, v in payload[panel].items():
            if not isinstance(v, dict):
                continue
            pub = PUBLISHED.get(panel, {}).get(name)
            print(f"{panel:<17} {name:<10} {v['rare']:>11.3f} {v['dense']:>7.3f} {v['all']:>7.3f} "
                  f"{'' if pub is None else f'{pub:.3f}':>10}")
    out = write_result("eviction", payload, path=args.json)
    print(f"wrote {out}")
    if args.figure != "none":
        fig = Path(args.figure) if args.figure else out.with_suffix(".png")
        print(f"wrote {write_figure(payload, fig)}")
    return 0
