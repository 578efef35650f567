"""``sv-attention render-readme``: re-render README.md, docs/results.md and the model card from ``results/``.

Pages: :data:`sv_attention.readme.PAGES` (jinja templates in ``docs/readme/``). The card: the exported
artifact's ``README.md`` (and its copy ``MODEL_CARD.md``) from its manifest and the results, with the
results copied into the artifact and its manifest re-hashed (:func:`sv_attention.artifact.card.refresh_card`);
the card is rendered first because README.md cites the manifest's sha256.

``--check`` writes nothing: it exits 1 when any file differs from a fresh render (printing the start of
the diff). ``--strict`` also fails on values that could not be filled (missing result file or path).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

COMMAND = "render-readme"
HELP = ("re-render README.md, docs/results.md and the model card (hf_artifact/README.md, MODEL_CARD.md) "
        "from results/*.json (--check: compare only)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 when any generated file differs from what would be rendered")
    parser.add_argument("--strict", action="store_true",
                        help="also exit 1 when a value could not be filled")
    parser.add_argument("--root", default=None, help="repository root (default: this checkout)")
    parser.add_argument("--results", default=None, help="result directory (default: ROOT/results)")
    parser.add_argument("--sections", default=None, help="template directory (default: ROOT/docs/readme)")
    parser.add_argument("--artifact", default=None,
                        help="exported artifact whose card is re-rendered (default: ROOT/hf_artifact; "
                             "skipped when it has no MANIFEST.json)")
    parser.add_argument("--card-copy", default=None, help="copy of the card to keep (default: ROOT/MODEL_CARD.md)")


def _diff(path: Path, current: str, rendered: str) -> None:
    diff = list(difflib.unified_diff(current.splitlines(), rendered.splitlines(), fromfile=str(path),
                                     tofile="rendered", lineterm="", n=1))
    print("\n".join(diff[:40]))
    if len(diff) > 40:
        print(f"... ({len(diff) - 40} more diff lines)")


def run(args: argparse.Namespace) -> int:
    from sv_attention.errors import SVAttentionError
    from sv_attention.readme import ARTIFACT_DIR, check_pages
    from sv_attention.results import repo_root

    root = Path(args.root) if args.root else repo_root()
    results = Path(args.results) if args.results else root / "results"
    art = Path(args.artifact) if args.artifact else root / ARTIFACT_DIR
    copy = Path(args.card_copy) if args.card_copy else root / "MODEL_CARD.md"
    stale: list[str] = []
    try:
        if (art / "MANIFEST.json").is_file():
            from sv_attention.artifact.card import refresh_card

            changed = refresh_card(art, results, card_copy=copy, write=not args.check)
            stale += changed if args.check else []
            for c in changed if not args.check else []:
                print(f"wrote {c}")
        pages = check_pages(root, results_dir=results, sections_dir=args.sections, artifact_dir=art)
    except SVAttentionError as exc:
        print(f"sv-attention render-readme: error: {exc}", file=sys.stderr)
        return 2
    unfilled = 0
    for path, same, rendered, current in pages:
        for issue in rendered.issues:
            print(f"unfilled: {path.name}: {issue}")
        unfilled += len(rendered.issues)
        lines = len(rendered.text.splitlines())
        if same:
            print(f"{path}: up to date ({lines} lines)")
        elif args.check:
            _diff(path, current, rendered.text)
            stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(rendered.text)
            print(f"wrote {path} ({lines} lines)")
    if stale:
        print("stale: " + ", ".join(stale) + "\nrun `sv-attention render-readme`")
        return 1
    return 1 if args.strict and unfilled else 0
