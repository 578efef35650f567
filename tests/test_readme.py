"""README rendering: placeholders, formatting, loops, missing-value markers, and README.md == render."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sv_attention.cli import main
from sv_attention.errors import TemplateError
from sv_attention.readme import (
    _MISSING,
    check_readme,
    format_value,
    github_anchor,
    known_commands,
    render_readme,
    resolve,
    table_of_contents,
)

DATA = {
    "rows": [{"n": 120, "ms": 0.51305, "tag": "a"}, {"n": 512, "ms": 0.26129, "tag": "b"}],
    "fits": {"sgate@1.0": {"b": 1.3746}},
    "summary": {"decay": {"0.5": 1.5725, "0.01": 0.3786}},
    "cells": [{"op": "x", "s": 8, "std": 1.0, "rate": 0.1}, {"op": "x", "s": 8, "std": 2.0, "rate": 0.2}],
    "provenance": {"command": "sv-attention bench thing --fast"},
}


def _write(d: Path, name: str, payload: dict) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.json").write_text(json.dumps(payload))


def _tree(tmp_path: Path, sections: dict[str, str], header: str = "# T\n\nIntro.\n\n{{ toc }}\n") -> Path:
    sdir = tmp_path / "docs"
    sdir.mkdir()
    (sdir / "_header.md").write_text(header)
    for name, text in sections.items():
        (sdir / f"{name}.md").write_text(text)
    _write(tmp_path / "results", "bench_thing", DATA)
    return sdir


def test_resolve_paths_indices_selectors_and_dotted_keys():
    assert resolve(DATA, "rows.1.ms") == 0.26129
    assert resolve(DATA, "rows.-1.n") == 512
    assert resolve(DATA, "rows[n=512].tag") == "b"
    assert resolve(DATA, "rows[tag=a].n") == 120
    assert resolve(DATA, "fits[sgate@1.0].b") == 1.3746  # a key containing a dot
    assert resolve(DATA, "summary.decay.[0.01]") == 0.3786
    assert resolve(DATA, "cells[op=x,s=8,std=2].rate") == 0.2  # numbers compare numerically (2 == 2.0)
    for missing in ("rows.2.ms", "rows[n=7].ms", "nope", "rows.0.nope", "fits.sgate"):
        assert resolve(DATA, missing) is _MISSING
    with pytest.raises(TemplateError, match="matches 2 elements"):
        resolve(DATA, "cells[op=x].rate")


def test_format_value_filters():
    assert format_value(0.26129, [".2f"]) == "0.26"
    assert format_value(0.0173, ["*1000", ".1f"]) == "17.3"
    assert format_value(1609864, ["/1048576", ".2f"]) == "1.54"
    assert format_value(29.6, ["int"]) == "30"
    assert format_value(0.2258, ["recip", ".1f"]) == "4.4"
    assert format_value(0.7142857, [".0%"]) == "71%"
    assert format_value(7.99e-15, [".0e"]) == "8e-15"
    assert format_value([30, 30, 29], []) == "30 / 30 / 29"
    assert format_value([0.3, 1.04], [".2f"]) == "0.30 / 1.04"
    assert format_value([1, 2, 3], ["len"]) == "3"
    assert format_value("~1e-9", [".2f"]) == "~1e-9"  # strings are written as they are
    assert format_value("nan", [".2f"]) == "nan"  # results.py's spelling of a non-finite float
    assert format_value(True, []) == "True"
    assert format_value(0.123456789, []) == "0.1235"
    assert format_value(None, []) == "–"
    with pytest.raises(TemplateError, match="format spec"):
        format_value(1.5, ["zz"])
    with pytest.raises(TemplateError, match="mapping"):
        format_value({"a": 1}, [])


def test_render_fills_placeholders_loops_and_commands(tmp_path):
    sdir = _tree(tmp_path, {"solver": (
        "## Solver\n\nMeasured by `{{ cmd: bench_thing }}`: {{ bench_thing: rows[n=512].ms | .2f }} ms.\n\n"
        "| n | ms |\n|---|---|\n{{ for r in bench_thing: rows }}\n| {{ r.n }} | {{ r.ms | *1000 | .0f }} |\n"
        "{{ end }}\n{{ for k, v in bench_thing: summary.decay }}\n- {{ k }}: {{ v | .2f }}\n{{ end }}\n")})
    out = render_readme(root=tmp_path, sections_dir=sdir)
    text = out.text
    assert "Measured by `sv-attention bench thing --fast`: 0.26 ms." in text
    assert "| 120 | 513 |\n| 512 | 261 |\n" in text
    assert "- 0.5: 1.57\n- 0.01: 0.38\n" in text
    assert "{{" not in text and "}}" not in text
    assert [i.placeholder for i in out.issues if i.source == "solver.md"] == []
    assert render_readme(root=tmp_path, sections_dir=sdir).text == text  # deterministic


def test_loop_conditions_and_literal_escape(tmp_path):
    sdir = _tree(tmp_path, {"solver": (
        "## S\n{{ for r in bench_thing: rows if r.tag }}\n- {{ r.n }}\n{{ end }}\n"
        "{{ for r in bench_thing: cells if not r.missing }}\n- {{ r.rate }}\n{{ end }}\n"
        "{{ for r in bench_thing: rows if r.absent }}\n- never\n{{ end }}\n"
        "`{{! message.content }}`\n")})
    out = render_readme(root=tmp_path, sections_dir=sdir)
    assert "## S\n- 120\n- 512\n- 0.1\n- 0.2\n`{{ message.content }}`" in out.text
    assert "never" not in out.text
    assert not [i for i in out.issues if i.source == "solver.md"]


def test_missing_file_and_path_render_a_visible_marker_and_are_listed(tmp_path):
    sdir = _tree(tmp_path, {"solver": (
        "## Solver\n\nA {{ bench_thing: rows[n=999].ms | .2f }} B {{ bench_deletion: rows.0.ms }} "
        "C {{ nothing_here: x }}\n{{ for r in bench_deletion: rows }}\n| {{ r.n }} |\n{{ end }}\n")})
    out = render_readme(root=tmp_path, sections_dir=sdir)
    assert "A (not measured: run `sv-attention bench thing --fast`) " in out.text  # file exists, path does not
    assert "B (not measured: run `sv-attention bench deletion`) " in out.text  # command from the CLI modules
    assert "C (not measured: results/nothing_here.json is missing)" in out.text
    reasons = [i.reason for i in out.issues]
    assert "no value at 'rows[n=999].ms' in results/bench_thing.json" in reasons
    assert "results/bench_deletion.json does not exist" in reasons
    assert "results/nothing_here.json does not exist" in reasons
    assert sum("bench_deletion" in r for r in reasons) == 2  # the loop too
    # areas without a file are a visible note, never silently skipped
    assert "> **Section missing:** `docs/readme/gate.md` does not exist yet" in out.text
    assert any(i.reason == "docs/readme/gate.md does not exist" for i in out.issues)


def test_bad_templates_raise_typed_errors(tmp_path):
    _write(tmp_path / "results", "bench_thing", DATA)
    cases = (("{{ undefined_var.x }}", "neither"), ("{{ for r in bench_thing: rows }}\nx\n", "closing"),
             ("{{ end }}\n", "without a"), ("{{ bench_thing: rows.0.ms | zz }}", "format spec"),
             ("{{ bench_thing: cells[op=x].rate }}", "matches 2"))
    for k, (text, match) in enumerate(cases):
        sdir = tmp_path / f"case{k}"
        sdir.mkdir()
        (sdir / "solver.md").write_text(text)
        with pytest.raises(TemplateError, match=match):
            render_readme(root=tmp_path, sections_dir=sdir)


def test_section_order_toc_and_anchors(tmp_path):
    sdir = _tree(tmp_path, {
        "experiments": "## Experiments\n\n### Measured\n",
        "cache": "## The `cache`: evict\n\n### Measured\n\n```bash\n# not a heading\n```\n",
        "solver": "## Solver\n",
        "zzz_extra": "## Extra\n",
    })
    text = render_readme(root=tmp_path, sections_dir=sdir).text
    order = [text.index(h) for h in ("## Solver", "## The `cache`", "## Experiments", "## Extra")]
    assert order == sorted(order)
    assert "- [The cache: evict](#the-cache-evict)\n  - [Measured](#measured)\n" in text
    assert "- [Experiments](#experiments)\n  - [Measured](#measured-1)\n" in text
    assert "not a heading" not in text.split("## Solver")[0]
    assert github_anchor("Parameter count (the published 3,220,992)") == "parameter-count-the-published-3220992"
    assert github_anchor("Quick start: `make demo` (= `sv-attention quickstart`)") == \
        "quick-start-make-demo--sv-attention-quickstart"
    assert table_of_contents("## A\n## A\n").endswith("- [A](#a)\n- [A](#a-1)")


def test_summary_directive_renders_the_published_table(tmp_path):
    _write(tmp_path / "results", "secret", {"name": "secret", "table": [
        {"metric": "retrieved", "published": 0.8, "ours": 0.9916}], "provenance": {"command": "sv-attention reproduce secret"}})
    sdir = _tree(tmp_path, {"experiments": "## E\n\n{{ summary: secret edit }}\n"})
    out = render_readme(root=tmp_path, sections_dir=sdir)
    assert "| secret | retrieved | 0.8 | 0.992 | `sv-attention reproduce secret` |" in out.text
    assert "edit: (not measured: run `sv-attention reproduce edit`)" in out.text
    assert any("'edit'" in i.reason for i in out.issues)


def test_known_commands_cover_bench_and_reproduce_files():
    cmds = known_commands()
    assert cmds["bench_deletion"] == "sv-attention bench deletion"
    assert cmds["selective-copy"] == "sv-attention reproduce selective-copy"
    assert cmds["sign_flip"] == "sv-attention reproduce sign-flip"


def test_cli_check_fails_until_rendered(tmp_path, capsys):
    sdir = _tree(tmp_path, {"solver": "## Solver\n\n{{ bench_thing: rows.0.n }} keys\n"})
    readme = tmp_path / "README.md"
    args = ["render-readme", "--output", str(readme), "--sections", str(sdir), "--results", str(tmp_path / "results")]
    assert main([*args, "--check"]) == 1
    assert not readme.exists()  # --check writes nothing
    assert main(args) == 0
    assert "120 keys" in readme.read_text()
    assert main([*args, "--check"]) == 0
    assert main([*args, "--check", "--strict"]) == 1  # the gate section is missing here
    assert "unfilled: gate.md" in capsys.readouterr().out


def test_committed_readme_equals_the_render():
    same, rendered, current = check_readme()
    assert same, ("README.md is out of date with docs/readme/*.md or results/*.json: run "
                  "`sv-attention render-readme`")
    assert rendered.text.startswith("<!-- Generated by `sv-attention render-readme`")
    assert "make demo" in current and "make test" in current
