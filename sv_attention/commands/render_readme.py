"""``sv-attention render-readme``: write README.md from ``docs/readme/*.md`` and ``results/*.json``.

``--check`` writes nothing: it exits 1 when README.md differs from a fresh render (printing the start of
the diff) and lists every placeholder that could not be filled (missing result file or path, missing
section). ``--strict`` also fails on such unfilled values.
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

COMMAND = "render-readme"
HELP = "render README.md from docs/readme/*.md with every number read from results/*.json (--check: compare)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 when README.md differs from what would be rendered")
    parser.add_argument("--strict", action="store_true",
                        help="also exit 1 when a placeholder could not be filled or a section is missing")
    parser.add_argument("--output", default=None, help="README path (default: README.md at the repository root)")
    parser.add_argument("--results", default=None, help="result directory (default: results/ at the root)")
    parser.add_argument("--sections", default=None, help="template directory (default: docs/readme/)")


def run(args: argparse.Namespace) -> int:
    from sv_attention.readme import check_readme
    from sv_attention.results import repo_root

    out = Path(args.output) if args.output else repo_root() / "README.md"
    same, rendered, current = check_readme(out, results_dir=args.results, sections_dir=args.sections)
    for issue in rendered.issues:
        print(f"unfilled: {issue}")
    status = 0
    if args.check:
        if same:
            print(f"{out}: up to date ({len(rendered.text.splitlines())} lines, {len(rendered.issues)} unfilled)")
        else:
            diff = list(difflib.unified_diff(current.splitlines(), rendered.text.splitlines(),
                                             fromfile=str(out), tofile="rendered", lineterm="", n=1))
            print("\n".join(diff[:60]))
            if len(diff) > 60:
                print(f"... ({len(diff) - 60} more diff lines)")
            print(f"{out} differs from the render: run `sv-attention render-readme`")
            status = 1
    else:
        if not same:
            out.write_text(rendered.text)
        print(f"wrote {out} ({len(rendered.text.splitlines())} lines, {len(rendered.issues)} unfilled)"
              if not same else f"{out}: already up to date")
    if args.strict and rendered.issues:
        status = 1
    return status
