"""``sv-attention reproduce latency``: experiment 2, deletion latency and exactness vs refit."""

from __future__ import annotations

import argparse

COMMAND = "reproduce latency"
HELP = ("experiment 2: exact deletion vs refit latency (as bench deletion) plus the max decision-function "
        "deviation (results/latency.json + .png)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sv_attention.experiments._cli import add_common_arguments

    parser.add_argument("--sizes", type=int, nargs="+", default=[120, 256, 384, 512], help="key counts n")
    parser.add_argument("--trials", type=int, default=30, help="deletions per size (default 30)")
    add_common_arguments(parser, "latency")


def run(args: argparse.Namespace) -> int:
    from sv_attention.errors import InvalidInputError
    from sv_attention.experiments._cli import finish
    from sv_attention.experiments.latency import run_latency

    if args.trials < 1 or any(n < 8 for n in args.sizes):
        raise InvalidInputError("--trials must be >= 1 and every size >= 8")
    payload = run_latency(sizes=tuple(args.sizes), trials=args.trials, seed=args.seed, progress=not args.quiet)
    return finish("latency", payload, args)
