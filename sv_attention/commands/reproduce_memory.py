"""``sv-attention reproduce memory``: experiment 7, certified retrieval memory over MiniLM embeddings."""

from __future__ import annotations

import argparse

COMMAND = "reproduce memory"
HELP = "experiment 7: CertifiedMemory over MiniLM embeddings, forgetting + eviction (results/memory.json + .png)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sv_attention.experiments._cli import add_common_arguments

    parser.add_argument("--boilerplate", type=int, default=40, help="boilerplate records (<= 60, default 40)")
    parser.add_argument("--budget", type=int, default=8, help="eviction budget in records (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="stream orders per rare fact (default 3)")
    add_common_arguments(parser, "memory")


def run(args: argparse.Namespace) -> int:
    from sv_attention.experiments._cli import finish
    from sv_attention.experiments.memory_exp import run_memory

    payload = run_memory(seed=args.seed, n_boilerplate=args.boilerplate, budget=args.budget,
                         repeats=args.repeats, progress=not args.quiet)
    return finish("memory", payload, args)
