"""Locate and import the remote-code files (``configuration_sv.py``, ``modeling_sv.py``, ``tokenization_sv.py``).

They live at the repository root, not inside the package, because a Hub artifact must carry them as flat
files. They are imported as top-level modules under their own names (``sys.modules["modeling_sv"]``) so
every caller in a process sees one class object.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from sv_attention.errors import ArtifactError

#: the code files every artifact ships (remote code runs on the reader's machine: each is hashed)
CODE_FILES = ("configuration_sv.py", "modeling_sv.py", "tokenization_sv.py")


def source_dirs(extra: Path | None = None) -> list[Path]:
    """Where the code files are looked for: the repository root, then ``extra`` (e.g. a checkpoint)."""
    root = Path(__file__).resolve().parent.parent.parent
    return [root] + ([Path(extra)] if extra is not None else [])


def code_file(name: str, extra: Path | None = None) -> Path:
    """Path of one code file.

    Raises
    ------
    ArtifactError
        When it is in none of :func:`source_dirs`.
    """
    for d in source_dirs(extra):
        if (d / name).is_file():
            return d / name
    raise ArtifactError(
        f"cannot find {name} (looked in {[str(d) for d in source_dirs(extra)]}); run from a source checkout "
        "of sv-attention (pip install -e .)"
    )


def load_module(name: str, extra: Path | None = None) -> ModuleType:
    """Import ``configuration_sv`` / ``modeling_sv`` / ``tokenization_sv`` as a top-level module."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.origin:
        return importlib.import_module(name)
    path = code_file(f"{name}.py", extra)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def model_classes(extra: Path | None = None) -> tuple[type, type, type]:
    """``(SVConfig, SVForCausalLM, SVByteTokenizer)``."""
    cfg = load_module("configuration_sv", extra)
    mod = load_module("modeling_sv", extra)
    tok = load_module("tokenization_sv", extra)
    return cfg.SVConfig, mod.SVForCausalLM, tok.SVByteTokenizer
