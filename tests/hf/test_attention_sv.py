"""The "sv_attention" attention function, called directly with the transformers v5 contract."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from sv_attention.errors import InvalidInputError, UnsupportedFeatureError
from sv_attention.hf.attention import STATE_ATTR, sv_attention_forward
from sv_attention.hf.gate_handoff import GateHandoff, clear_pending_gates, set_pending_gate
from sv_attention.hf.settings import SVSettings
from sv_attention.kernels import median_bandwidth, rbf_gram
from sv_attention.ops.sv_gate import GateSchedule, gate_stats
from sv_attention.ops.sv_gate.fit import CountingSolve, count, fit_masked
from sv_attention.ops.sv_gate.readout import grouped_attention as _grouped_attention
from sv_attention.svdd.batched import solve_batched
from sv_attention.svdd.warm_fit import fit_warm, fit_working_set


def _fit(gram, mask, C):
    return fit_masked(gram, mask, C, CountingSolve())


def _fit_working_set(gram, init, C, new):
    return fit_working_set(gram, init, C, new, solve=CountingSolve(), count=count)


def _fit_warm(gram, init, C, new, stat="warm_fits"):
    return fit_warm(gram, init, C, new, solve=CountingSolve(), count=count, stat=stat)


class Cfg:
    def __init__(self, **sv):
        if sv:
            self.sv_attention = sv


class Mod(torch.nn.Module):
    def __init__(self, is_causal=True, layer_idx=0, window=None, **sv):
        super().__init__()
        self.config = Cfg(**sv)
        self.is_causal = is_causal
        self.layer_idx = layer_idx
        self.sliding_window = window
        self.eval()


def qkv(b=2, h=4, g=2, q=12, kv=12, d=8, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, q, d, generator=gen, dtype=dtype), torch.randn(b, g, kv, d, generator=gen, dtype=dtype),
            torch.randn(b, g, kv, d, generator=gen, dtype=dtype))


def plain(q, k, v, allowed, scaling=None):
    """Reference masked softmax attention, [b, h, q, d] (allowed: [b, q, kv])."""
    r = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    sc = scaling if scaling is not None else q.shape[-1] ** -0.5
    lg = (q @ kk.transpose(-1, -2)) * sc
    lg = lg.masked_fill(~allowed[:, None], float("-inf"))
    return torch.softmax(lg, -1) @ vv


def causal(b, q, kv):
    return (torch.arange(kv)[None, :] <= torch.arange(kv - q, kv)[:, None])[None].expand(b, q, kv)


def test_contract_shape_gqa_and_gate_off_equals_softmax():
    q, k, v = qkv()
    mod = Mod(gated=False)
    mask = causal(2, 12, 12)[:, None].clone()
    mask[1, :, :, :3] = False  # left padding of row 1
    out, w = sv_attention_forward(mod, q, k, v, mask, scaling=0.3)
    assert out.shape == (2, 12, 4, 8) and w is None
    ref = plain(q, k, v, mask[:, 0], scaling=0.3).transpose(1, 2)
    real = mask[:, 0].any(-1)  # rows with a visible key
    assert torch.allclose(out[real[:, :, None, None].expand_as(out)], ref[real[:, :, None, None].expand_as(ref)],
                          atol=1e-6)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kind", ["bool", "float", "none", "2d"])
def test_mask_forms(kind):
    q, k, v = qkv(q=5, kv=5)
    mod = Mod(gated=False)
    allowed = causal(2, 5, 5)
    if kind == "bool":
        mask = allowed[:, None]
    elif kind == "float":
        mask = torch.where(allowed[:, None], 0.0, torch.finfo(torch.float32).min)
    elif kind == "2d":  # padding only: causality is added for a causal module
        mask = torch.ones(2, 5, dtype=torch.long)
        mask[1, 0] = 0
        allowed = allowed & mask.bool()[:, None, :]
    else:
        mask = None
    out, _ = sv_attention_forward(mod, q, k, v, mask)
    rows = allowed.any(-1)[:, :, None, None].expand_as(out)  # rows with a visible key
    assert torch.allclose(out[rows], plain(q, k, v, allowed).transpose(1, 2)[rows], atol=1e-6)


def test_none_mask_follows_sdpa_conventions_and_encoders():
    q, k, v = qkv(q=1, kv=7)
    out, _ = sv_attention_forward(Mod(gated=False), q, k, v, None)  # decode: every key
    assert torch.allclose(out, plain(q, k, v, torch.ones(2, 1, 7, dtype=torch.bool)).transpose(1, 2), atol=1e-6)
    q, k, v = qkv(q=6, kv=6)
    out, _ = sv_attention_forward(Mod(is_causal=False, gated=False), q, k, v, None)
    assert torch.allclose(out, plain(q, k, v, torch.ones(2, 6, 6, dtype=torch.bool)).transpose(1, 2), atol=1e-6)
    out2, _ = sv_attention_forward(Mod(gated=False), q, k, v, None, is_causal=False)  # keyword overrides
    assert torch.allclose(out, out2)


@pytest.mark.parametrize("kw", [{"softcap": 30.0}, {"s_aux": torch.zeros(4)}, {"position_bias": torch.zeros(1)}])
def test_semantic_kwargs_are_refused(kw):
    q, k, v = qkv(q=3, kv=3)
    with pytest.raises(UnsupportedFeatureError, match=next(iter(kw))):
        sv_attention_forward(Mod(), q, k, v, None, **kw)


def test_bad_shapes_raise():
    q, k, v = qkv(h=3, g=2)
    with pytest.raises(InvalidInputError):
        sv_attention_forward(Mod(), q, k, v, None)


def test_output_attentions_and_dropout():
    q, k, v = qkv(q=6, kv=6)
    out, w = sv_attention_forward(Mod(gated=False), q, k, v, None, output_attentions=True)
    assert w.shape == (2, 4, 6, 6)
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 6), atol=1e-6)
    assert (w.triu(1) == 0).all()
    torch.manual_seed(0)
    out_d, w_d = sv_attention_forward(Mod(gated=False), q, k, v, None, dropout=0.5, output_attentions=True)
    assert (w_d == 0).sum() > (w == 0).sum()  # dropped weights
    assert not torch.allclose(out_d, out)


def reference_gate_output(q, k, v, *, C, chunk, sc):
    """Single sequence, plain loops: chunk-frozen softmax-hybrid (DESIGN §2.5), gate = the exact (ridge 0)
    cold solve_batched optimum of each prefix."""
    h, n = q.shape[1], q.shape[2]
    g = k.shape[1]
    r = h // g
    warm = math.ceil(1.0 / C - 1e-9) + 2
    sigma = median_bandwidth(k[0, :, :chunk])  # [g]
    out = torch.zeros(1, h, n, v.shape[-1])
    for i in range(n):
        s = (i // chunk) * chunk
        for hh in range(h):
            kv_head = hh // r
            logits = (k[0, kv_head, : i + 1] @ q[0, hh, i]) * sc
            p = torch.softmax(logits, 0)
            gate = torch.ones(i + 1)
            if s >= chunk and s >= warm:
                gram = rbf_gram(k[0, kv_head, :s], sigma=float(sigma[kv_head]))[None]
                alpha = solve_batched(gram, torch.ones(1, s, dtype=torch.bool), C, ridge=0.0).alpha[0].clamp_min(0)
                gate[:s] = alpha
            w = p * gate
            out[0, hh, i] = (w / w.sum()) @ v[0, kv_head, : i + 1]
    return out


def test_chunk_frozen_gate_matches_plain_reference():
    q, k, v = qkv(b=1, q=20, kv=20, d=4, seed=3)
    mod = Mod(nu=0.5, chunk=6)
    st = SVSettings(nu=0.5, chunk=6)
    warm_before = gate_stats().get("warm_fits", 0)
    out, _ = sv_attention_forward(mod, q, k, v, causal(1, 20, 20)[:, None], scaling=0.5)
    # boundaries 12 and 18 are warm-started from the previous boundary's gate, yet equal cold solves
    assert gate_stats().get("warm_fits", 0) - warm_before == 2
    ref = reference_gate_output(q, k, v, C=st.box, chunk=6, sc=0.5)
    assert torch.allclose(out.transpose(1, 2), ref, atol=1e-5)
    # chunk 0 is plain causal softmax; later chunks differ from it
    soft = plain(q, k, v, causal(1, 20, 20), scaling=0.5)
    assert torch.allclose(out.transpose(1, 2)[:, :, :6], soft[:, :, :6], atol=1e-6)
    assert not torch.allclose(out.transpose(1, 2)[:, :, 12:], soft[:, :, 12:], atol=1e-4)


def test_left_padding_gives_each_sequence_its_own_gate():
    q, k, v = qkv(b=1, q=14, kv=14, d=4, seed=4)
    pad = 3
    qp = torch.cat([torch.randn(1, 4, pad, 4), q], 2)
    kp = torch.cat([torch.randn(1, 2, pad, 4), k], 2)
    vp = torch.cat([torch.randn(1, 2, pad, 4), v], 2)
    m = causal(1, 14 + pad, 14 + pad).clone()
    m[:, :, :pad] = False
    alone, _ = sv_attention_forward(Mod(nu=0.5, chunk=5), q, k, v, causal(1, 14, 14)[:, None])
    padded, _ = sv_attention_forward(Mod(nu=0.5, chunk=5), qp, kp, vp, m[:, None])
    assert torch.allclose(padded[:, pad:], alone, atol=1e-6)


def positions_from_mask(visible):
    sched = GateSchedule.from_visible(visible, SVSettings(chunk=2))
    return sched.valid, sched.key_position, sched.query_position


def test_positions_from_mask():
    m = causal(1, 5, 5).clone()
    m[:, :, :2] = False
    valid, kpos, qpos = positions_from_mask(m)
    assert valid.tolist() == [[False, False, True, True, True]]
    assert kpos.tolist() == [[-1, -1, 0, 1, 2]]
    assert qpos.tolist() == [[-1, -1, 0, 1, 2]]
    expanded = causal(1, 5, 5).expand(3, 5, 5)  # a stride-0 batch, as the attention functions pass it
    valid, kpos, qpos = positions_from_mask(expanded)
    assert valid.all() and kpos.tolist() == [[0, 1, 2, 3, 4]] * 3 and qpos.tolist() == [[0, 1, 2, 3, 4]] * 3
    valid, kpos, qpos = positions_from_mask(torch.zeros(2, 0, 4, dtype=torch.bool))  # no query rows
    assert not valid.any() and (kpos == -1).all() and qpos.shape == (2, 0)


def test_decode_state_equals_prefill_and_detects_changes():
    q, k, v = qkv(b=2, q=16, kv=16, d=4, seed=5)
    mod = Mod(nu=0.5, chunk=4)
    full, _ = sv_attention_forward(mod, q, k, v, causal(2, 16, 16)[:, None], use_cache=True)
    mod2 = Mod(nu=0.5, chunk=4)
    steps = [sv_attention_forward(mod2, q[:, :, :7], k[:, :, :7], v[:, :, :7], causal(2, 7, 7)[:, None],
                                  use_cache=True)[0]]
    for t in range(7, 16):
        steps.append(sv_attention_forward(mod2, q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1],
                                          causal(2, 1, t + 1)[:, None], use_cache=True)[0])
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-6)
    assert set(mod2.__dict__[STATE_ATTR].gates) == {12}  # only the boundary later queries can read
    # a reordered batch (beam search) is detected by the key fingerprint and recomputed correctly
    perm = torch.tensor([1, 0])
    out_perm, _ = sv_attention_forward(mod2, q[perm][:, :, 15:], k[perm], v[perm], causal(2, 1, 16)[:, None],
                                       use_cache=True)
    assert torch.allclose(out_perm, full[perm][:, 15:], atol=1e-6)
    # a crop (DynamicCache.crop) followed by different tokens is recomputed too
    k2 = k.clone()
    k2[:, :, 9:] += 1.0
    mod3 = Mod(nu=0.5, chunk=4)
    ref, _ = sv_attention_forward(mod3, q, k2, v, causal(2, 16, 16)[:, None], use_cache=False)
    out_crop, _ = sv_attention_forward(mod2, q[:, :, 9:], k2, v, causal(2, 7, 16)[:, None], use_cache=True)
    assert torch.allclose(out_crop, ref[:, 9:], atol=1e-6)


def test_certified_cache_handoff_is_used_with_positions():
    clear_pending_gates()
    q, k, v = qkv(b=1, q=1, kv=6, d=4, seed=6)
    weights = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 1.0]).expand(1, 2, 1, 6)
    # slot 5 holds a key at position 9 > the query's position 8: causality comes from positions
    set_pending_gate(GateHandoff(layer_idx=3, weights=weights, key_positions=torch.tensor([0, 1, 2, 6, 7, 9]),
                                 query_positions=torch.tensor([8])))
    mask = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    mask[..., 0] = False  # padding from the mask is kept
    out, w = sv_attention_forward(Mod(layer_idx=3), q, k, v, mask, output_attentions=True)
    allowed = torch.tensor([False, False, True, True, True, False])
    r = 2
    lg = (q[0] @ k[0].repeat_interleave(r, 0).transpose(-1, -2)) * 0.5  # [h, 1, 6]
    p = torch.softmax(lg.masked_fill(~allowed, float("-inf")), -1) * weights[0, 0].clamp_min(0)
    p = p / p.sum(-1, keepdim=True)
    assert torch.allclose(w[0], p, atol=1e-6)
    assert torch.allclose(out[0].transpose(0, 1), p @ v[0].repeat_interleave(r, 0), atol=1e-6)
    # consumed once: the next call computes its own (here: gate-free, short) attention
    out2, w2 = sv_attention_forward(Mod(layer_idx=3), q, k, v, mask, output_attentions=True)
    assert w2[0, :, 0, 1].gt(0).all()


def test_sliding_window_policy():
    q, k, v = qkv(q=6, kv=6)
    win = causal(2, 6, 6) & (torch.arange(6)[None, :] > torch.arange(6)[:, None] - 3)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        out, _ = sv_attention_forward(Mod(window=3, nu=0.5, chunk=2), q, k, v, win[:, None])
    assert torch.allclose(out, plain(q, k, v, win).transpose(1, 2), atol=1e-6)
    with pytest.raises(UnsupportedFeatureError, match="sliding window"):
        sv_attention_forward(Mod(window=3, sliding_window="refuse"), q, k, v, win[:, None])


def test_encoder_gate_is_finite_and_changes_output():
    q, k, v = qkv(b=2, q=16, kv=16, d=4, seed=7)
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    mask[1, ..., 12:] = False
    out, _ = sv_attention_forward(Mod(is_causal=False, nu=0.5, chunk=4), q, k, v, mask)
    soft = plain(q, k, v, mask[:, 0]).transpose(1, 2)
    assert torch.isfinite(out).all()
    assert not torch.allclose(out, soft, atol=1e-4)


def test_handoff_mask_over_positions_is_read_at_key_positions():
    clear_pending_gates()
    q, k, v = qkv(b=1, q=1, kv=4, d=4, seed=8)
    kp = torch.tensor([0, 2, 5, 6])  # positions 1, 3, 4 were evicted
    mask = torch.ones(1, 1, 1, 7, dtype=torch.bool)
    mask[..., 2] = False  # position 2 is padding
    set_pending_gate(GateHandoff(layer_idx=0, weights=torch.ones(1, 2, 1, 4), key_positions=kp,
                                 query_positions=torch.tensor([6])))
    _, w = sv_attention_forward(Mod(), q, k, v, mask, output_attentions=True)
    assert (w[0, :, 0, 1] == 0).all() and (w[0, :, 0, [0, 2, 3]] > 0).all()


def test_half_precision_inputs_and_per_head_masks():
    q, k, v = qkv(b=1, q=12, kv=12, d=4, seed=9)
    ref, _ = sv_attention_forward(Mod(nu=0.5, chunk=4), q, k, v, causal(1, 12, 12)[:, None])
    out, _ = sv_attention_forward(Mod(nu=0.5, chunk=4), q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                  causal(1, 12, 12)[:, None])
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert (out.float() - ref).abs().max() < 0.1
    heads = causal(1, 12, 12)[:, None].expand(1, 4, 12, 12).clone()
    heads[:, 1, :, 0] = False
    from sv_attention.errors import MaskError

    with pytest.raises(MaskError, match="per-head"):
        sv_attention_forward(Mod(), q, k, v, heads)


def test_fused_attention_equals_the_plain_grouped_reference():

    from sv_attention.ops.sv_gate.fused import fused_gated_sdpa

    q, k, v = qkv(b=2, h=6, g=2, q=9, kv=11, d=4, seed=8, dtype=torch.float64)
    vis = causal(2, 9, 11).clone()
    vis[1, 0] = False  # a row that sees nothing -> 0
    vis[0, :, 0] = False  # a padded key
    gen = torch.Generator().manual_seed(9)
    bias = torch.randn(2, 2, 1, 11, generator=gen, dtype=torch.float64)
    bias[0, 1, ..., 2] = float("-inf")  # a reserve key
    ref, _ = _grouped_attention(q, k, v, vis, bias, 0.3, 0.0)
    out = fused_gated_sdpa(q, k, v, vis, bias, 0.3)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, ref, atol=1e-12)
    assert (out[1, :, 0] == 0).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_working_set_fit_equals_the_full_cold_fit(seed):

    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(4, 96, 8, generator=gen)
    keys[2] = keys[2] * 0.1 + torch.randn(96, 1, generator=gen).sign()  # clustered keys
    gram = rbf_gram(keys, sigma=median_bandwidth(keys)[:, None, None])
    C = 1.0 / (0.3 * 32)
    full_mask = torch.ones(4, 96, dtype=torch.bool)
    prev = _fit(gram[:, :64, :64].contiguous(), full_mask[:, :64], C)
    before = gate_stats().get("working_set_full", 0)
    ws = _fit_working_set(gram, torch.nn.functional.pad(prev, (0, 32)), C, 32)
    cold = _fit(gram, full_mask, C)
    assert gate_stats().get("working_set_full", 0) == before  # solved on the working set
    assert torch.allclose(ws, cold, atol=1e-5)
    assert torch.allclose(ws.sum(-1), torch.ones(4), atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_direct_warm_fit_equals_the_exact_cold_fit(seed):
    """The warm-started active-set fit (from the previous boundary's partition) is the exact optimum."""
    from sv_attention.svdd.batched import solve_batched
    from sv_attention.svdd.polish import polish_ridge

    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(4, 128, 8, generator=gen, dtype=torch.float64)
    keys[2] = keys[2] * 0.1 + torch.randn(128, 1, generator=gen, dtype=torch.float64).sign()  # clustered keys
    gram = rbf_gram(keys, sigma=median_bandwidth(keys)[:, None, None])
    C = 1.0 / (0.3 * 32)
    mask = torch.ones(4, 128, dtype=torch.bool)
    prev = solve_batched(gram[:, :64, :64].contiguous(), mask[:, :64], C, ridge=0.0).alpha.clamp_min(0.0)
    before = gate_stats().get("warm_pdas_fallback", 0)
    warm = _fit_warm(gram, torch.nn.functional.pad(prev, (0, 64)), C, 64)
    cold = solve_batched(gram, mask, C, ridge=polish_ridge(gram.dtype))
    exact = solve_batched(gram, mask, C, ridge=0.0)
    # the three unclustered problems settle by the active-set steps alone; the primal-dual iteration may
    # oscillate on the clustered one, which then goes to the working-set fit (counted)
    assert gate_stats().get("warm_pdas_fallback", 0) - before <= 1
    assert (warm >= 0).all() and (warm <= C + 1e-12).all()
    assert torch.allclose(warm.sum(-1), torch.ones(4, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(warm, cold.alpha.clamp_min(0.0), atol=1e-10)  # same partition, same tiny ridge
    assert torch.allclose(warm, exact.alpha.clamp_min(0.0), atol=1e-5)  # ridge-0 optimum (ridge ~ ill-conditioning)


def test_gate_fits_run_single_threaded_and_restore_the_thread_count(monkeypatch):
    import sv_attention.ops.sv_gate.gate as sv_gate

    q, k, v = qkv(b=1, q=20, kv=20, d=4, seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        real = sv_gate.fit_from

        def spy(*args, **kw):
            seen.append(torch.get_num_threads())
            return real(*args, **kw)

        real_chain = sv_gate.fit_chain_from

        def spy_chain(*args, **kw):
            seen.append(torch.get_num_threads())
            return real_chain(*args, **kw)

        monkeypatch.setattr(sv_gate, "fit_from", spy)
        monkeypatch.setattr(sv_gate, "fit_chain_from", spy_chain)
        sv_attention_forward(Mod(nu=0.5, chunk=6), q, k, v, causal(1, 20, 20)[:, None], scaling=0.5)  # one chain
        monkeypatch.setattr(sv_gate, "CHAIN_MAX_PROBLEMS", 0)  # boundary by boundary
        sv_attention_forward(Mod(nu=0.5, chunk=6), q, k, v, causal(1, 20, 20)[:, None], scaling=0.5)
        assert len(seen) >= 2 and set(seen) == {sv_gate.GATE_FIT_THREADS}
        assert torch.get_num_threads() == 2

        def boom(*args, **kw):
            raise RuntimeError("solver failure")

        monkeypatch.setattr(sv_gate, "fit_from", boom)
        with pytest.raises(RuntimeError, match="solver failure"):
            sv_attention_forward(Mod(nu=0.5, chunk=6), q, k, v, causal(1, 20, 20)[:, None], scaling=0.5)
        assert torch.get_num_threads() == 2  # restored on the error path too
    finally:
        torch.set_num_threads(before)


def test_gated_output_attentions_path_equals_the_fused_path():
    """With a gate active, output_attentions=True (eager path, dense log-gate) and the fused blocked SDPA
    path (factored GateBias) give the same output; the weights sum to 1 and vanish on reserve keys."""
    q, k, v = qkv(b=2, q=40, kv=40, d=4, seed=9)
    mod = Mod(nu=0.5, chunk=8)
    fused, none = sv_attention_forward(mod, q, k, v, causal(2, 40, 40)[:, None], scaling=0.5, use_cache=False)
    eager, w = sv_attention_forward(mod, q, k, v, causal(2, 40, 40)[:, None], scaling=0.5, use_cache=False,
                                    output_attentions=True)
    assert none is None and w.shape == (2, 4, 40, 40)
    assert torch.allclose(fused, eager, atol=1e-5)
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 40), atol=1e-5)
    assert (w[:, :, 16:, :8] == 0).any()  # some key of the gated prefix is reserve (alpha = 0)


def test_lazy_gram_rows_give_the_dense_gram_gates(monkeypatch):
    """Above DENSE_GRAM_MAX_BYTES the gate computes Gram rows on demand: same output as the dense Gram."""
    import sv_attention.ops.sv_gate.gate as sv_gate

    q, k, v = qkv(b=2, q=48, kv=48, d=4, seed=11)
    mod = Mod(nu=0.5, chunk=8)
    dense, _ = sv_attention_forward(mod, q, k, v, causal(2, 48, 48)[:, None], scaling=0.5, use_cache=False)
    before = gate_stats().get("lazy_gram_calls", 0)
    monkeypatch.setattr(sv_gate, "DENSE_GRAM_MAX_BYTES", 0)
    lazy, _ = sv_attention_forward(mod, q, k, v, causal(2, 48, 48)[:, None], scaling=0.5, use_cache=False)
    assert gate_stats().get("lazy_gram_calls", 0) == before + 1
    assert torch.allclose(lazy, dense, atol=1e-5)
