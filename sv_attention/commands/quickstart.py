"""``sv-attention quickstart``: the main job that ``make demo`` runs."""

from __future__ import annotations

import argparse

COMMAND = "quickstart"
HELP = "the main job (make demo): until training lands, a tour of the exact solver's guarantees"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def run(args: argparse.Namespace) -> int:
    from sv_attention.svdd.demo import run_demo

    return run_demo(seed=args.seed)
