#!/usr/bin/env python
"""Train the same short run on this checkout and on an earlier commit and compare the loss curves step by step.

Usage::

    python scripts/compare_loss_curve.py BASE_REV [--steps 100] [--operator sv] [--preset tiny] [--seed 0]

Both trees run ``sv-attention train --preset P --operator OP --steps N --seed S --log-every 1`` (CPU, no
evaluation, no checkpoints between), the earlier one from a temporary git worktree (``PYTHONPATH`` selects
the tree). Every logged training loss is compared; ``results/compare_loss_curve.json`` records both curves,
the largest and median absolute difference and the step of the largest. A change that keeps every gate the
exact optimum of its partition leaves the curve equal to float32 rounding (a few 1e-6 nats per byte).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_with_commit import ROOT, rev, worktree  # noqa: E402  (the same worktree handling)


def train_losses(tree: Path, run_dir: Path, a: argparse.Namespace) -> list[float]:
    """The per-step training losses of one run in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "sv_attention.cli", "train", "--preset", a.preset, "--operator", a.operator,
           "--steps", str(a.steps), "--seed", str(a.seed), "--log-every", "1", "--eval-every", str(10 * a.steps),
           "--save-every", str(10 * a.steps), "--run-dir", str(run_dir), "--cpu", "--no-progress"]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]
    return [float(e["loss"]) for e in events if e.get("event") == "train"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", help="the earlier commit (any git revision)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--operator", default="sv")
    p.add_argument("--preset", default="tiny", choices=("tiny", "paper"))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    sha, head = rev(a.base), rev("HEAD")
    with tempfile.TemporaryDirectory() as tmp, worktree(sha, tmp) as base:
        curves = {"base": train_losses(base, Path(tmp) / "run_base", a),
                  "head": train_losses(ROOT, Path(tmp) / "run_head", a)}
    if len(curves["base"]) != len(curves["head"]) or not curves["head"]:
        raise SystemExit(f"the runs logged {len(curves['base'])} and {len(curves['head'])} losses")
    diff = [abs(x - y) for x, y in zip(curves["base"], curves["head"])]
    worst = max(range(len(diff)), key=diff.__getitem__)
    payload = {"name": "compare_loss_curve", "base_commit": sha, "head_commit": head,
               "run": {"preset": a.preset, "operator": a.operator, "steps": a.steps, "seed": a.seed},
               "max_abs_diff": diff[worst], "step_of_max": worst + 1, "median_abs_diff": statistics.median(diff),
               "steps_identical": sum(d == 0.0 for d in diff),
               "final_loss": {"base": curves["base"][-1], "head": curves["head"][-1]}, "curves": curves}
    out = ROOT / "results" / "compare_loss_curve.json"
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"{a.steps} steps, {a.operator} ({a.preset}): largest |loss difference| {diff[worst]:.3g} at step "
          f"{worst + 1}, median {payload['median_abs_diff']:.3g}, {payload['steps_identical']} steps identical; "
          f"final {curves['base'][-1]:.6f} (base) vs {curves['head'][-1]:.6f} (head)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
