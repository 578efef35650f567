"""Shared plumbing of the ``sv-attention reproduce NAME`` commands: flags, table print, JSON + figure."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sv_attention.results import results_dir, write_result


def add_common_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """``--seed``, ``--json PATH`` (default ``results/NAME.json``), ``--figure PATH``, ``--no-figure``."""
    parser.add_argument("--seed", type=int, default=0, help="base random seed (default 0)")
    parser.add_argument("--json", default=None, metavar="PATH", help=f"output JSON (default results/{name}.json)")
    parser.add_argument("--figure", default=None, metavar="PATH",
                        help="output PNG (default: the JSON path with .png)")
    parser.add_argument("--no-figure", action="store_true", help="do not draw the figure")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e4):
            return f"{x:.2e}"
        return f"{x:.3f}"
    if x is None:
        return "-"
    return str(x)


def print_table(payload: dict[str, Any]) -> None:
    """Print the payload's ``table`` rows: metric | published | ours."""
    rows = payload.get("table", [])
    w = max([len(r["metric"]) for r in rows] + [6])
    wp = max([len(_fmt(r["published"])) for r in rows] + [10])
    wo = max([len(_fmt(r["ours"])) for r in rows] + [10])
    print(f"{'metric':<{w}}  {'published':>{wp}}  {'ours':>{wo}}")
    for r in rows:
        print(f"{r['metric']:<{w}}  {_fmt(r['published']):>{wp}}  {_fmt(r['ours']):>{wo}}")


def finish(name: str, payload: dict[str, Any], args: argparse.Namespace) -> int:
    """Write ``payload`` to JSON (with provenance), draw the figure, print the table. Returns 0."""
    out = write_result(name, payload, args.json)
    print_table(payload)
    print(f"wrote {out}")
    if not getattr(args, "no_figure", False):
        from sv_attention.experiments.figures import draw

        fig = Path(args.figure) if args.figure else (Path(args.json).with_suffix(".png") if args.json
                                                     else results_dir() / f"{name}.png")
        draw(name, payload, fig)
        print(f"wrote {fig}")
    return 0
