"""The compatibility table (README, docs/results.md): every architecture of issue 16 built tiny from its config
(and the real MiniLM), switched to each implementation; accepted ones must give cache == no-cache and
padded == alone, refused ones must be refused at switch time with the config unchanged, and ceq with
alpha = 0 must be bitwise sdpa. Writes results/compat.json (rendered by `sv-attention render-readme`)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import sv_attention
from sv_attention.errors import UnsupportedFeatureError
from sv_attention.results import results_dir, write_result

from . import tiny
from .compat_models import ARCHS

SETTINGS = {"sv_attention": {"nu": 0.5, "chunk": 4}, "ceq": {"path_weight": 0.2}}
EXPECTED_REFUSED = {"Gemma2": "softcapping", "T5": "position_bias", "Falcon": "AttentionInterface"}
GEN = torch.Generator().manual_seed(11)
IDS = torch.randint(3, 97, (2, 12), generator=GEN)
GK = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, num_beams=1)


def _reason(problem: str) -> str:
    text = problem.split(": ", 1)[-1]
    for key, short in [("softcapping", "attention-logit softcapping"), ("position_bias", "T5 position_bias"),
                       ("AttentionInterface", "no AttentionInterface in its modeling code"),
                       ("not causal", "ceq hops on non-causal layers"), ("sliding", "sliding window")]:
        if key in text:
            return short
    return text[:60]


def _close(a, b, tol=1e-5) -> bool:
    return bool((a - b).abs().max() <= tol)


def _causal_checks(m):
    with torch.no_grad():
        full = m(IDS).logits
    cache = _close(tiny.step_logits(m, IDS, 3), full)
    alone = IDS[1:, :8]
    batch = torch.cat([IDS[:1, :11], torch.cat([torch.full((1, 3), 1), alone], 1)], 0)
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    both = m.generate(batch, attention_mask=mask, pad_token_id=1, eos_token_id=None, **GK)
    one = m.generate(alone, pad_token_id=1, eos_token_id=None, **GK)
    return cache, bool(torch.equal(both[1, 11:], one[0, 8:]))


def _encoder_inputs(m):
    ids = IDS[:, :10].clone()
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    return ids, mask


def _encoder_checks(m):
    ids, mask = _encoder_inputs(m)
    with torch.no_grad():
        both = m(input_ids=ids, attention_mask=mask).last_hidden_state
        one = m(input_ids=ids[1:, :7]).last_hidden_state
    return None, _close(both[1, :7], one[0])


def _seq2seq_checks(m):
    ids, mask = _encoder_inputs(m)
    kw = dict(GK, decoder_start_token_id=2, eos_token_id=None, pad_token_id=1)
    cached = m.generate(input_ids=ids, attention_mask=mask, use_cache=True, **kw)
    plain = m.generate(input_ids=ids, attention_mask=mask, use_cache=False, **kw)
    one = m.generate(input_ids=ids[1:, :7], **kw)
    return bool(torch.equal(cached, plain)), bool(torch.equal(cached[1], one[0]))


def _speech_inputs(m):
    return torch.randn(2, m.config.num_mel_bins, 2 * m.config.max_source_positions,
                       generator=torch.Generator().manual_seed(4))


def _speech_checks(m):
    feats = _speech_inputs(m)
    kw = dict(GK, decoder_start_token_id=0, eos_token_id=None, pad_token_id=0)
    cached = m.generate(input_features=feats, use_cache=True, **kw)
    plain = m.generate(input_features=feats, use_cache=False, **kw)
    return bool(torch.equal(cached, plain)), None


def _forward(kind, m):
    """One deterministic output tensor of the model (for the alpha = 0 comparison)."""
    with torch.no_grad():
        if kind == "causal":
            return m(IDS).logits
        if kind == "encoder":
            return m(*_encoder_inputs(m)).last_hidden_state
        if kind == "seq2seq":
            return m(*_encoder_inputs(m), decoder_input_ids=IDS[:, :5]).logits
        if kind == "speech":
            return m(input_features=_speech_inputs(m), decoder_input_ids=IDS[:, :5]).logits
        pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
        if kind == "vision":
            return m(pixel_values=pixels).last_hidden_state
        out = m(input_ids=IDS[:, :8], pixel_values=pixels)
        return torch.cat([out.text_embeds, out.image_embeds], -1)


CHECKS = {"causal": _causal_checks, "encoder": _encoder_checks, "seq2seq": _seq2seq_checks,
          "speech": _speech_checks}


def _cell(value):
    return "n/a" if value is None else ("yes" if value else "NO")


def _impls(m):
    cfgs = [m.config] + [getattr(m.config, k) for k in m.config.sub_configs if getattr(m.config, k, None) is not None]
    return [c._attn_implementation for c in cfgs]


def _row(name):
    kind, build = ARCHS[name]
    m = build()
    row = {"kind": kind}
    can_switch = sv_attention.check(m, "ceq", path_weight=0.0) == []
    if can_switch:
        sv_attention.enable(m, "sdpa")
        ref = _forward(kind, m)
        sv_attention.enable(m, "ceq", path_weight=0.0)
        row["alpha0_bitwise"] = bool(torch.equal(_forward(kind, m), ref))
        sv_attention.enable(m, "sdpa")
    else:
        row["alpha0_bitwise"] = None
    for impl, kw in SETTINGS.items():
        problems = sv_attention.check(m, impl, **kw)
        if problems:
            before = _impls(m)
            with pytest.raises(UnsupportedFeatureError):
                sv_attention.enable(m, impl, **kw)
            assert _impls(m) == before
            row[impl] = {"status": "refused", "reason": _reason(problems[0]), "problems": len(problems)}
            continue
        sv_attention.enable(m, impl, **kw)
        out = _forward(kind, m)
        cache, padded = CHECKS.get(kind, lambda _m: (None, None))(m)
        row[impl] = {"status": "accepted", "finite": bool(torch.isfinite(out).all()), "cache_equal": cache,
                     "padded_equal": padded}
        sv_attention.enable(m, "sdpa")
    row["cells"] = {impl: (f"accepted (cache == no-cache: {_cell(r.get('cache_equal'))}, padded == alone: "
                           f"{_cell(r.get('padded_equal'))})" if r["status"] == "accepted" else
                           f"refused: {r['reason']}") for impl in SETTINGS for r in [row[impl]]}
    row["cells"]["alpha0"] = _cell(row["alpha0_bitwise"]) if can_switch else "refused"
    return row


def test_compatibility_table():
    rows = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ARCHS:
            rows[name] = _row(name)
    for name, row in rows.items():
        for impl in SETTINGS:
            r = row[impl]
            if r["status"] == "accepted":
                assert r["finite"], (name, impl)
                assert r["cache_equal"] is not False and r["padded_equal"] is not False, (name, impl, r)
        if row["alpha0_bitwise"] is not None:
            assert row["alpha0_bitwise"], name
        expected = next((why for key, why in EXPECTED_REFUSED.items() if name.startswith(key)), None)
        if expected is not None:
            assert row["sv_attention"]["status"] == "refused" and row["ceq"]["status"] == "refused", name
        else:
            assert row["sv_attention"]["status"] == "accepted", (name, row["sv_attention"])
            if row["kind"] == "causal":
                assert row["ceq"]["status"] == "accepted", (name, row["ceq"])
    summary = {impl: sum(r[impl]["status"] == "accepted" for r in rows.values()) for impl in SETTINGS}
    payload = {"architectures": rows, "summary": {"architectures": len(rows), **{
        f"{impl}_accepted": n for impl, n in summary.items()}, "alpha0_bitwise": sum(
        bool(r["alpha0_bitwise"]) for r in rows.values())}, "settings": SETTINGS}
    path = results_dir() / "compat.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    if {k: old.get(k) for k in payload} != json.loads(json.dumps(payload)):
        # rewritten only when a result changed (the provenance alone would make README / the card stale)
        write_result("compat", payload, command="pytest tests/hf/test_compat_table.py")
