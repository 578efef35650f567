"""The "published vs this implementation" table, read from ``results/*.json``.

:func:`experiment_table_rows` is what the model-card renderer calls. A result file contributes rows when

* it has a ``table`` list of ``{metric, published, ours[, note]}`` rows (every ``reproduce`` command of
  :mod:`sv_attention.experiments` writes one), or
* it has a ``published`` mapping: each numeric leaf (path ``a.b.c``) is paired with the number at the
  same path in the payload or in its ``summary`` (a mapping of numbers there is shown as ``k=v, ...``;
  ``ours`` is None when there is nothing at that path, and the row then points at the file).

Every row carries the command that produced the file (from its provenance).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sv_attention.results import results_dir

ORDER = ("secret", "latency", "selective-copy", "recall", "capacity", "eviction", "memory", "edit", "lm")
"""The paper's experiment order; other result files follow alphabetically."""


def _leaves(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        out = []
        for k, v in obj.items():
            out += _leaves(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return [(prefix, obj)]
    return []


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


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


def rows_for(name: str, data: dict[str, Any]) -> list[dict[str, Any]]:
    """Table rows of one result payload (see the module docstring)."""
    command = (data.get("provenance") or {}).get("command") or f"sv-attention reproduce {name}"
    out = []
    if isinstance(data.get("table"), list):
        for r in data["table"]:
            if isinstance(r, dict) and "metric" in r:
                out.append({"experiment": name, "metric": r["metric"], "published": r.get("published"),
                            "ours": r.get("ours"), "command": command, "note": r.get("note", "")})
        return out
    pub = data.get("published")
    if isinstance(pub, dict):
        for path, val in _leaves(pub):
            ours = _lookup(data, path)
            if ours is None:
                ours = _lookup(data.get("summary", {}), path)
            out.append({"experiment": name, "metric": path, "published": val, "ours": ours, "command": command,
                        "note": "" if ours is not None else f"see results/{name}.json"})
    return out


def experiment_table_rows(directory: str | Path | None = None) -> list[dict[str, Any]]:
    """Rows ``{experiment, metric, published, ours, command, note}`` from every result JSON in ``directory``
    (default ``results/``) that carries published numbers, in the paper's experiment order.

    Unreadable files are skipped (a row with metric ``"unreadable result file"`` says so).
    """
    d = Path(directory) if directory is not None else results_dir()
    if not d.is_dir():
        return []
    files = sorted(d.glob("*.json"))
    rank = {n: i for i, n in enumerate(ORDER)}
    files.sort(key=lambda p: (rank.get(p.stem, len(ORDER)), p.stem))
    rows: list[dict[str, Any]] = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as exc:
            rows.append({"experiment": f.stem, "metric": "unreadable result file", "published": None, "ours": None,
                         "command": "", "note": f"{type(exc).__name__}: {exc}"})
            continue
        if isinstance(data, dict):
            rows += rows_for(str(data.get("name", f.stem)), data)
    return rows


def render_markdown(rows: list[dict[str, Any]]) -> str:
    """A markdown table of :func:`experiment_table_rows` output."""

    def fmt(x: Any) -> str:
        if x is None:
            return "–"
        if isinstance(x, float):
            return f"{x:.2e}" if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e4) else f"{x:.3g}"
        if isinstance(x, list):
            return " / ".join(fmt(v) for v in x)
        return str(x)

    lines = ["| experiment | metric | published | this implementation | command |", "|---|---|---|---|---|"]
    for r in rows:
        note = f" ({r['note']})" if r.get("note") else ""
        cells = [r["experiment"], f"{r['metric']}{note}", fmt(r["published"]), fmt(r["ours"]), f"`{r['command']}`"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover - `python -m sv_attention.experiments.summary`
    print(render_markdown(experiment_table_rows()), end="")
