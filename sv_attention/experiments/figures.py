"""Figures of the experiments, drawn from their JSON payloads (matplotlib, Agg backend).

:func:`draw` dispatches on the experiment name; every figure is a PNG.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from sv_attention.errors import InvalidInputError  # noqa: E402

_DRAWERS: dict[str, Callable[[dict[str, Any], Any], None]] = {}


def _register(name: str) -> Callable:
    def deco(fn: Callable) -> Callable:
        _DRAWERS[name] = fn
        return fn
    return deco


def draw(name: str, payload: dict[str, Any], path: str | Path) -> Path:
    """Draw experiment ``name``'s figure from its payload into ``path`` (PNG). Returns the path."""
    fn = _DRAWERS.get(name)
    if fn is None:
        raise InvalidInputError(f"no figure for experiment {name!r}; known: {sorted(_DRAWERS)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = plt.figure(figsize=(9, 3.6))
    try:
        fn(payload, fig)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def _floor(x: float, eps: float = 1e-17) -> float:
    return max(float(x), eps)


@_register("secret")
def _secret(p: dict[str, Any], fig: Any) -> None:
    s = p["summary"]
    gam = list(s["decay"])
    labels = ["before", "exact delete"] + [f"decay {g}" for g in gam]
    ret = [s["retrieval_before"], s["retrieval_after_exact"]] + [s["decay"][g]["retrieval"] for g in gam]
    dev = [None, s["max_readout_deviation_exact"]] + [s["decay"][g]["deviation_mean"] for g in gam]
    ax1, ax2 = fig.subplots(1, 2)
    ax1.bar(labels, ret, color=["gray", "tab:green"] + ["tab:orange"] * len(gam))
    ax1.set_ylabel("secret retrieved (fraction of probes)")
    ax1.set_ylim(0, 1)
    ax1.tick_params(axis="x", rotation=30)
    ax2.bar(labels[1:], [_floor(x) for x in dev[1:]], color=["tab:green"] + ["tab:orange"] * len(gam))
    ax2.set_yscale("log")
    ax2.set_ylabel("readout deviation from never-saw-it layer")
    ax2.tick_params(axis="x", rotation=30)
    fig.suptitle(f"Planted secret ({p['parameters']['trials']} trials)")


@_register("edit")
def _edit(p: dict[str, Any], fig: Any) -> None:
    s = p["summary"]
    gam = list(s["decay"])
    labels = ["exact edit"] + [f"decay {g}" for g in gam]
    ri = [s["residual_influence_exact_max"]] + [s["decay"][g]["residual_influence_mean"] for g in gam]
    old = [s["old_value_returned_exact"]] + [s["decay"][g]["old_value_returned"] for g in gam]
    new = [s["new_value_returned_exact"]] + [s["decay"][g]["new_value_returned"] for g in gam]
    ax1, ax2 = fig.subplots(1, 2)
    colors = ["tab:green"] + ["tab:orange"] * len(gam)
    ax1.bar(labels, [_floor(x) for x in ri], color=colors)
    ax1.set_yscale("log")
    ax1.set_ylabel("residual influence of old binding")
    xs = range(len(labels))
    ax2.bar([i - 0.2 for i in xs], new, width=0.4, label="new value returned", color="tab:blue")
    ax2.bar([i + 0.2 for i in xs], old, width=0.4, label="old value returned", color="tab:red")
    ax2.set_xticks(list(xs), labels)
    ax2.set_ylim(0, 1)
    ax2.legend(fontsize=8)
    if "old_value_returned_reference" in s:
        ax2.set_title(f"never-saw-old reference: new {s['new_value_returned_reference']:.2f}, "
                      f"old {s['old_value_returned_reference']:.2f}", fontsize=9)
    fig.suptitle(f"Exact editing ({p['parameters']['trials']} trials)")


@_register("memory")
def _memory(p: dict[str, Any], fig: Any) -> None:
    s = p["summary"]
    ax1, ax2 = fig.subplots(1, 2)
    labels = ["answered\nbefore", "forgotten ->\nno record", "others\nafter"]
    ax1.bar(labels, [s["facts_answered_before"], s["forgotten_returns_no_record"],
                     s["others_answered_after_forget"]], color="tab:green")
    ax1.set_ylim(0, 1.05)
    ax1.set_title("7 facts: exact forgetting")
    labels2 = ["certified", "H2O\n(same kept)", f"H2O\n(budget {p['parameters']['budget']})"]
    ax2.bar(labels2, [s["rare_fact_answered_certified"], s["rare_fact_answered_h2o"],
                      s["rare_fact_kept_h2o_nominal_budget"]], color=["tab:green", "tab:orange", "tab:red"])
    ax2.set_ylim(0, 1.05)
    ax2.set_title("rare fact among boilerplate, after eviction")
    fig.suptitle("Certified memory over MiniLM embeddings")


_STYLE = {"sv": ("SV-Attention", "tab:green"), "softmax": ("softmax", "tab:blue"),
          "linear": ("linear attention", "tab:gray"), "deltanet": ("DeltaNet", "tab:purple"),
          "sv_sigma_alt": ("SV-Attention (sigma_alt)", "lightgreen"), "gate_off": ("gate off (uniform RBF)", "tab:olive")}


def _recall_vs_x(p: dict[str, Any], fig: Any, key: str, xlabel: str, methods: tuple[str, ...], title: str) -> None:
    per = p["summary"][key]
    xs = [int(x) for x in per]
    ax1, ax2 = fig.subplots(1, 2)
    for m in methods:
        if f"{m}_recall" not in per[str(xs[0])]:
            continue
        label, color = _STYLE[m]
        ax1.plot(xs, [per[str(x)][f"{m}_recall"] for x in xs], "o-", label=label, color=color)
    ax1.set_xlabel(xlabel)
    ax1.set_ylabel("recall@1")
    ax1.set_ylim(0, 1.05)
    ax1.legend(fontsize=8)
    ax2.plot(xs, [per[str(x)]["support_mean"] for x in xs], "o-", color="tab:green")
    ax2.fill_between(xs, [per[str(x)]["support_min"] for x in xs], [per[str(x)]["support_max"] for x in xs],
                     color="tab:green", alpha=0.2)
    ax2.set_xlabel(xlabel)
    ax2.set_ylabel("SV support |S u E| (mean, min-max)")
    fig.suptitle(title)


@_register("selective-copy")
def _selective_copy(p: dict[str, Any], fig: Any) -> None:
    _recall_vs_x(p, fig, "per_fillers", "filler tokens F", ("sv", "softmax", "linear", "deltanet", "sv_sigma_alt"),
                 f"Selective copying ({p['parameters']['trials']} trials per F)")


@_register("capacity")
def _capacity(p: dict[str, Any], fig: Any) -> None:
    _recall_vs_x(p, fig, "per_items", "distinct items", ("sv", "deltanet", "linear"),
                 f"Capacity with a 20-token filler block ({p['parameters']['trials']} trials per size)")


@_register("recall")
def _recall(p: dict[str, Any], fig: Any) -> None:
    s = p["summary"]
    ax = fig.subplots(1, 1)
    methods = ("gated", "gate_off", "softmax")
    pub = p["published"]
    groups = ("pairs", "with_query_tokens")
    for gi, g in enumerate(groups):
        for mi, m in enumerate(methods):
            x = gi * 4 + mi
            ax.bar(x, s[g][m], color=["tab:green", "tab:olive", "tab:blue"][mi],
                   label=["gated (SV)", "gate off (uniform RBF)", "softmax"][mi] if gi == 0 else None)
            ax.plot([x - 0.4, x + 0.4], [pub[m], pub[m]], "k--", lw=1,
                    label="published" if gi == 0 and mi == 0 else None)
    ax.set_xticks([1, 5], ["query reads the pairs", "query tokens also keys (causal)"])
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("recall@1")
    ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Distinct-key associative recall ({p['parameters']['trials']} trials, "
                 f"{p['parameters']['n_pairs']} pairs)")


@_register("lm")
def _lm(p: dict[str, Any], fig: Any) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    ops = ("sv", "swa", "softmax")
    colors = {"sv": "tab:green", "swa": "tab:orange", "softmax": "tab:blue"}
    for r in p["trials"]:
        ax1.plot(range(3), [r["val_bpb"][o] for o in ops], "o-", color="gray", alpha=0.6)
    for i, o in enumerate(ops):
        ax1.scatter([i], [p["summary"]["val_bpb_mean"][o]], s=80, color=colors[o], zorder=3)
    ax1.set_xticks(range(3), ["SV", "SWA (matched)", "softmax"])
    ax1.set_ylabel("validation bits per byte")
    ax1.set_title("per seed (lines) and mean (dots)")
    tests = p["summary"]["paired"]
    names = list(tests)
    means = [tests[n]["mean"] for n in names]
    errs = [tests[n]["se"] or 0.0 for n in names]
    ax2.bar(range(len(names)), means, yerr=errs, color=["tab:orange", "tab:blue"][: len(names)], capsize=4)
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set_xticks(range(len(names)), [n.replace("_minus_sv", " - SV") for n in names])
    ax2.set_ylabel("paired bpb difference (> 0: SV better)")
    fig.suptitle("LM probe on the embedded corpus (NOT enwik8), CPU-sized budget")


@_register("latency")
def _latency(p: dict[str, Any], fig: Any) -> None:
    rows = p["trials"]
    ns = [r["n"] for r in rows]
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot(ns, [r["median_delete_ms"] for r in rows], "o-", color="tab:green", label="exact deletion")
    ax1.plot(ns, [r["median_refit_ms"] for r in rows], "o-", color="tab:gray", label="refit from scratch")
    ax1.set_yscale("log")
    ax1.set_xlabel("keys n")
    ax1.set_ylabel("median wall time (ms)")
    ax1.legend(fontsize=8)
    ax2.bar([str(n) for n in ns], [_floor(r["max_abs_f_deviation"]) for r in rows], color="tab:green")
    ax2.axhline(p["published"]["max_decision_deviation"], color="tab:red", ls="--", label="published max deviation")
    ax2.axhline(1e-8, color="k", ls=":", label="target 1e-8")
    ax2.set_yscale("log")
    ax2.set_xlabel("keys n")
    ax2.set_ylabel("max |f_deleted - f_refit|")
    ax2.legend(fontsize=8)
    fig.suptitle(f"Deletion latency ({p['parameters']['trials']} trials per size)")
