"""``sv-attention reproduce edit``: experiment 8, exact editing of a fact binding vs decay."""

from __future__ import annotations

import argparse

COMMAND = "reproduce edit"
HELP = "experiment 8: exact edit (remove + add) vs decay, residual influence (results/edit.json + .png)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sv_attention.experiments._cli import add_common_arguments

    parser.add_argument("--trials", type=int, default=30, help="trials (default 30)")
    parser.add_argument("--probes-per-key", type=int, default=4, help="probes near each key (default 4)")
    add_common_arguments(parser, "edit")


def run(args: argparse.Namespace) -> int:
    from sv_attention.experiments._cli import finish
    from sv_attention.experiments.edit import run_edit

    payload = run_edit(trials=args.trials, seed=args.seed, probes_per_key=args.probes_per_key,
                       progress=not args.quiet)
    return finish("edit", payload, args)
