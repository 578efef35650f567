"""Write experiment / benchmark results as JSON under ``results/`` with provenance.

Every number in README.md and MODEL_CARD.md comes from a file written by :func:`write_result`.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS_DIR_ENV = "SV_ATTENTION_RESULTS_DIR"


def repo_root() -> Path:
    """The repository root (parent of the ``sv_attention`` package)."""
    return Path(__file__).resolve().parent.parent


def results_dir() -> Path:
    """Directory results go to: ``$SV_ATTENTION_RESULTS_DIR`` or ``<repo>/results``."""
    env = os.environ.get(RESULTS_DIR_ENV)
    return Path(env) if env else repo_root() / "results"


def git_commit() -> str | None:
    """The current git commit of the repository, or None outside a checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo_root(), capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(command: str | None = None) -> dict[str, Any]:
    """Versions, machine and command that produced a result."""
    import torch

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        tf_version = None
    from sv_attention import __version__

    return {
        "command": command if command is not None else " ".join(["sv-attention", *sys.argv[1:]]),
        "git_commit": git_commit(),
        "sv_attention": __version__,
        "torch": torch.__version__,
        "transformers": tf_version,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _clean(obj: Any) -> Any:
    """Make an object JSON-serialisable; non-finite floats become strings (never silently dropped)."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes)):
        return _clean(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_result(name: str, payload: dict[str, Any], path: str | os.PathLike | None = None,
                 command: str | None = None) -> Path:
    """Write ``payload`` (plus provenance under ``"provenance"``) to ``path`` or ``results/NAME.json``.

    Returns the path written.
    """
    out = Path(path) if path is not None else results_dir() / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"name": name, **_clean(payload), "provenance": provenance(command)}
    out.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return out
