#!/usr/bin/env python
"""Run one ``sv-attention bench ...`` command on this checkout and on an earlier commit, alternately, and
compare a ratio it reports (both trees measured in one run, so machine load hits both alike).

Usage::

    python scripts/compare_with_commit.py BASE_REV --key ratio_sv_over_sdpa --rounds 3 -- bench step --layers 2

The earlier commit is checked out into a temporary git worktree; each round runs the command in the base
tree, then in this one (``PYTHONPATH`` selects the tree). The medians of ``--key`` (a dotted path into the
command's JSON) are printed and written to ``results/compare_<name>.json`` with every round's value.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rev(name: str) -> str:
    """The full commit id of a git revision of this repository."""
    return subprocess.run(["git", "rev-parse", name], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


@contextlib.contextmanager
def worktree(sha: str, tmp: str | Path) -> Iterator[Path]:
    """A temporary git worktree of ``sha`` under ``tmp`` (removed on exit)."""
    tree = Path(tmp) / "base"
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(tree), sha], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)


def dig(data, path: str):
    """``a.b`` walks dicts; ``rows[name=x,context=512]`` picks the one list element with those fields (a dot
    inside the brackets belongs to a value: ``rows[name=ceq_a0.05]``)."""
    for part in re.findall(r"[^.\[]+(?:\[[^\]]*\])?", path):
        if "[" in part:
            key, sel = part[:-1].split("[", 1)
            conds = dict(c.split("=", 1) for c in sel.split(","))
            data = next(e for e in data[key] if all(str(e.get(k)) == v for k, v in conds.items()))
        else:
            data = data[part]
    return data


def run_in(tree: Path, command: list[str], out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, "-m", "sv_attention.cli", *command, "--json", str(out)], cwd=tree, env=env,
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", help="the earlier commit (any git revision)")
    p.add_argument("--key", action="append", required=True, help="dotted JSON path of a ratio (repeatable)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--name", default=None, help="results/compare_NAME.json (default: the bench name)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if a.rounds < 1 or len(command) < 2:
        p.error("give --rounds >= 1 and a command such as: -- bench step --layers 2")
    sha, head = rev(a.base), rev("HEAD")
    values: dict[str, dict[str, list]] = {k: {"base": [], "head": []} for k in a.key}
    with tempfile.TemporaryDirectory() as tmp, worktree(sha, tmp) as base:
        for r in range(a.rounds):
            for label, tree in (("base", base), ("head", ROOT)):
                data = run_in(tree, command, Path(tmp) / f"{label}{r}.json")
                for k in a.key:
                    values[k][label].append(dig(data, k))
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(
                f"{k} base {values[k]['base'][-1]:.3f} head {values[k]['head'][-1]:.3f}" for k in a.key), flush=True)
    summary = {k: {"base_median": statistics.median(v["base"]), "head_median": statistics.median(v["head"]),
                   "head_over_base": statistics.median(v["head"]) / statistics.median(v["base"]), **v}
               for k, v in values.items()}
    name = a.name or command[1]
    payload = {"name": f"compare_{name}", "base_commit": sha, "head_commit": head, "command": command,
               "rounds": a.rounds, "ratios": summary}
    out = ROOT / "results" / f"compare_{name}.json"
    out.write_text(json.dumps(payload, indent=2) + "\n")
    for k, v in summary.items():
        print(f"{k}: base {v['base_median']:.3f}  head {v['head_median']:.3f}  head/base {v['head_over_base']:.3f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
