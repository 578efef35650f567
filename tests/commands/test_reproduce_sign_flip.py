"""Tests for ``sv-attention reproduce sign-flip`` and its helpers (smallest setting)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sv_attention.cli import main
from sv_attention.errors import InvalidHyperparameterError
from sv_attention.experiments.sign_flip import coefficient, fit_power_decay, sign_flip_rate, wilson_interval
from sv_attention.ops.ceq import ceq_matrix


def test_command_smallest_setting(tmp_path):
    out = tmp_path / "sf.json"
    rc = main(["reproduce", "sign-flip", "--seqs", "8", "12", "--trials", "300", "--qk-std", "2.0",
               "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert (tmp_path / "sf.png").stat().st_size > 0
    cells = {(c["operator"], c["s"]): c for c in data["cells"]}
    assert len(cells) == 6
    for op in ("softmax",):
        assert all(cells[(op, s)]["flips"] == 0 for s in (8, 12))  # positive weights never flip
    assert cells[("sgate", 8)]["flips"] > 0
    for c in cells.values():
        assert c["ci_low"] <= c["rate"] <= c["ci_high"]
        assert c["rate"] == c["flips"] / c["trials"]


def test_coefficient_is_path_sum_of_a():
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 1, 6, 4, dtype=torch.float64, generator=g) for _ in range(2))
    a = ceq_matrix(q, k)
    assert torch.allclose(coefficient(q, k, "sgate"), a + a @ a, atol=1e-14)
    assert (coefficient(q, k, "softmax") >= 0).all()


def test_wilson_and_fit():
    lo, hi = wilson_interval(0, 100)
    assert lo == 0.0 and 0.03 < hi < 0.04
    lo, hi = wilson_interval(50, 100)
    assert lo < 0.5 < hi
    ss = [8, 16, 32, 64]
    fit = fit_power_decay(ss, [0.2 * (s / 8) ** -1.0 for s in ss], [1000] * 4)
    assert fit["b"] == pytest.approx(1.0) and fit["a"] == pytest.approx(0.2 * 8)
    assert fit_power_decay(ss, [0.0] * 4, [10] * 4)["b"] is None
    with pytest.raises(InvalidHyperparameterError):
        sign_flip_rate("sgate", 2, 10)
    assert math.isfinite(sign_flip_rate("signed", 5, 20).median_abs_grad)
