"""Tests for ``sv-attention bench ceq`` at its smallest setting."""

from __future__ import annotations

import json

import torch

from sv_attention.cli import main
from sv_attention.commands.bench_ceq import peak_bytes


def test_bench_ceq_smallest_setting_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "ceq", "--seqs", "16", "--heads", "2", "--head-dim", "8", "--repeats", "1",
               "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["name"] == "bench_ceq" and "provenance" in data
    rows = data["rows"]
    assert [(r["level"], r["seq"]) for r in rows] == [("op", 16), ("block", 16)]
    for r in rows:
        assert r["sdpa_peak_bytes"] > 0 and r["ceq_peak_bytes"] > 0
        assert r["wall_ratio"] == r["ceq_wall_s"] / r["sdpa_wall_s"]
        assert r["peak_memory_ratio"] == r["ceq_peak_bytes"] / r["sdpa_peak_bytes"]
    assert data["targets"] == {}  # 512 / 1024 were not run
    op, block = rows
    assert op["wall_ratio_to_sdpa_x2"] == op["ceq_wall_s"] / op["sdpa_x2_wall_s"]  # the two-attention floor
    assert block["sdpa_x2_wall_s"] is None and block["wall_ratio_to_sdpa_x2"] is None
    floor = data["two_sdpa_floor"]
    assert floor["ceq_products"] == 2 * floor["sdpa_products"]


def test_peak_bytes_counts_a_known_allocation():
    def f():
        a = torch.empty(1 << 20, dtype=torch.uint8)
        b = torch.empty(1 << 19, dtype=torch.uint8)
        del a, b

    peak = peak_bytes(f)
    assert (1 << 20) + (1 << 19) <= peak < (1 << 20) + (1 << 19) + 4096
