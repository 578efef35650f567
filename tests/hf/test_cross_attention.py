"""Cross-attention (BART): the encoder-side gate is fitted once per generation and reused while the encoder
keys are unchanged; reuse gives exactly the tokens of refitting at every step; new encoder keys refit."""

from __future__ import annotations

import warnings

import torch

import sv_attention
from sv_attention.hf import attention as hf_attention
from sv_attention.ops.sv_gate import gate_stats

from . import tiny

SRC = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(0))
GK = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, num_beams=1)


def _generate(m, src=SRC):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return m.generate(src, **GK)


def test_cross_attention_gate_fitted_once_per_generation(monkeypatch):
    m = tiny.bart(layers=2)
    sv_attention.enable(m, "sv_attention", nu=0.5, chunk=4)
    before = gate_stats().get("cross_gate_reused", 0)
    reused = _generate(m)
    # 2 decoder layers x 7 decode steps after the first; the encoder's own layers run once and refit
    assert gate_stats().get("cross_gate_reused", 0) - before == 2 * (GK["max_new_tokens"] - 1)
    monkeypatch.setattr(hf_attention, "_reusable_gate", lambda *a, **k: None)
    assert torch.equal(_generate(m), reused)  # refitting at every step gives the same tokens


def test_new_encoder_keys_refit_the_gate():
    m = tiny.bart(layers=1)
    sv_attention.enable(m, "sv_attention", nu=0.5, chunk=4)
    _generate(m)
    other = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    before = gate_stats().get("cross_gate_reused", 0)
    fresh = tiny.bart(layers=1)
    sv_attention.enable(fresh, "sv_attention", nu=0.5, chunk=4)
    assert torch.equal(_generate(m, other), _generate(fresh, other))  # the held gate is not reused wrongly
    assert gate_stats().get("cross_gate_reused", 0) - before == 2 * (GK["max_new_tokens"] - 1)
