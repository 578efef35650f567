"""Published numbers next to the measured ones, read from ``results/*.json`` (no other layer imported).

Both README renderers (README.md, docs/results.md) and the model card read their "published vs measured"
rows from here. A result file contributes rows when

* it has a ``table`` list of ``{metric, published, ours[, note]}`` rows (every ``reproduce`` command of
  :mod:`sv_attention.experiments` writes one), or
* it has a ``published`` mapping. For the files whose measured counterpart lives at another path
  (``bench_ceq``, ``forgetting``, ``sign_flip``) an extractor in :data:`DERIVED` reads it and says why a
  missed target was missed; otherwise each numeric leaf (path ``a.b.c``) is paired with the number at the
  same path in the payload or in its ``summary`` (a mapping of numbers there is shown as ``k=v, ...``;
  ``ours`` is None when there is nothing at that path).

Every row carries the command that produced the file (its provenance) and the file it came from.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

ORDER = ("secret", "latency", "selective-copy", "recall", "capacity", "eviction", "memory", "edit", "lm",
         "forgetting", "sign_flip", "bench_ceq", "train_twins")
"""The paper's experiment order; other result files follow alphabetically."""

Row = dict[str, Any]


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _leaves(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        out = []
        for k, v in obj.items():
            out += _leaves(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return [(prefix, obj)] if _is_num(obj) else []


def _lookup(obj: Any, path: str) -> Any:
    """The number at ``path``; for a mapping of numbers there, a compact ``"k=v, ..."`` string of them."""
    for part in path.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    if _is_num(obj):
        return obj
    if isinstance(obj, dict):
        nums = [(k, v) for k, v in obj.items() if _is_num(v)]
        if nums:
            return ", ".join(f"{k}={v:.4g}" for k, v in nums[:6])
    return None


def fmt(x: Any) -> str:
    """A table cell: three significant digits (scientific below 1e-3 / from 1e4), lists joined by `` / ``."""
    if x is None:
        return "not published"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, float):
        return f"{x:.2e}" if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e4) else f"{x:.3g}"
    if isinstance(x, list):
        return " / ".join(fmt(v) for v in x)
    return str(x)


def _row(name: str, metric: str, published: Any, ours: Any, command: str, note: str = "",
         met: bool | None = None) -> Row:
    row: Row = {"experiment": name, "metric": metric, "published": published, "ours": ours,
                "command": command, "note": note}
    if met is not None:
        row["met"] = met
    return row


def _bench_ceq(data: dict[str, Any], command: str) -> list[Row]:
    pub, targets = data["published"], data.get("targets") or {}
    floor = data.get("two_sdpa_floor") or {}
    op = targets.get("op_wall_ratio_at_512") or {}
    block = (targets.get("block_wall_ratio_at_512") or {}).get("value")
    at512 = next((r for r in data.get("rows", []) if r.get("level") == "op" and r.get("seq") == 512), {})
    reason = []
    if "ceq_products" in floor:
        reason.append(f"CPU product floor: an exact ceq step needs {floor['ceq_products']} [s, s] x [s, d] "
                      f"products, SDPA {floor['sdpa_products']}")
    if _is_num(at512.get("wall_ratio_to_sdpa_x2")):
        reason.append(f"{at512['wall_ratio_to_sdpa_x2']:.2f}x of two SDPA calls")
    if _is_num(block):
        reason.append(f"{block:.2f}x at block level")
    verdict = {True: "met", False: "missed"}.get(op.get("met"), "")
    note = "; ".join(x for x in [verdict, *reason] if x)
    rows = [_row("bench_ceq", "ceq / SDPA train-step wall time, operator level, seq 512", pub.get("wall_ratio"),
                 op.get("value"), command, note, op.get("met"))]
    mem = [r["peak_memory_ratio"] for r in data.get("rows", [])
           if r.get("level") == "op" and _is_num(r.get("peak_memory_ratio"))]
    if "peak_memory_ratio_range" in pub:
        lo, hi = pub["peak_memory_ratio_range"]
        seqs = "-".join(str(s) for s in pub.get("seq_range", []))
        rows.append(_row("bench_ceq", f"ceq / SDPA peak memory, operator level, seq {seqs}", f"{lo:.3g}-{hi:.3g}",
                         f"{min(mem):.3g}-{max(mem):.3g}" if mem else None, command))
    return rows


def _forgetting(data: dict[str, Any], command: str) -> list[Row]:
    pub, reg = data["published"], data.get("regimes") or {}
    picks = (("median_learned", "learned", "median_deviation", "median"),
             ("worst_gaussian", "gaussian", "worst_deviation", "worst"),
             ("worst_redundant", "redundant", "worst_deviation", "worst"))
    rows = []
    for key, regime, field, word in picks:
        if key in pub:
            r = reg.get(regime) or {}
            done = f"{r['completed']}/{r['trials']} trials" if "completed" in r and "trials" in r else ""
            rows.append(_row("forgetting", f"exact deletion vs refit, {word} deviation, {regime} keys", pub[key],
                             r.get(field), command, done))
    return rows


def _sign_flip(data: dict[str, Any], command: str) -> list[Row]:
    pub = data["published"]
    rows = []
    for s, value in sorted((pub.get("sgate") or {}).items(), key=lambda kv: int(kv[0])):
        cells = [c for c in data.get("cells", []) if c.get("operator") == "sgate" and str(c.get("s")) == str(s)]
        cells.sort(key=lambda c: c.get("qk_std", 0))
        ours = " / ".join(f"{c['rate']:.3g} (q, k std {c.get('qk_std'):g})" for c in cells) if cells else None
        rows.append(_row("sign_flip", f"sgate sign-flip rate of d out / d v, s = {s}", value, ours, command,
                         str(pub.get("note", ""))))
    return rows


DERIVED: dict[str, Callable[[dict[str, Any], str], list[Row]]] = {
    "bench_ceq": _bench_ceq, "forgetting": _forgetting, "sign_flip": _sign_flip,
}
"""Result files whose measured counterpart of a ``published`` number sits at a different path."""


def rows_for(name: str, data: dict[str, Any]) -> list[Row]:
    """Published-vs-measured rows of one result payload (see the module docstring)."""
    command = (data.get("provenance") or {}).get("command") or f"sv-attention reproduce {name}"
    if isinstance(data.get("table"), list):
        return [_row(name, r["metric"], r.get("published"), r.get("ours"), command, r.get("note", ""))
                for r in data["table"] if isinstance(r, dict) and "metric" in r]
    pub = data.get("published")
    if not isinstance(pub, dict):
        return []
    if name in DERIVED:
        return DERIVED[name](data, command)
    out = []
    for path, val in _leaves(pub):
        ours = _lookup(data, path)
        if ours is None:
            ours = _lookup(data.get("summary", {}), path)
        out.append(_row(name, path, val, ours, command))
    return out


def experiment_table_rows(directory: str | Path | None = None) -> list[Row]:
    """Rows ``{experiment, metric, published, ours, command, note[, met]}`` from every result JSON in
    ``directory`` (default ``results/``) that carries published numbers, in the paper's experiment order.

    Unreadable files give a row with metric ``"unreadable result file"``.
    """
    from sv_attention.results import results_dir

    d = Path(directory) if directory is not None else results_dir()
    if not d.is_dir():
        return []
    rank = {n: i for i, n in enumerate(ORDER)}
    files = sorted(d.glob("*.json"), key=lambda p: (rank.get(p.stem, len(ORDER)), p.stem))
    rows: list[Row] = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as exc:
            rows.append(_row(f.stem, "unreadable result file", None, None, "", f"{type(exc).__name__}: {exc}"))
            continue
        if isinstance(data, dict):
            rows += rows_for(str(data.get("name", f.stem)), data)
    return rows


def measured(x: Any) -> str:
    """The measured cell: :func:`fmt`, or ``not measured`` for None."""
    return "not measured" if x is None else fmt(x)


def render_markdown(rows: list[Row]) -> str:
    """A markdown table of :func:`experiment_table_rows` output, one row each, the command in a column."""
    lines = ["| experiment | metric | published | this implementation | command |", "|---|---|---|---|---|"]
    for r in rows:
        note = f" ({r['note']})" if r.get("note") else ""
        cells = [r["experiment"], f"{r['metric']}{note}", fmt(r["published"]), measured(r["ours"]),
                 f"`{r['command']}`"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


HEADLINE: tuple[tuple[str, str, str], ...] = (
    ("train_twins", "validation bits-per-byte, SV-Attention",
     "validation bits/byte, SV model (published: enwik8 BPC, not comparable)"),
    ("train_twins", "validation bits-per-byte, matched-window SWA", "validation bits/byte, matched-window SWA twin"),
    ("train_twins", "validation bits-per-byte, softmax", "validation bits/byte, softmax twin"),
    ("secret", "secret retrieved after exact deletion", "planted secret retrieved after exact deletion"),
    ("secret", "max readout deviation", "readout deviation from a never-saw-it layer, exact deletion"),
    ("latency", "median exact deletion", "exact deletion time (ms), n = 120 / 256 / 384 / 512"),
    ("latency", "max decision-function deviation", "decision-function deviation of deletion from a refit"),
    ("forgetting", "exact deletion vs refit, median deviation, learned", "deletion vs refit, median deviation, learned keys"),
    ("selective-copy", "SV-Attention recall@1 (min", "selective copy, SV recall@1 (worst filler count)"),
    ("recall", "recall@1 gated (SV-Attention), pairs", "associative recall@1, SV gate"),
    ("capacity", "SV-Attention recall@1", "capacity, SV recall@1 from 8 to 40 items"),
    ("edit", "residual influence of old binding, exact edit", "residual influence of an edited binding"),
    ("sign_flip", "sgate sign-flip rate of d out / d v, s = 8", "ceq sgate gradient sign-flip rate, s = 8"),
    ("bench_ceq", "ceq / SDPA train-step wall time", "ceq / SDPA training step, operator level, seq 512"),
)
"""The results a reader sees first (README and model card): ``(experiment, metric prefix, label)``; the
label is the row's text, the numbers come from :func:`experiment_table_rows`."""


def headline_rows(directory: str | Path | None = None) -> list[Row]:
    """The :data:`HEADLINE` rows, labelled; a row the results do not hold has ``ours`` None and says which
    file to produce (never a silent blank)."""
    rows = experiment_table_rows(directory)
    out = []
    for name, prefix, label in HEADLINE:
        hits = [r for r in rows if r["experiment"] == name and str(r["metric"]).startswith(prefix)]
        row = dict(hits[0]) if hits else _row(name, prefix, None, None, "", f"results/{name}.json has no such row")
        row["label"] = label
        out.append(row)
    return out


def measured_cell(row: Row) -> str:
    """The measured cell of a headline row: the number, plus the reason when the target was missed."""
    text = measured(row["ours"])
    if row["ours"] is None and row.get("note"):
        text += f" ({row['note']})"
    if row.get("met") is False:
        text += f" ({row['note']})" if row.get("note") else " (missed)"
    return text.replace("|", "\\|")
