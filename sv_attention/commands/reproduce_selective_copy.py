"""``sv-attention reproduce selective-copy``: experiment 3, selective copying among near-duplicate fillers."""

from __future__ import annotations

import argparse

COMMAND = "reproduce selective-copy"
HELP = ("experiment 3: 8 informative tokens among F zero-value fillers; SV vs softmax / linear / DeltaNet "
        "(results/selective-copy.json + .png)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sv_attention.experiments._cli import add_common_arguments

    parser.add_argument("--fillers", type=int, nargs="+", default=[8, 16, 32, 64, 120],
                        help="filler counts F (default 8 16 32 64 120)")
    parser.add_argument("--trials", type=int, default=30, help="trials per F (default 30)")
    add_common_arguments(parser, "selective-copy")


def run(args: argparse.Namespace) -> int:
    from sv_attention.experiments._cli import finish
    from sv_attention.experiments.selective_copy import run_selective_copy

    payload = run_selective_copy(fillers=tuple(args.fillers), trials=args.trials, seed=args.seed,
                                 progress=not args.quiet)
    return finish("selective-copy", payload, args)
