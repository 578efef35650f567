"""Load an artifact where ``sv_attention`` is absent and compare it with the package path.

Two ways to take the package away, both running :mod:`sv_attention.artifact.probe_remote` in a child process
with ``HF_HUB_OFFLINE=1`` and a fresh ``HF_MODULES_CACHE`` (so an older cached copy of the remote code cannot
mask a failure):

- :func:`run_probe` with ``blocked``: this interpreter, with an import blocker on ``sys.meta_path``
  (a ``sitecustomize.py``) that makes importing ``sv_attention`` and the optional packages raise
  ``ImportError`` (the tests);
- :func:`verify_clean_env`: a real virtual environment (``python -m venv``, no system site packages) with
  only torch, transformers and safetensors installed (``sv-attention verify --clean-env``).

The parent runs the same :func:`~sv_attention.artifact.probe_remote.probe` on the folder loaded with the
repository's classes (:func:`package_probe`) and :func:`compare_probes` lists every difference.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sv_attention.errors import ArtifactError

#: what the blocked child cannot import: this package and the optional accelerations / training extras
BLOCKED = ("sv_attention", "mlx", "accelerate", "datasets", "matplotlib")
#: logits of the remote code and of the package path agree to this (the same code: bitwise in practice)
LOGITS_ATOL = 1e-5

_BLOCKER = '''"""Import blocker: importing {names} raises ImportError (written by sv_attention.artifact.clean_env).

A finder at the head of ``sys.meta_path`` refuses them and ``sys.modules[name] = None`` makes the import system
(and ``importlib.util.find_spec``, which transformers' availability checks use) see them as not installed.
"""
import sys

_BLOCKED = {names!r}


class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None


sys.meta_path.insert(0, _Blocker())
for _name in _BLOCKED:
    sys.modules[_name] = None
'''


def blocker_sitecustomize(names: tuple[str, ...] = BLOCKED) -> str:
    """The text of a ``sitecustomize.py`` whose import blocker makes importing ``names`` raise ImportError."""
    return _BLOCKER.format(names=tuple(names))


def probe_script() -> Path:
    """The probe script's file (it imports only the standard library, torch and transformers)."""
    return Path(__file__).resolve().parent / "probe_remote.py"


def child_env(work: Path, *, pythonpath: str | None = None) -> dict[str, str]:
    """The child's environment: offline, fresh Hugging Face caches under ``work``, no user site packages,
    and no ``PYTHONPATH`` but ``pythonpath``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(work / "hf-home"), HF_MODULES_CACHE=str(work / "hf-modules"),
               PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def run_probe(folders: list[str | Path], *, python: str | Path = sys.executable, blocked: tuple[str, ...] = (),
              timeout: float = 600) -> dict[str, Any]:
    """Run the probe on ``folders`` in a child interpreter; return its record.

    Parameters
    ----------
    folders : artifact folders (each loaded with ``trust_remote_code=True``)
    python : the interpreter (this one, or a clean virtual environment's)
    blocked : top-level packages the child cannot import (an import blocker in a ``sitecustomize.py``)
    timeout : seconds

    Raises
    ------
    ArtifactError
        The child failed (its stderr tail in the message) or timed out.
    """
    with tempfile.TemporaryDirectory(prefix="sv-probe-") as tmp:
        work = Path(tmp)
        script = work / "probe_remote.py"
        shutil.copyfile(probe_script(), script)
        pythonpath = None
        if blocked:
            site = work / "site"
            site.mkdir()
            (site / "sitecustomize.py").write_text(blocker_sitecustomize(blocked))
            pythonpath = str(site)
        out = work / "probe.json"
        cmd = [str(python), str(script), str(out), *[str(Path(f).resolve()) for f in folders]]
        try:
            res = subprocess.run(cmd, cwd=work, env=child_env(work, pythonpath=pythonpath), capture_output=True,
                                 text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise ArtifactError(f"loading the artifact in a child process took longer than {timeout:.0f} s") from exc
        if res.returncode != 0 or not out.is_file():
            raise ArtifactError(f"loading the artifact without sv_attention failed (exit {res.returncode}):\n"
                                + res.stderr[-4000:])
        return json.loads(out.read_text())


def package_probe(folder: str | Path) -> dict[str, Any]:
    """The probe on ``folder`` loaded with the repository's classes (the package path)."""
    from sv_attention.artifact.export import load_checkpoint
    from sv_attention.artifact.probe_remote import probe
    from sv_attention.artifact.remote import model_classes

    model, _ = load_checkpoint(folder)
    tok_cls = model_classes()[2]
    tok = tok_cls(model_max_length=model.config.max_position_embeddings)
    return probe(model, tok)


def compare_probes(remote: dict[str, Any], package: dict[str, Any]) -> list[str]:
    """Differences between the remote-code record and the package path's, one line each (empty: equal)."""
    problems = []
    a, b = remote["logits"], package["logits"]
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        return [f"logits shape differs: {len(a)} rows vs {len(b)}"]
    worst = max((abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)), default=0.0)
    if not math.isfinite(worst) or worst > LOGITS_ATOL:
        problems.append(f"logits differ from the package path's by {worst:.3g} (tolerance {LOGITS_ATOL:g})")
    for key in ("greedy", "sampled", "padded", "beams", "pipeline"):
        if remote.get(key) != package.get(key):
            problems.append(f"{key} generation differs: {remote.get(key)!r} vs the package path's {package.get(key)!r}")
    if "pipeline_from_path" in remote and remote["pipeline_from_path"] != package["pipeline"]:
        problems.append("pipeline('text-generation', model=folder) differs from the package path's text")
    return problems


def max_logits_difference(remote: dict[str, Any], package: dict[str, Any]) -> float:
    return max(abs(x - y) for ra, rb in zip(remote["logits"], package["logits"]) for x, y in zip(ra, rb))


def clean_requirements() -> list[str]:
    """What the clean environment installs: torch, transformers and safetensors at this environment's versions."""
    import safetensors
    import torch
    import transformers

    return [f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}",
            f"safetensors=={safetensors.__version__}"]


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def make_clean_env(venv: str | Path, *, requirements: list[str] | None = None, timeout: float = 1200) -> Path:
    """Create (or reuse) a virtual environment with only ``requirements`` installed; return its python.

    ``python -m venv`` without ``--system-site-packages``: nothing of this environment is visible there.
    An existing environment whose ``pip freeze`` already satisfies the pins is reused as it is.

    Raises
    ------
    ArtifactError
        ``venv`` or ``pip install`` failed (the tail of its output in the message).
    """
    venv = Path(venv)
    reqs = requirements or clean_requirements()
    python = _venv_python(venv)

    def run(cmd: list[str]) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)

    if python.is_file():
        frozen = run([str(python), "-m", "pip", "freeze"])
        have = {line.split("==")[0].lower(): line.split("==")[-1] for line in frozen.stdout.splitlines() if "==" in line}
        if all(have.get(r.split("==")[0]) in (r.split("==")[1], r.split("==")[1] + "+cpu") for r in reqs):
            return python
    else:
        res = run([sys.executable, "-m", "venv", str(venv)])
        if res.returncode != 0:
            raise ArtifactError(f"python -m venv {venv} failed:\n{res.stderr[-2000:]}")
    res = run([str(python), "-m", "pip", "install", "--quiet", *reqs])
    if res.returncode != 0:
        raise ArtifactError(f"pip install {' '.join(reqs)} in {venv} failed:\n{(res.stderr or res.stdout)[-3000:]}")
    return python


def verify_clean_env(folder: str | Path, *, venv: str | Path | None = None, timeout: float = 1200) -> dict[str, Any]:
    """Load ``folder`` in a clean virtual environment and compare it with the package path.

    Parameters
    ----------
    folder : the artifact folder
    venv : where the environment is created (reused when it already has the pins); default a temporary
        folder, removed afterwards

    Returns
    -------
    dict with ``ok``, ``problems`` (one line each), ``requirements``, ``versions`` (the child's),
    ``importable`` (what the child could import: ``sv_attention`` must be False), ``max_logits_difference``,
    ``backend_log``, ``empty_prompt_error`` and ``seconds`` (``setup`` and ``probe``).
    """
    tmp = None
    if venv is None:
        tmp = tempfile.mkdtemp(prefix="sv-clean-env-")
        venv = Path(tmp) / "venv"
    try:
        t0 = time.perf_counter()
        python = make_clean_env(venv, timeout=timeout)
        t1 = time.perf_counter()
        child = run_probe([folder], python=python, timeout=timeout)
        t2 = time.perf_counter()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    record = next(iter(child["folders"].values()))
    package = package_probe(folder)
    problems = compare_probes(record, package)
    if child["importable"].get("sv_attention"):
        problems.append("the clean environment can import sv_attention: it is not clean")
    if not record["classes"]["model"].startswith("transformers_modules."):
        problems.append(f"the model did not load as remote code: {record['classes']['model']}")
    return {"ok": not problems, "problems": problems, "requirements": clean_requirements(),
            "versions": child["versions"], "importable": child["importable"],
            "max_logits_difference": max_logits_difference(record, package),
            "backend_log": record.get("backend_log"), "empty_prompt_error": record.get("empty_prompt_error"),
            "seconds": {"setup": round(t1 - t0, 1), "probe": round(t2 - t1, 1)}}
