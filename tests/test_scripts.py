"""scripts/: the entry points that rebuild what is committed call every bench / reproduce command and the
published-shape training, and are valid bash."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands(group: str) -> set[str]:
    out = set()
    for f in (ROOT / "sv_attention" / "commands").glob(f"{group}_*.py"):
        m = re.search(r'^COMMAND\s*=\s*"([^"]+)"', f.read_text(), re.MULTILINE)
        out.add(m.group(1))
    return out


def test_scripts_are_valid_bash_and_executable():
    for name in ("build_artifact.sh", "reproduce_all.sh"):
        path = ROOT / "scripts" / name
        assert path.stat().st_mode & 0o111, f"{name} is not executable"
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
        assert path.read_text().startswith("#!/usr/bin/env bash\n# ")  # documented at the top


def test_reproduce_all_runs_every_bench_and_reproduce_command():
    text = (ROOT / "scripts" / "reproduce_all.sh").read_text()
    listed = set(re.findall(r'"((?:bench|reproduce) [\w-]+)"', text))
    expected = _commands("bench") | _commands("reproduce")
    assert expected and listed == expected, (expected - listed, listed - expected)
    assert text.rstrip().endswith('"$SV" render-readme')


def test_build_artifact_trains_the_published_shape_then_exports_verifies_renders():
    text = (ROOT / "scripts" / "build_artifact.sh").read_text()
    for part in ("train --preset paper --operators sv softmax swa --parallel", "--warmup-steps 100",
                 "--save-every 100", "--eval-every 100", "--resume", "plot-twins", "export", "verify hf_artifact",
                 "render-readme"):
        assert part in text, part
    order = [text.index(w) for w in ('"$SV" train', '"$SV" export', '"$SV" verify', '"$SV" render-readme')]
    assert order == sorted(order)
