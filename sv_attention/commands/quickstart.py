"""``sv-attention quickstart``: the main job that ``make demo`` runs.

Trains a small SV-Attention model and its softmax twin on the embedded corpus, prints both validation
bits-per-byte, exports the SV model as a Hub artifact, reloads it with ``trust_remote_code``, generates a
sample, runs certified eviction and an exact deletion with receipts, verifies the artifact and prints where
everything went. Flags make it bigger (``--steps``, ``--hidden-size``, ``--layers``, ``--block-size``, ...).
``--tour`` adds the exact solver's guarantee tour at the end.
"""

from __future__ import annotations

import argparse
import sys

COMMAND = "quickstart"
HELP = ("the main job (make demo): train SV + softmax twins, export, reload, generate, certified eviction "
        "and exact deletion with receipts, verify")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sv_attention.train.quickstart import QuickstartOptions

    d = QuickstartOptions()
    parser.add_argument("--run-dir", default=d.run_dir, help=f"output folder (default {d.run_dir})")
    parser.add_argument("--steps", type=int, default=d.steps, help=f"training steps per twin (default {d.steps})")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help=f"default {d.batch_size}")
    parser.add_argument("--hidden-size", type=int, default=d.hidden_size, help=f"default {d.hidden_size}")
    parser.add_argument("--layers", type=int, default=d.num_layers, help=f"default {d.num_layers}")
    parser.add_argument("--heads", type=int, default=d.num_heads, help=f"default {d.num_heads}")
    parser.add_argument("--block-size", type=int, default=d.block_size, help=f"context bytes (default {d.block_size})")
    parser.add_argument("--chunk", type=int, default=d.chunk, help=f"SV chunk / local window (default {d.chunk})")
    parser.add_argument("--lr", type=float, default=d.lr, help=f"default {d.lr}")
    parser.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help=f"default {d.warmup_steps}")
    parser.add_argument("--eval-every", type=int, default=d.eval_every, help=f"default {d.eval_every}")
    parser.add_argument("--eval-bytes", type=int, default=d.eval_bytes, help=f"default {d.eval_bytes}")
    parser.add_argument("--embedded-bytes", type=int, default=d.embedded_bytes,
                        help=f"embedded corpus size (default {d.embedded_bytes:,})")
    parser.add_argument("--operators", nargs="+", default=d.operators, metavar="OP",
                        help="twins to train, the first is exported (default: sv softmax; add swa for the "
                             "matched-window twin)")
    parser.add_argument("--sample-bytes", type=int, default=d.sample_bytes, help=f"default {d.sample_bytes}")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"random seed (default {d.seed})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--tour", action="store_true", help="also run the exact solver's guarantee tour")


def run(args: argparse.Namespace) -> int:
    from sv_attention.errors import SVAttentionError
    from sv_attention.train.quickstart import QuickstartOptions, run_quickstart

    opts = QuickstartOptions(
        run_dir=args.run_dir, steps=args.steps, batch_size=args.batch_size, hidden_size=args.hidden_size,
        num_layers=args.layers, num_heads=args.heads, block_size=args.block_size, chunk=args.chunk, lr=args.lr,
        warmup_steps=args.warmup_steps, eval_every=args.eval_every, eval_bytes=args.eval_bytes,
        embedded_bytes=args.embedded_bytes, seed=args.seed, operators=list(args.operators),
        sample_bytes=args.sample_bytes, progress=not args.no_progress)
    try:
        summary = run_quickstart(opts)
    except SVAttentionError as exc:
        print(f"sv-attention quickstart: error: {exc}", file=sys.stderr)
        return 2
    rc = 0 if summary["ok"] else 1
    if args.tour:
        try:
            from sv_attention.svdd.demo import run_demo
        except ImportError as exc:
            print(f"exact solver tour unavailable: {exc}", file=sys.stderr)
            return rc or 1
        rc = rc or run_demo(seed=args.seed)
    return rc
