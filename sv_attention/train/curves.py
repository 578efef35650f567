"""Training curves of the twins: read from each run's ``log.jsonl``, stored in ``results/train_twins.json``
under ``curves``, drawn as ``results/train_twins.png`` (the figure the model card shows).

``curves[op] = {"eval": {"step": [...], "val_bpb": [...]}, "train": {"step": [...], "bpb": [...]}}``; a
resumed run logs some steps twice, and the last record of a step wins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sv_attention.errors import InvalidInputError


def read_curves(run_dir: str | Path) -> dict[str, dict[str, list[float]]]:
    """The eval and train curves of one run folder.

    Raises
    ------
    InvalidInputError
        The folder has no readable ``log.jsonl``.
    """
    log = Path(run_dir) / "log.jsonl"
    if not log.is_file():
        raise InvalidInputError(f"{log} does not exist: pass the run folder of a `sv-attention train` run")
    evals: dict[int, float] = {}
    train: dict[int, float] = {}
    for n, line in enumerate(log.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{log}:{n}: not JSON ({exc.msg})") from exc
        if ev.get("event") == "eval" and isinstance(ev.get("val_bpb"), (int, float)):
            evals[int(ev["step"])] = float(ev["val_bpb"])
        elif ev.get("event") == "train" and isinstance(ev.get("bpb"), (int, float)):
            train[int(ev["step"])] = float(ev["bpb"])
    return {"eval": {"step": sorted(evals), "val_bpb": [evals[s] for s in sorted(evals)]},
            "train": {"step": sorted(train), "bpb": [train[s] for s in sorted(train)]}}


def _resolve_run_dir(path: str, base: Path | None) -> Path:
    p = Path(path)
    if p.is_absolute() or base is None:
        return p
    for root in (Path.cwd(), base):
        if (root / p).is_dir():
            return root / p
    return base / p


def attach_curves(payload: dict[str, Any], runs_root: str | Path | None = None) -> dict[str, Any]:
    """Add ``curves`` to a twins payload from the run folders it names (``runs.<op>.run_dir``; relative
    folders are looked up from the working directory, then ``runs_root``, default the repository root).

    Raises
    ------
    InvalidInputError
        The payload names no runs, or a run folder has no log.
    """
    from sv_attention.results import repo_root

    runs = payload.get("runs")
    if not isinstance(runs, dict) or not runs:
        raise InvalidInputError("the JSON names no runs (`runs.<operator>.run_dir`); is it a twins summary "
                                "written by `sv-attention train --operators ... --json`?")
    base = Path(runs_root) if runs_root is not None else repo_root()
    payload["curves"] = {op: read_curves(_resolve_run_dir(str(r.get("run_dir")), base)) for op, r in runs.items()}
    return payload


def plot_curves(payload: dict[str, Any], out: str | Path) -> Path:
    """Draw validation bits per byte against steps for every operator (training bpb faint behind it).

    Raises
    ------
    InvalidInputError
        The payload has no curves.
    """
    curves = payload.get("curves")
    if not isinstance(curves, dict) or not curves:
        raise InvalidInputError("no training curves in the JSON: run `sv-attention plot-twins --from-logs`")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"sv": "SV", "softmax": "softmax twin", "swa": "matched-window SWA twin"}
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=110)
    for i, (op, c) in enumerate(curves.items()):
        color = f"C{i}"
        tr = c.get("train") or {}
        if tr.get("step"):
            ax.plot(tr["step"], tr["bpb"], color=color, alpha=0.25, linewidth=0.8)
        ev = c.get("eval") or {}
        if ev.get("step"):
            ax.plot(ev["step"], ev["val_bpb"], color=color, marker="o", markersize=3,
                    label=f"{names.get(op, op)} (last {ev['val_bpb'][-1]:.3f})")
    budget = payload.get("budget") or {}
    ax.set_xlabel("training step" + (f" (x {budget['batch_size']} x {budget['block_size']} bytes)"
                                      if "batch_size" in budget and "block_size" in budget else ""))
    ax.set_ylabel("bits per byte")
    ax.set_title("validation (markers) and training (faint) bits per byte")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, metadata={"Software": None})
    plt.close(fig)
    return out
