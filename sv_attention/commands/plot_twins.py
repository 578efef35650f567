"""``sv-attention plot-twins``: draw the twins' training curves (``results/train_twins.png``, shown in the
model card) from ``results/train_twins.json``.

The JSON's ``curves`` are used when present; ``--from-logs`` (or a JSON without curves) reads them from the
runs' ``log.jsonl`` and stores them in the JSON first, so the figure can be redrawn from ``results/`` alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COMMAND = "plot-twins"
HELP = "draw the SV / softmax / SWA training curves from results/train_twins.json (or the runs' logs)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, help="twins summary (default: results/train_twins.json)")
    parser.add_argument("--out", default=None, help="figure path (default: the JSON path with .png)")
    parser.add_argument("--from-logs", action="store_true",
                        help="re-read the curves from the runs' log.jsonl and store them in the JSON")
    parser.add_argument("--runs-root", default=None,
                        help="where relative run folders of the JSON are looked up (default: repository root)")


def run(args: argparse.Namespace) -> int:
    from sv_attention.errors import SVAttentionError
    from sv_attention.results import results_dir
    from sv_attention.train.curves import attach_curves, plot_curves

    path = Path(args.json) if args.json else results_dir() / "train_twins.json"
    try:
        payload = json.loads(path.read_text())
    except OSError as exc:
        print(f"sv-attention plot-twins: error: cannot read {path}: {exc.strerror}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as exc:
        print(f"sv-attention plot-twins: error: {path} is not JSON ({exc.msg})", file=sys.stderr)
        return 2
    try:
        if args.from_logs or not payload.get("curves"):
            attach_curves(payload, args.runs_root)
            path.write_text(json.dumps(payload, indent=2) + "\n")
            print(f"stored the curves of {', '.join(payload['curves'])} in {path}")
        out = plot_curves(payload, Path(args.out) if args.out else path.with_suffix(".png"))
    except SVAttentionError as exc:
        print(f"sv-attention plot-twins: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
