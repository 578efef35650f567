"""``sv-attention reproduce recall``: experiment 4, distinct-key associative recall control."""

from __future__ import annotations

import argparse

COMMAND = "reproduce recall"
HELP = ("experiment 4: causal multi-query associative recall over 10 distinct keys; gated vs gate-off vs "
        "softmax (results/recall.json + .png)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sv_attention.experiments._cli import add_common_arguments

    parser.add_argument("--trials", type=int, default=200, help="trials (default 200)")
    parser.add_argument("--pairs", type=int, default=10, help="key-value pairs (default 10)")
    add_common_arguments(parser, "recall")


def run(args: argparse.Namespace) -> int:
    from sv_attention.experiments._cli import finish
    from sv_attention.experiments.recall import run_recall

    payload = run_recall(trials=args.trials, n_pairs=args.pairs, seed=args.seed, progress=not args.quiet)
    return finish("recall", payload, args)
