"""``sv-attention reproduce capacity``: experiment 5, capacity of SV-Attention vs DeltaNet / linear attention."""

from __future__ import annotations

import argparse

COMMAND = "reproduce capacity"
HELP = ("experiment 5: near-orthogonal items + 20 fillers; SV vs DeltaNet vs linear attention "
        "(results/capacity.json + .png)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sv_attention.experiments._cli import add_common_arguments

    parser.add_argument("--items", type=int, nargs="+", default=[8, 16, 24, 32, 40],
                        help="distinct item counts (default 8 16 24 32 40)")
    parser.add_argument("--trials", type=int, default=30, help="trials per item count (default 30)")
    add_common_arguments(parser, "capacity")


def run(args: argparse.Namespace) -> int:
    from sv_attention.experiments._cli import finish
    from sv_attention.experiments.capacity import run_capacity

    payload = run_capacity(items=tuple(args.items), trials=args.trials, seed=args.seed, progress=not args.quiet)
    return finish("capacity", payload, args)
