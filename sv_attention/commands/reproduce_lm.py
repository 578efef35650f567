"""``sv-attention reproduce lm``: experiment 9, the language-model probe (SV vs matched-window SWA vs softmax)."""

from __future__ import annotations

import argparse

COMMAND = "reproduce lm"
HELP = ("experiment 9: SV vs matched-window SWA vs softmax LMs on the embedded corpus (NOT enwik8), "
        "paired over seeds (results/lm.json + .png)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sv_attention.experiments._cli import add_common_arguments

    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (default 0 1 2)")
    parser.add_argument("--steps", type=int, default=600, help="optimiser steps per run (default 600)")
    parser.add_argument("--hidden-size", type=int, default=64, help="d_model (default 64; paper 256)")
    parser.add_argument("--layers", type=int, default=2, help="layers (default 2; paper 4)")
    parser.add_argument("--heads", type=int, default=2, help="heads (default 2; paper 4)")
    parser.add_argument("--block-size", type=int, default=64, help="context length (default 64; paper 256)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    parser.add_argument("--chunk", type=int, default=16, help="SV chunk (default 16)")
    parser.add_argument("--n0", type=int, default=16, help="SV reference size n0, C = 1/(nu n0) (default 16)")
    parser.add_argument("--nu", type=float, default=0.5, help="SV nu (default 0.5)")
    parser.add_argument("--eval-bytes", type=int, default=8192, help="validation bytes (default 8192)")
    parser.add_argument("--embedded-bytes", type=int, default=1_000_000,
                        help="size of the embedded corpus (default 1000000)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for the run (default 1: the models are tiny, and two threads on "
                             "a shared 2-core machine were measured several times slower; 0: leave torch's setting)")
    parser.add_argument("--run-root", default="runs/reproduce-lm", help="where the runs go (default runs/reproduce-lm)")
    add_common_arguments(parser, "lm")


def run(args: argparse.Namespace) -> int:
    from sv_attention.experiments._cli import finish
    from sv_attention.experiments.lm_probe import run_lm

    payload = run_lm(seeds=tuple(args.seeds), steps=args.steps, hidden_size=args.hidden_size, num_layers=args.layers,
                     num_heads=args.heads, block_size=args.block_size, batch_size=args.batch_size, chunk=args.chunk,
                     nu=args.nu, n0=args.n0, lr=args.lr, eval_bytes=args.eval_bytes,
                     embedded_bytes=args.embedded_bytes, run_root=args.run_root, progress=not args.quiet,
                     threads=args.threads or None)
    return finish("lm", payload, args)
