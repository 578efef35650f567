"""``sv-attention verify DIR [--manifest-sha256 HASH] [--clean-env [--clean-env-dir DIR]]``: recompute hashes and
parameter counts, load offline, run, self-check (and load it again in a clean virtual environment).
Exit 0: verified (a changed card is printed as a NOTE); 1: a mismatch; 2: bad input."""

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
    parser.add_argument("--manifest-sha256", default=None, metavar="HASH",
                        help="the sha256 of MANIFEST.json published elsewhere (e.g. the repository README); "
                             "a mismatch fails before anything else is trusted")
    parser.add_argument("--clean-env", action="store_true",
                        help="also load the folder in a new virtual environment (python -m venv, no system site "
                             "packages) with only torch, transformers and safetensors installed, and compare "
                             "its logits and generations with the package path's (minutes: pip install)")
    parser.add_argument("--clean-env-dir", default=None, metavar="DIR",
                        help="create the clean environment here and reuse it on later runs (default: a "
                             "temporary folder, removed afterwards)")
    parser.add_argument("--json", default=None, help="write the report as JSON to this path")


def run(args: argparse.Namespace) -> int:
    from sv_attention.artifact.verify import verify_artifact
    from sv_attention.errors import InvalidInputError, SVAttentionError

    try:
        if args.clean_env and args.no_load:
            raise InvalidInputError("--clean-env loads the folder; it cannot be combined with --no-load")
        report = verify_artifact(args.dir, load=not args.no_load, manifest_sha256=args.manifest_sha256,
                                 clean_env=args.clean_env, clean_env_dir=args.clean_env_dir)
    except SVAttentionError as exc:
        print(f"sv-attention verify: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        try:
            Path(args.json).write_text(json.dumps({"ok": report.ok, "problems": report.problems,
                                                   "findings": report.findings, "checks": report.checks},
                                                  indent=2, default=str) + "\n")
        except OSError as exc:
            print(f"sv-attention verify: error: cannot write {args.json}: {exc.strerror}", file=sys.stderr)
            return 2
    for key, value in report.checks.items():
        print(f"{key}: {value}")
    for line in report.findings:
        print(f"NOTE: {line}")
    if report.ok:
        pinned = " and the pinned manifest hash" if report.checks.get("manifest_pinned") else ""
        print(f"OK: {args.dir} matches its manifest{pinned}")
        return 0
    for line in report.problems:
        print(f"MISMATCH: {line}", file=sys.stderr)
    print(f"FAILED: {len(report.problems)} problem(s) in {args.dir}", file=sys.stderr)
    return 1
