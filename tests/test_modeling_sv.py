"""The sv_lm remote-code model: parameter counts, operators vs references, caching, generation, plumbing."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.modeling_outputs import CausalLMOutputWithPast

from configuration_sv import SVConfig
from modeling_sv import CACHE_FIELD, SVForCausalLM, SVLMCache, sv_operator_attention
from sv_attention.artifact.params import count_parameters
from sv_attention.errors import InvalidInputError, UnsupportedFeatureError
from sv_attention.ops.baselines import softmax_attention

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=48)
CACHED_OPERATORS = [
    ("softmax", {}),
    ("swa", {"window": 5}),
    ("ceq", {}),
    ("ceq", {"variant": "signed"}),
    ("ceq_path_sum", {}),
    ("smprime", {"beta_init": 0.8}),
    ("sv", {"chunk": 4, "nu": 0.5, "n0": 8}),
]
SV_KNOBS = {"chunk": 4, "nu": 0.5, "n0": 8}  # C = 1/4, warm-up 6 keys: gates at boundaries 8, 12, ...


def tiny(operator="softmax", knobs=None, seed=0, **kw):
    torch.manual_seed(seed)
    return SVForCausalLM(SVConfig(operator=operator, operator_config=knobs, **{**TINY, **kw})).eval()


def _perturb_alpha(model, value=0.7):
    """Move operator-specific parameters off their (softmax-like) initial values."""
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.attn, "ceq_alpha"):
                layer.attn.ceq_alpha.fill_(value)
            if hasattr(layer.attn, "smprime"):
                gen = torch.Generator().manual_seed(5)
                for head in (layer.attn.smprime.u_head, layer.attn.smprime.theta_head):
                    head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * 0.3)


def test_published_parameter_count():
    with torch.device("meta"):
        model = SVForCausalLM(SVConfig())
    c = count_parameters(model)
    # token 65,536 + position 65,536 + 4 x (262,144 qkvo + 525,568 MLP + 1,024 LN) + 512 final LN
    assert c["total"] == 3_286_528 == model.num_parameters()
    assert c["excluding_tied_head"] == 3_220_992
    assert c["excluding_embeddings"] == 3_155_456
    assert c["per_module"]["lm_head"] == 0
    with torch.device("meta"):
        biased = SVForCausalLM(SVConfig(attention_bias=True))
    assert count_parameters(biased)["total"] == 3_290_624


def test_head_is_tied_and_ceq_alpha_is_operator_specific():
    m = tiny("ceq")
    assert m.lm_head.weight is m.model.embed_tokens.weight
    c = count_parameters(m)
    assert c["operator_specific"] == {f"model.layers.{i}.attn.ceq_alpha": 1 for i in range(2)}
    assert all(float(layer.attn.ceq_alpha.detach()) == 0.0 for layer in m.model.layers)


def test_smprime_init_and_softmax_corner():
    m = tiny("smprime", {"g_init": 0.0}, seed=6)
    sm = m.model.layers[0].attn.smprime
    assert float(sm.beta.detach()) == 1.0 and float(sm.g.detach()) == 0.0
    assert float(sm.u_head.weight.detach().abs().max()) == 0.0 and float(sm.u_head.bias.detach()[0]) > 0.99
    names = set(count_parameters(m)["operator_specific"])
    assert "model.layers.0.attn.smprime.beta" in names and "model.layers.1.attn.smprime.u_head.weight" in names
    # (beta = 1, g = 0) is softmax attention: same weights -> same logits
    soft = tiny(seed=6)
    m.load_state_dict(soft.state_dict(), strict=False)
    x = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(m(x, use_cache=False).logits, soft(x, use_cache=False).logits,
                                   rtol=1e-5, atol=1e-5)


def test_sv_is_softmax_before_the_first_gate_and_gated_after():
    sv, soft = tiny("sv", SV_KNOBS, seed=7), tiny(seed=7)
    x = torch.randint(0, 256, (2, 13))
    with torch.no_grad():
        a, b = sv(x, use_cache=False).logits, soft(x, use_cache=False).logits
    # positions 0..7 read no gate (chunk 0, and boundary 4 is below the warm-up size 6)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=1e-5, atol=1e-5)
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-4


def test_sv_trains_with_finite_gradients():
    m = tiny("sv", SV_KNOBS, seed=8).train()
    x = torch.randint(0, 256, (2, 14))
    out = m(x, labels=x)
    out.loss.backward()
    grads = [p.grad for p in m.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert m.model.layers[1].attn.k_proj.weight.grad.abs().sum() > 0


def test_softmax_operator_matches_reference():
    m = tiny()
    attn = m.model.layers[0].attn
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 2, 9, 16) for _ in range(3))
    mask = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    out, none = sv_operator_attention(attn, q, k, v, mask, scaling=0.25)
    explicit, weights = sv_operator_attention(attn, q, k, v, mask, scaling=0.25, output_attentions=True)
    ref = softmax_attention(q, k, v, scale=0.25, causal=True)
    assert none is None and weights.shape == (2, 2, 9, 9)
    torch.testing.assert_close(out.transpose(1, 2), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(explicit.transpose(1, 2), ref, rtol=1e-5, atol=1e-6)


def test_swa_matches_explicit_window_loop():
    m = tiny("swa", {"window": 3})
    attn = m.model.layers[0].attn
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    mask = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    out, _ = sv_operator_attention(attn, q, k, v, mask, scaling=0.25)
    for i in range(8):
        lo = max(0, i - 2)
        w = torch.softmax(q[:, :, i:i + 1] @ k[:, :, lo:i + 1].transpose(-1, -2) * 0.25, -1)
        torch.testing.assert_close(out[:, i:i + 1].transpose(1, 2), w @ v[:, :, lo:i + 1], rtol=1e-5, atol=1e-6)


def test_ceq_at_init_equals_softmax_bitwise():
    soft, ceq = tiny("softmax", seed=3), tiny("ceq", seed=3)
    missing = ceq.load_state_dict(soft.state_dict(), strict=False)
    assert set(missing.missing_keys) == {f"model.layers.{i}.attn.ceq_alpha" for i in range(2)}
    x = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        assert torch.equal(soft(x, use_cache=False).logits, ceq(x, use_cache=False).logits)
        _perturb_alpha(ceq)
        assert not torch.allclose(soft(x, use_cache=False).logits, ceq(x, use_cache=False).logits)


@pytest.mark.parametrize("op, knobs", CACHED_OPERATORS)
def test_cached_equals_uncached(op, knobs):
    m = tiny(op, knobs)
    _perturb_alpha(m)
    x = torch.randint(0, 256, (2, 14))
    with torch.no_grad():
        full = m(x, use_cache=False).logits
        parts, cache = [], None
        for a, b in ((0, 6), (6, 7), (7, 10), (10, 11), (11, 14)):
            out = m(x[:, a:b], cache=cache, use_cache=True)
            cache = getattr(out, CACHE_FIELD)
            parts.append(out.logits)
    assert isinstance(cache, SVLMCache)
    assert (torch.cat(parts, 1) - full).abs().max() <= 1e-5
    g1 = m.generate(x[:, :4], max_new_tokens=8, do_sample=False)
    g2 = m.generate(x[:, :4], max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(g1, g2)


@pytest.mark.parametrize("op, knobs", [("ceq", {}), ("sv", SV_KNOBS)])
def test_beam_search_cached_equals_uncached(op, knobs):
    m = tiny(op, knobs, seed=9)
    _perturb_alpha(m)
    x = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=4, do_sample=False, num_beams=3, num_return_sequences=2)
    assert torch.equal(m.generate(x, **kw), m.generate(x, use_cache=False, **kw))


def test_sv_exact_solver_and_differentiable_gate():
    x = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(2))
    exact = tiny("sv", {**SV_KNOBS, "solver": "exact"}, seed=10)
    batched = tiny("sv", SV_KNOBS, seed=10)
    with torch.no_grad():
        a = exact(x, use_cache=False).logits
        b = batched(x, use_cache=False).logits
        cache = None
        parts = []
        for lo, hi in ((0, 9), (9, 10), (10, 14)):
            out = exact(x[:, lo:hi], cache=cache, use_cache=True)
            cache = getattr(out, CACHE_FIELD)
            parts.append(out.logits)
    assert (torch.cat(parts, 1) - a).abs().max() <= 1e-5
    assert (a - b).abs().max() <= 5e-3  # exact vs batched gates on the same keys
    m = tiny("sv", {**SV_KNOBS, "detach_gate": False}, seed=10).train()
    out = m(x, labels=x)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_both_cache_spellings_and_output_field():
    assert CACHE_FIELD in CausalLMOutputWithPast.__dataclass_fields__
    m = tiny("ceq_path_sum")
    x = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        full = m(x, use_cache=False).logits
        a = m(x[:, :5], use_cache=True)
        b1 = m(x[:, 5:], cache=getattr(a, CACHE_FIELD)).logits
        a = m(x[:, :5], use_cache=True)
        b2 = m(x[:, 5:], past_key_values=getattr(a, CACHE_FIELD)).logits
    torch.testing.assert_close(b1, full[:, 5:], rtol=0, atol=1e-5)
    torch.testing.assert_close(b2, full[:, 5:], rtol=0, atol=1e-5)


def test_left_padding_matches_unpadded():
    m = tiny("ceq")
    _perturb_alpha(m)
    x = torch.randint(1, 256, (1, 7))
    pad = torch.cat([torch.zeros(1, 3, dtype=torch.long), x], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = m(x, use_cache=False).logits
        got = m(pad, attention_mask=mask, position_ids=pos, use_cache=False).logits[:, 3:]
        implicit = m(pad, attention_mask=mask, use_cache=False).logits[:, 3:]  # positions from the mask
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(implicit, ref, rtol=1e-5, atol=1e-5)


def test_batched_generate_with_padding_matches_single():
    m = tiny("swa", {"window": 4})
    a, b = torch.randint(1, 256, (1, 6)), torch.randint(1, 256, (1, 3))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)], 0)
    mask = (torch.arange(6)[None] >= torch.tensor([[0], [3]])).long()
    batch = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    single = m.generate(b, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(batch[1, 6:], single[0, 3:])


def test_gradient_checkpointing_gives_same_loss_and_grads():
    x = torch.randint(0, 256, (2, 10))
    grads = []
    for ckpt in (False, True):
        m = tiny("ceq", seed=4).train()
        _perturb_alpha(m, 0.3)
        if ckpt:
            (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
        calls: list[int] = []
        mlp = m.model.layers[0].mlp
        mlp.forward = lambda h, mlp=mlp, calls=calls: calls.append(1) or type(mlp).forward(mlp, h)
        out = m(x, labels=x)
        out.loss.backward()
        assert len(calls) == (2 if ckpt else 1)  # checkpointing re-runs the layer in backward
        assert (getattr(out, CACHE_FIELD) is None) == ckpt  # no cache is built under checkpointing
        grads.append((out.loss.detach(), m.model.layers[0].attn.q_proj.weight.grad.clone(),
                      m.model.layers[1].attn.ceq_alpha.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads[0][2], grads[1][2], rtol=1e-5, atol=1e-7)
    assert grads[0][2].abs() > 0


def test_loss_is_next_byte_cross_entropy():
    m = tiny()
    x = torch.randint(0, 256, (2, 8))
    out = m(x, labels=x)
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 256), x[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, ref)
    loss, logits = m(x, labels=x, use_cache=False, return_dict=False)[:2]
    torch.testing.assert_close(loss, ref)
    assert torch.equal(logits, out.logits)


def test_set_attn_implementation_swaps_the_function():
    calls = []

    def probe(module, query, key, value, attention_mask, **kw):
        calls.append(module.layer_idx)
        return sv_operator_attention(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("svlm_test_probe", probe)
    m = tiny()
    assert m.config._attn_implementation == "eager"
    x = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        ref = m(x, use_cache=False).logits
        m.set_attn_implementation("svlm_test_probe")
        got = m(x, use_cache=False).logits
        assert calls == [0, 1]
        m.set_attn_implementation("eager")
        m(x, use_cache=False)
    assert calls == [0, 1]
    assert torch.equal(ref, got)
    for stock in ("sdpa", "flash_attention_2", "flex_attention"):  # would silently drop the operator
        with pytest.raises(UnsupportedFeatureError, match="own attention operator"):
            m.set_attn_implementation(stock)
    assert m.config._attn_implementation == "eager"


def test_plugin_implementations_switch_in_and_out():
    from sv_attention.hf.enable import enable

    m = tiny()
    x = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = m(x, use_cache=False).logits
        enable(m, "sv_attention", chunk=8)
        assert m.config._attn_implementation == "sv_attention"
        gated = m(x, use_cache=False).logits
        enable(m, "eager")
        back = m(x, use_cache=False).logits
    torch.testing.assert_close(gated[:, :8], ref[:, :8], rtol=1e-5, atol=1e-5)  # chunk 0 is softmax
    assert (gated[:, 16:] - ref[:, 16:]).abs().max() > 1e-4
    assert torch.equal(back, ref)


def test_output_attentions_softmax_rows_sum_to_one():
    m = tiny()
    with torch.no_grad():
        out = m(torch.randint(0, 256, (1, 6)), output_attentions=True, use_cache=False)
    assert len(out.attentions) == 2
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(1, 2, 6))


def test_bad_inputs_raise_typed_errors():
    m = tiny()
    with pytest.raises(InvalidInputError, match="block size"):
        m(torch.zeros(1, 49, dtype=torch.long))
    with pytest.raises(InvalidInputError, match=r"\[0, 256\)"):
        m(torch.full((1, 3), 256))


def test_from_pretrained_recomputes_nonpersistent_buffer(tmp_path):
    m = tiny("ceq")
    _perturb_alpha(m, 0.25)
    m.save_pretrained(tmp_path)
    m2 = SVForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(m2.model.position_ids, torch.arange(48))
    assert float(m2.model.layers[0].attn.ceq_alpha.detach()) == 0.25
    x = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        assert torch.equal(m(x, use_cache=False).logits, m2(x, use_cache=False).logits)


def _left_padded(seed=11):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randint(1, 256, (1, 14), generator=g), torch.randint(1, 256, (1, 9), generator=g)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], 1)], 0)
    mask = (torch.arange(14)[None] >= torch.tensor([[0], [5]])).long()
    return a, b, ids, mask


def test_sv_left_padded_rows_are_gated_at_their_own_positions():
    # the padded row must see the boundaries 8, 12 of its own text, not those of the padded columns
    m = tiny("sv", SV_KNOBS, seed=12)
    a, b, ids, mask = _left_padded()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = m(ids, attention_mask=mask, use_cache=False, output_attentions=True)  # positions from the mask
        ref_a, ref_b = m(a, use_cache=False).logits, m(b, use_cache=False).logits
        parts, cache = [], None  # cached prefill + decode of the padded batch equals its full forward
        for lo, hi in ((0, 10), (10, 11), (11, 14)):
            out = m(ids[:, lo:hi], attention_mask=mask[:, :hi], position_ids=pos[:, lo:hi], cache=cache,
                    use_cache=True)
            cache = getattr(out, CACHE_FIELD)
            parts.append(out.logits)
    torch.testing.assert_close(padded.logits[0], ref_a[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded.logits[1, 5:], ref_b[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # a batch of one padded row too
        alone = m(ids[1:], attention_mask=mask[1:], use_cache=False).logits
    torch.testing.assert_close(alone[0, 5:], ref_b[0], rtol=1e-5, atol=1e-5)
    assert (torch.cat(parts, 1) - padded.logits).abs().max() <= 1e-5
    w = padded.attentions[1][1]
    assert float(w[:, :, :5].abs().max()) == 0.0  # pad slots neither attend nor are attended
    torch.testing.assert_close(w[:, 5:, 5:].sum(-1), torch.ones(2, 9))
    batch = m.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    single = m.generate(b, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(batch[1, 14:], single[0, 9:])


def test_bad_dtype_and_label_shape_raise_typed_errors():
    m = tiny()
    x = torch.randint(0, 256, (1, 6))
    with pytest.raises(InvalidInputError, match="integer"):
        m(x.float())
    with pytest.raises(InvalidInputError, match="labels must have the shape"):
        m(x, labels=x[:, :4])


@pytest.mark.parametrize("op, knobs", [("ceq", {}), ("smprime", {}), ("sv", SV_KNOBS)])
def test_prompt_lookup_decoding_crops_operator_state(op, knobs):
    # assisted decoding crops the cache after rejected candidates (crop(-n)) and calls crop(0) as a no-op
    m = tiny(op, knobs, seed=13)
    _perturb_alpha(m)
    x = torch.tensor([list(b"abcabcabcabcab")])
    ref = m.generate(x, max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(m.generate(x, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3), ref)
    with torch.no_grad():
        cache = getattr(m(x, use_cache=True), CACHE_FIELD)
        state = {k: dict(v) for k, v in cache.operator_state.items()}
        cache.crop(0)
        assert all(cache.operator_state[k][n] is v for k, s in state.items() for n, v in s.items())
        cache.crop(-4)
        step = m(x[:, 10:], cache=cache).logits
        full = m(x, use_cache=False).logits
    torch.testing.assert_close(step, full[:, 10:], rtol=1e-5, atol=1e-5)


def test_sv_runs_in_bfloat16_close_to_float32():
    m = tiny("sv", SV_KNOBS, seed=14)
    x = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = m(x, use_cache=False).logits
        got = m.to(torch.bfloat16)(x, use_cache=False).logits
    assert got.dtype == torch.bfloat16
    assert float((got.float() - ref).abs().max()) <= 0.05 * float(ref.abs().max())


def test_sv_applies_attention_dropout_in_training():
    m = tiny("sv", SV_KNOBS, seed=15)
    attn = m.model.layers[0].attn
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 2, 13, 16) for _ in range(3))
    mask = torch.ones(13, 13, dtype=torch.bool).tril()[None, None]
    _, w = sv_operator_attention(attn, q, k, v, mask, scaling=0.25, output_attentions=True)
    attn.train()
    torch.manual_seed(6)
    out, none = sv_operator_attention(attn, q, k, v, mask, scaling=0.25, dropout=0.5)
    torch.manual_seed(6)
    ref = torch.nn.functional.dropout(w, 0.5, training=True) @ v
    assert none is None
    torch.testing.assert_close(out.transpose(1, 2), ref, rtol=1e-5, atol=1e-6)
    no_drop, _ = sv_operator_attention(attn, q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(no_drop.transpose(1, 2), w @ v, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# ceq and smprime: every path of the model against the naive references (fp64, relative error)
# --------------------------------------------------------------------------------------------------
def _rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def ceq_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The model's ceq operators through ``ceq_attention_reference`` (prefill only: use_cache=False)."""
    from sv_attention.ops.ceq import ceq_attention_reference

    p = module.operator_settings.resolved()
    out = ceq_attention_reference(query, key, value, attention_mask, form=p["form"], operator=p["variant"],
                                  alpha=module.ceq_alpha if p["form"] == "hybrid" else 1.0, hops=p["hops"],
                                  rho=p["rho"], lam=p["lam"] if p["variant"] == "sgate" else None, scaling=scaling)
    return out.transpose(1, 2), None


def smprime_reference_attention(module, query, key, value, attention_mask, scaling=None, hidden_states=None,
                                **kwargs):
    """The model's smprime operator through ``smprime_reference`` (prefill only: use_cache=False)."""
    from sv_attention.ops.smprime import smprime_reference

    sm = module.smprime
    m, theta = sm.gates(hidden_states)
    out = smprime_reference(query, key, value, m, theta, beta=sm.beta, qk=sm.qk, scaling=scaling, mask=attention_mask)
    return out.transpose(1, 2), None


AttentionInterface.register("svlm_test_ceq_reference", ceq_reference_attention)
AttentionInterface.register("svlm_test_smprime_reference", smprime_reference_attention)
REFERENCE_PATHS = [
    ("ceq", {}, "svlm_test_ceq_reference"),
    ("ceq", {"variant": "signed"}, "svlm_test_ceq_reference"),
    ("ceq_path_sum", {}, "svlm_test_ceq_reference"),
    ("ceq_path_sum", {"variant": "signed"}, "svlm_test_ceq_reference"),
    ("smprime", {}, "svlm_test_smprime_reference"),
]


def _loss_and_grads(m, ids, mask):
    labels = ids.masked_fill(mask == 0, -100)
    out = m(ids, attention_mask=mask, labels=labels, use_cache=False)
    grads = torch.autograd.grad(out.loss, [p for p in m.parameters() if p.requires_grad], allow_unused=True)
    return out.logits.detach(), grads


@pytest.mark.parametrize("op, knobs, reference", REFERENCE_PATHS)
@pytest.mark.parametrize("padded", [False, True])
def test_operator_paths_equal_the_naive_reference(op, knobs, reference, padded):
    m = tiny(op, knobs, seed=16).double()
    _perturb_alpha(m, 0.6)
    a, _, ids, mask = _left_padded()
    if not padded:
        ids, mask = a, torch.ones_like(a)
    m.set_attn_implementation(reference)
    ref_logits, ref_grads = _loss_and_grads(m, ids, mask)
    m.set_attn_implementation("eager")
    logits, grads = _loss_and_grads(m, ids, mask)  # forward and backward of the built-in operator
    assert _rel(logits, ref_logits) < 1e-12
    assert sum(g is not None for g in grads) > 10
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g is None) == (r is None) and (g is None or _rel(g, r) < 1e-10)
    with torch.no_grad():  # cached prefill + decoding steps
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        parts, cache = [], None
        for lo, hi in ((0, 10), (10, 11), (11, 12), (12, 14)):
            out = m(ids[:, lo:hi], attention_mask=mask[:, :hi], position_ids=pos[:, lo:hi], cache=cache,
                    use_cache=True)
            cache = getattr(out, CACHE_FIELD)
            parts.append(out.logits)
    assert _rel(torch.cat(parts, 1), ref_logits) < 1e-12
    gen = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    cached = m.generate(ids, **gen)
    m.set_attn_implementation(reference)
    assert torch.equal(cached, m.generate(ids, use_cache=False, **gen))


@pytest.mark.parametrize("op, knobs", [("ceq", {}), ("ceq", {"variant": "signed", "hops": 2}), ("ceq_path_sum", {})])
def test_ceq_plugin_on_the_model_equals_its_builtin_operator(op, knobs):
    import sv_attention  # noqa: F401 - registers the "ceq" plug-in

    m = tiny(op, knobs, seed=17)
    _perturb_alpha(m, 0.5)  # the plug-in must read the module's learned ceq_alpha and the model's settings
    _, _, ids, mask = _left_padded()
    gen = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        builtin = m(ids, attention_mask=mask, use_cache=False).logits
        tokens = m.generate(ids, **gen)
        m.set_attn_implementation("ceq")
        plugin = m(ids, attention_mask=mask, use_cache=False).logits
        plugin_cached = m(ids, attention_mask=mask).logits
        assert torch.equal(m.generate(ids, **gen), tokens)
    # the same entry point (ops.ceq.ceq_layer_attention) with the same settings and weight: bitwise equal
    assert torch.equal(plugin, builtin) and torch.equal(plugin_cached, builtin)
