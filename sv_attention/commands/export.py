"""``sv-attention export CHECKPOINT --out DIR [--push-to ORG/NAME --private]``: write the Hub artifact."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

COMMAND = "export"
HELP = "export a checkpoint as a Hub artifact: weights, code, tokenizer, model card, MANIFEST.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a save_pretrained folder (e.g. a training checkpoint)")
    parser.add_argument("--out", required=True, help="artifact folder to write (must be new or empty)")
    parser.add_argument("--training-run", default=None,
                        help="training run JSON (data, steps); default: the checkpoint's trainer_state.json")
    parser.add_argument("--results-dir", default=None,
                        help="where results/*.json for the card's tables are read (default: results/)")
    parser.add_argument("--no-results", action="store_true", help="render the card without result tables")
    parser.add_argument("--license", default="apache-2.0")
    parser.add_argument("--dataset", action="append", default=None, help="dataset id for the card (repeatable)")
    parser.add_argument("--push-to", default=None, metavar="ORG/NAME", help="publish the folder to the Hub")
    parser.add_argument("--private", action="store_true", help="create the Hub repository as private")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    parser.add_argument("--card-copy", default=None,
                        help="also write the rendered card to this path (e.g. MODEL_CARD.md)")


def command_line(args: argparse.Namespace) -> str:
    """The command as a reader would type it (rebuilt from the parsed arguments, not from sys.argv)."""
    parts = ["sv-attention", "export", args.checkpoint, "--out", args.out]
    for flag, value in (("--training-run", args.training_run), ("--results-dir", args.results_dir),
                        ("--push-to", args.push_to), ("--card-copy", args.card_copy)):
        if value:
            parts += [flag, value]
    if args.license != "apache-2.0":
        parts += ["--license", args.license]
    for d in args.dataset or []:
        parts += ["--dataset", d]
    parts += [flag for flag, on in (("--no-results", args.no_results), ("--private", args.private),
                                    ("--overwrite", args.overwrite)) if on]
    return " ".join(shlex.quote(str(p)) for p in parts)


def run(args: argparse.Namespace) -> int:
    from sv_attention.artifact.export import export_artifact
    from sv_attention.cli import read_json
    from sv_attention.errors import SVAttentionError
    from sv_attention.results import results_dir

    record = None
    if args.training_run:
        record = read_json(args.training_run, "--training-run")
    res_dir = None if args.no_results else (args.results_dir or results_dir())
    command = command_line(args)
    try:
        manifest = export_artifact(args.checkpoint, args.out, command=command, training_record=record,
                                   results_dir=res_dir, license=args.license, datasets=args.dataset,
                                   push_to=args.push_to, private=args.private, overwrite=args.overwrite)
    except SVAttentionError as exc:
        print(f"sv-attention export: error: {exc}", file=sys.stderr)
        return 2
    if args.card_copy:
        Path(args.card_copy).write_text((Path(args.out) / "README.md").read_text())
    p = manifest["parameters"]
    print(f"wrote {args.out}: {len(manifest['files'])} files, {len(manifest['tensors'])} tensors")
    print(f"parameters: total {p['total']:,}, excluding tied head {p['excluding_tied_head']:,}, "
          f"excluding embeddings {p['excluding_embeddings']:,}, operator-specific {p['operator_specific_total']:,}")
    if "push" in manifest:
        print(f"pushed: {manifest['push']}")
    return 0
