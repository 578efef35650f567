"""Tests for sv_attention.analysis.beta_test: the beta LRT, Wald cross-check, state restoration, census."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sv_attention.analysis.beta_test import (
    BETWEEN,
    MOVED,
    PINNED,
    BetaGradientCensus,
    beta_lrt,
    lrt_report,
    verdict,
)
from sv_attention.errors import ConfigError
from sv_attention.ops.smprime import SMPrime


class TinyLM(nn.Module):
    """Byte LM with SMPrime layers; ``mix[i] = 0`` switches layer i's attention off (beta has no effect)."""

    def __init__(self, vocab=11, d=8, heads=2, layers=2, mix=(1.0, 1.0)):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.sm = nn.ModuleList(SMPrime(d, heads) for _ in range(layers))
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(d, vocab)
        self.heads, self.mix = heads, mix

    def forward(self, input_ids, labels=None, attention_mask=None):
        x = self.emb(input_ids)
        b, s, d = x.shape
        for qkv, sm, mix in zip(self.qkv, self.sm, self.mix, strict=True):
            q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in qkv(x).chunk(3, -1))
            x = x + mix * sm(x, q, k, v).transpose(1, 2).reshape(b, s, d)
        logits = self.head(self.drop(x))
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)


def _model(mix=(1.0, 1.0)):
    torch.manual_seed(0)
    m = TinyLM(mix=mix).double()
    with torch.no_grad():
        m.sm[0].beta.fill_(0.6)
        m.sm[1].beta.fill_(1.3)
        for sm in m.sm:
            sm.u_head.weight.normal_(0, 0.3)
    return m


def _batch():
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 11, (3, 12), generator=g)}


def _ll(model, batch, n):
    model.eval()
    with torch.no_grad():
        return -float(model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss) * n


def test_lambda_and_information_match_independent_evaluation():
    model, batch = _model(), _batch()
    res = beta_lrt(model, batch)
    n = 3 * 11
    assert res.n_tokens == n
    ll_f = _ll(model, batch, n)
    with torch.no_grad():
        model.sm[0].beta.fill_(1.0)
    ll_0 = _ll(model, batch, n)
    with torch.no_grad():
        model.sm[0].beta.fill_(0.6)
    assert res.layers[0].lam == pytest.approx(2 * (ll_f - ll_0), rel=1e-10)
    # observed information vs a central second difference of LL in beta_0
    h = 1e-4
    vals = []
    for dv in (-h, 0.0, h):
        with torch.no_grad():
            model.sm[0].beta.fill_(0.6 + dv)
        vals.append(_ll(model, batch, n))
    with torch.no_grad():
        model.sm[0].beta.fill_(0.6)
    fd = -(vals[0] - 2 * vals[1] + vals[2]) / h ** 2
    assert res.layers[0].info == pytest.approx(fd, rel=1e-4)
    line = res.layers[0]
    assert line.info_defined
    assert line.wald == pytest.approx(0.16 * line.info)
    assert line.resolution == pytest.approx((3.841 / line.info) ** 0.5)
    assert line.wald_agrees == ((line.wald > 3.841) == (line.lam > 3.841))
    assert res.joint.name == "joint" and len(res.joint.beta) == 2


def test_state_restored_exactly():
    model, batch = _model(), _batch()
    model.train()
    model.drop.eval()  # a mixed train/eval state must survive
    model.sm[1].beta.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [m.training for m in model.modules()]
    beta_lrt(model, batch)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert flags == [m.training for m in model.modules()]
    assert model.sm[1].beta.requires_grad is False and model.sm[0].beta.grad is None


def test_zero_information_is_undefined_not_clamped():
    model, batch = _model(mix=(1.0, 0.0)), _batch()
    res = beta_lrt(model, batch)
    layer = res.layers[1]
    assert layer.info == 0.0 and not layer.info_defined
    assert layer.wald is None and layer.resolution is None and layer.wald_agrees is None
    assert layer.lam == 0.0 and layer.verdict == PINNED
    buf = io.StringIO()
    report = lrt_report(res, stream=buf)
    assert buf.getvalue().strip() == report
    lines = report.splitlines()
    assert len(lines) == 4
    for ln in lines:
        assert "3.841" in ln and "ln n" in ln and "resolution" in ln
    lines = lines[1:]
    json.dumps(res.as_dict())
    assert "undefined" in lines[1]


def test_verdict_bands():
    assert verdict(3.0, 1000) == PINNED
    assert verdict(5.0, 1000) == BETWEEN  # ln 1000 = 6.91
    assert verdict(7.0, 1000) == MOVED
    assert verdict(5.0, 20) == MOVED  # ln 20 < 3.841: no in-between band


def test_no_smprime_raises():
    with pytest.raises(ConfigError):
        beta_lrt(nn.Linear(2, 2), _batch())


def test_census_integrates_abs_grad():
    model, batch = _model(), _batch()
    census = BetaGradientCensus()
    total = [0.0, 0.0]
    for _ in range(2):
        model.zero_grad()
        model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss.backward()
        census.update(model)
        for i in range(2):
            total[i] += abs(model.sm[i].beta.grad.item())
    assert census.steps == 2
    assert census.integral == pytest.approx(total)
    assert "sm.0" in census.report()
