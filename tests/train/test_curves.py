"""Twins training curves: read from log.jsonl (resumed steps: the last record wins), stored in the twins
JSON, drawn as a PNG; the CLI gives one-line errors."""

from __future__ import annotations

import json

import pytest

from sv_attention.cli import main
from sv_attention.errors import InvalidInputError
from sv_attention.train.curves import attach_curves, plot_curves, read_curves


def _run(tmp_path, op, evals):
    d = tmp_path / "runs" / op
    d.mkdir(parents=True)
    lines = [{"event": "start", "step": 0}]
    for step, bpb in evals:
        lines += [{"event": "train", "step": step, "bpb": bpb + 0.1}, {"event": "eval", "step": step, "val_bpb": bpb}]
    (d / "log.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return d


def test_read_curves_sorts_and_keeps_the_last_record_of_a_step(tmp_path):
    d = _run(tmp_path, "sv", [(100, 3.0), (200, 2.0), (100, 2.9)])  # resumed from step 100
    c = read_curves(d)
    assert c["eval"] == {"step": [100, 200], "val_bpb": [2.9, 2.0]}
    assert c["train"]["step"] == [100, 200]
    with pytest.raises(InvalidInputError, match="log.jsonl does not exist"):
        read_curves(tmp_path / "nope")


def test_cli_stores_curves_in_the_json_and_draws_them(tmp_path, capsys):
    runs = {op: {"run_dir": f"runs/{op}"} for op in ("sv", "softmax")}
    for op in runs:
        _run(tmp_path, op, [(10, 4.0), (20, 3.0)])
    js = tmp_path / "train_twins.json"
    js.write_text(json.dumps({"runs": runs, "budget": {"batch_size": 2, "block_size": 8}}))
    assert main(["plot-twins", "--json", str(js), "--runs-root", str(tmp_path)]) == 0
    payload = json.loads(js.read_text())
    assert payload["curves"]["softmax"]["eval"]["val_bpb"] == [4.0, 3.0]
    png = js.with_suffix(".png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    png.unlink()
    for op in runs:  # the JSON alone is enough to redraw
        (tmp_path / "runs" / op / "log.jsonl").unlink()
    assert main(["plot-twins", "--json", str(js), "--out", str(png)]) == 0 and png.is_file()
    capsys.readouterr()
    assert main(["plot-twins", "--json", str(js), "--from-logs", "--runs-root", str(tmp_path)]) == 2
    assert main(["plot-twins", "--json", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(line.startswith("sv-attention plot-twins: error:")
                                          for line in err.strip().splitlines())


def test_payload_without_runs_or_curves_is_refused(tmp_path):
    with pytest.raises(InvalidInputError, match="names no runs"):
        attach_curves({})
    with pytest.raises(InvalidInputError, match="no training curves"):
        plot_curves({}, tmp_path / "x.png")
