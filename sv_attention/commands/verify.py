"""``sv-attention verify DIR``: recompute hashes and parameter counts, load offline, run, self-check."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COMMAND = "verify"
HELP = "verify an exported artifact: hashes, tensors, parameter counts, offline load, forward, certificate"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="the artifact folder")
    parser.add_argument("--no-load", action="store_true", help="check hashes only (never execute the code)")
    parser.add_argument("--json", default=None, help="write the report as JSON to this path")


def run(args: argparse.Namespace) -> int:
    from sv_attention.artifact.verify import verify_artifact

    report = verify_artifact(args.dir, load=not args.no_load)
    if args.json:
        Path(args.json).write_text(json.dumps({"ok": report.ok, "problems": report.problems,
                                               "checks": report.checks}, indent=2, default=str) + "\n")
    for key, value in report.checks.items():
        print(f"{key}: {value}")
    if report.ok:
        print(f"OK: {args.dir} matches its manifest")
        return 0
    for line in report.problems:
        print(f"MISMATCH: {line}", file=sys.stderr)
    print(f"FAILED: {len(report.problems)} problem(s) in {args.dir}", file=sys.stderr)
    return 1
