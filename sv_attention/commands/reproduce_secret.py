"""``sv-attention reproduce secret``: experiment 1, planted secret (exact deletion vs decay)."""

from __future__ import annotations

import argparse

COMMAND = "reproduce secret"
HELP = "experiment 1: planted secret, exact deletion vs decay (results/secret.json + .png)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sv_attention.experiments._cli import add_common_arguments

    parser.add_argument("--trials", type=int, default=30, help="trials (paper: 30; default 30)")
    parser.add_argument("--probes-per-key", type=int, default=4, help="probes near each key (default 4)")
    add_common_arguments(parser, "secret")


def run(args: argparse.Namespace) -> int:
    from sv_attention.experiments._cli import finish
    from sv_attention.experiments.secret import run_secret

    payload = run_secret(trials=args.trials, seed=args.seed, probes_per_key=args.probes_per_key,
                         progress=not args.quiet)
    return finish("secret", payload, args)
