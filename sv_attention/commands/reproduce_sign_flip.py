"""``sv-attention reproduce sign-flip``: content-conditional sign flips of d out_i / d v_j.

For sgate, signed and softmax at s in {8, 16, 32, 64, 128}: the rate at which redrawing a third token's
content flips the sign of ``d out_i / d v_j`` (protocol in :mod:`sv_attention.experiments.sign_flip`), with
Wilson 95% intervals, the median ``|d out_i / d v_j|`` (to see whether the gradient floors at 0), and a
weighted power-law fit ``rate ~ a s^-b`` per operator. Writes ``results/sign_flip.json`` and a figure
``results/sign_flip.png``.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

COMMAND = "reproduce sign-flip"
HELP = "sign-flip rate of d out_i/d v_j as a third token varies (sgate, signed, softmax) with 95% intervals"

PUBLISHED = {"sgate": {"8": 0.1816, "128": 0.0127}, "softmax": "exactly 0 at every s",
             "note": "published protocol details (content distribution, logit scale) are not known here"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seqs", type=int, nargs="+", default=[8, 16, 32, 64, 128],
                        help="sequence lengths (default 8 16 32 64 128)")
    parser.add_argument("--operators", nargs="+", default=["sgate", "signed", "softmax"],
                        choices=["sgate", "signed", "softmax"], help="operators (default all three)")
    parser.add_argument("--trials", type=int, default=1500, help="trials per cell (default 1500)")
    parser.add_argument("--dim", type=int, default=16, help="head dimension (default 16)")
    parser.add_argument("--qk-std", type=float, nargs="+", default=[1.0, 2.0],
                        help="std of q/k entries, one table each (default 1.0 2.0; logit std = qk_std^2)")
    parser.add_argument("--form", choices=["path_sum", "hybrid"], default="path_sum",
                        help="ceq form whose d out/d v is tested (default path_sum)")
    parser.add_argument("--alpha", type=float, default=1.0, help="hybrid hop weight (default 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--json", type=str, default=None, help="output path (default results/sign_flip.json)")
    parser.add_argument("--figure", type=str, default=None,
                        help="figure path (default: the JSON path with .png)")


def _figure(cells: list[dict], fits: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stds = sorted({c["qk_std"] for c in cells})
    fig, axes = plt.subplots(1, len(stds), figsize=(5 * len(stds), 4), squeeze=False)
    for ax, std in zip(axes[0], stds, strict=True):
        for op in sorted({c["operator"] for c in cells}):
            sub = [c for c in cells if c["operator"] == op and c["qk_std"] == std]
            ss = [c["s"] for c in sub]
            rates = [c["rate"] for c in sub]
            err = [[max(c["rate"] - c["ci_low"], 0.0) for c in sub], [max(c["ci_high"] - c["rate"], 0.0) for c in sub]]
            ax.errorbar(ss, rates, yerr=err, marker="o", capsize=3, label=op)
            fit = fits.get(f"{op}@{std}", {})
            if fit.get("b") is not None:
                ax.plot(ss, [fit["a"] * s ** -fit["b"] for s in ss], "--", alpha=0.6,
                        label=f"{op} fit s^-{fit['b']:.2f}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length s")
        ax.set_ylabel("sign-flip rate (Wilson 95%)")
        ax.set_title(f"q/k std {std}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from sv_attention.experiments.sign_flip import fit_power_decay, sign_flip_rate
    from sv_attention.results import results_dir, write_result

    cells = []
    jobs = [(std, op, s) for std in args.qk_std for op in args.operators for s in args.seqs]
    for std, op, s in tqdm(jobs, desc="sign-flip", disable=len(jobs) < 4):
        r = sign_flip_rate(op, s, args.trials, dim=args.dim, seed=args.seed, form=args.form, alpha=args.alpha,
                           qk_std=std)
        cells.append({**asdict(r), "qk_std": std})
    fits = {}
    for std in args.qk_std:
        for op in args.operators:
            sub = [c for c in cells if c["operator"] == op and c["qk_std"] == std]
            fits[f"{op}@{std}"] = fit_power_decay([c["s"] for c in sub], [c["rate"] for c in sub],
                                                  [c["trials"] for c in sub])
    for std in args.qk_std:
        print(f"q/k std {std} (logit std ~ {std ** 2:g}), {args.trials} trials per cell, form {args.form}")
        print(f"{'operator':<9}" + "".join(f"{'s=' + str(s):>24}" for s in args.seqs))
        for op in args.operators:
            row = [c for c in cells if c["operator"] == op and c["qk_std"] == std]
            print(f"{op:<9}" + "".join(f"{c['rate']:>8.4f} [{c['ci_low']:.4f},{c['ci_high']:.4f}]" for c in row))
            fit = fits[f"{op}@{std}"]
            if fit["b"] is not None:
                print(f"{'':<9}fit rate ~ {fit['a']:.3g} s^-{fit['b']:.2f} (95% CI of b: "
                      f"{fit['b_ci95'][0]:.2f}..{fit['b_ci95'][1]:.2f}, {fit['n_points']} points)")
            else:
                print(f"{'':<9}no decay fit ({fit['n_points']} cells with 0 < rate < 1)")
    out = Path(args.json) if args.json else results_dir() / "sign_flip.json"
    fig_path = Path(args.figure) if args.figure else out.with_suffix(".png")
    fig_path.parent.mkdir(parents=True, exist_ok=True)
    _figure(cells, fits, fig_path)
    payload = {
        "config": {"seqs": args.seqs, "operators": args.operators, "trials": args.trials, "dim": args.dim,
                   "qk_std": args.qk_std, "form": args.form, "alpha": args.alpha, "seed": args.seed},
        "protocol": "q,k ~ N(0, qk_std^2 I); i = s-1; j ~ U[0,i); c ~ U[0,i) without j; redraw (q_c, k_c) "
                    "once; flip = sign of d out_i/d v_j changes (zeros never count)",
        "cells": cells, "fits": fits, "published": PUBLISHED, "figure": str(fig_path),
    }
    path = write_result("sign_flip", payload, out)
    print(f"wrote {path} and {fig_path}")
    return 0
