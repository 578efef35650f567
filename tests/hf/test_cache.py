"""CertifiedCache: certified eviction, the reserve re-check, exact deletion, receipts, typed errors."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import sv_attention
from sv_attention.errors import (
    DuplicateIdError,
    InfeasibleBoxError,
    InvalidInputError,
    SolverError,
    UnknownIdError,
    UnsupportedFeatureError,
)
from sv_attention.hf.cache import CertifiedCache
from sv_attention.hf.cache_receipts import PATH_EXACT, PATH_LOCAL
from sv_attention.hf.gate_handoff import clear_pending_gates, pop_pending_gate
from sv_attention.hf.policies import POLICIES
from sv_attention.svdd import IncrementalSVDD, refit

CHUNK = 8
POLICY_NAMES = sorted(POLICIES)


# ---------------------------------------------------------------------------------------------- helpers
def _kv(points: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.tensor(points, dtype=torch.float64)[None, None]  # [1, 1, m, 2]
    return k, k.clone()


def _counterexample_cache(offload: str | None) -> CertifiedCache:
    """DESIGN §2.2: keys (-1,0), (1,0), (0,0.9), C = 1, sigma = 5; one token per chunk."""
    cache = CertifiedCache(num_layers=1, C=1.0, sigma=5.0, chunk=1, offload=offload)
    cache.update(*_kv([[-1, 0], [1, 0], [0, 0.9]]), 0)
    cache.update(*_kv([[0, -10]]), 0)  # query at position 3 reads the gate on positions 0..2
    clear_pending_gates()
    return cache


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    m = LlamaForCausalLM(cfg).eval()
    sv_attention.enable(m, "sv_attention", nu=0.3, chunk=CHUNK)
    return m


def _prefill(model: LlamaForCausalLM, ids: torch.Tensor, **kw) -> tuple[CertifiedCache, torch.Tensor]:
    cache = CertifiedCache(model.config, **kw)
    with torch.no_grad():
        logits = model(ids, cache=cache, use_cache=True).logits
    return cache, logits


def _step(model: LlamaForCausalLM, cache: CertifiedCache, tok: torch.Tensor, **kw) -> torch.Tensor:
    with torch.no_grad():
        return model(tok, cache=cache, use_cache=True, **kw).logits


def _state(cache: CertifiedCache) -> list:
    out = []
    for layer in cache.layers:
        solvers = [] if layer.bank is None else [s.state_dict() for _, _, s in layer.bank.each()]
        out.append((layer.keys.clone(), layer.values.clone(), layer.positions.clone(), layer.seen,
                    sorted(layer.forgotten), sorted(layer.evicted), list(layer.admitted),
                    sorted(layer.bank.history) if layer.bank is not None else None,
                    len(cache.restore_events), solvers))
    return out


def _assert_same_state(a: list, b: list) -> None:
    for la, lb in zip(a, b, strict=True):
        for x, y in zip(la[:3], lb[:3], strict=True):
            assert torch.equal(x, y)
        assert la[3:9] == lb[3:9]
        assert len(la[9]) == len(lb[9])
        for sa, sb in zip(la[9], lb[9], strict=True):
            assert sa.keys() == sb.keys()
            for key in sa:
                va, vb = sa[key], sb[key]
                if isinstance(va, np.ndarray):
                    np.testing.assert_array_equal(va, vb)
                elif isinstance(va, dict):
                    assert va.keys() == vb.keys()
                    for kk in va:
                        np.testing.assert_array_equal(np.asarray(va[kk]), np.asarray(vb[kk]))
                else:
                    assert va == vb


# ---------------------------------------------------------------------------------------------- re-check
def test_counterexample_revived_token_is_restored_from_offload() -> None:
    cache = _counterexample_cache("cpu")
    solver = cache.layers[0].bank.solvers[0][0]
    assert solver.partition.reserve == (2,)
    rep = cache.evict()
    assert rep.certified and rep.layers[0].evicted_positions == (2,) and rep.max_evicted_alpha == 0.0
    assert cache.layers[0].positions.tolist() == [0, 1, 3]
    assert rep.memory_bytes_after < rep.memory_bytes_before
    # admitting (0, -10) (at the next boundary) makes the old reserve key a support vector again
    cache.update(*_kv([[0.3, 0.3]]), 0)
    gate = pop_pending_gate(0)
    assert [(e.position, e.restored) for e in cache.restore_events] == [(2, True)]
    assert cache.layers[0].positions.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(cache.layers[0].keys[0, 0, 2], torch.tensor([0.0, 0.9], dtype=torch.float64))
    assert gate.key_positions.tolist() == [0, 1, 2, 3, 4]
    assert abs(float(gate.weights[0, 0, 0, 2]) - 0.03327) < 5e-6
    # the gate equals a from-scratch fit of the full history
    ref = refit(np.array([[-1, 0], [1, 0], [0, 0.9], [0, -10]], dtype=np.float64), C=1.0, sigma=5.0)
    np.testing.assert_allclose(gate.weights[0, 0, 0, :4].numpy(), ref.alpha, atol=1e-10)
    assert cache.certificate()["exact"]
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.restore_events == [] and cache.memory_bytes() == 0


def test_counterexample_without_offload_reports_lost_exactness() -> None:
    cache = _counterexample_cache(None)
    cache.evict()
    assert cache.memory_report()["offload_bytes"] == 0
    with pytest.warns(UserWarning, match="exactness is lost"):
        cache.update(*_kv([[0.3, 0.3]]), 0)
    clear_pending_gates()
    assert [(e.position, e.restored) for e in cache.restore_events] == [(2, False)]
    assert not cache.certificate()["exact"]


# ---------------------------------------------------------------------------------------------- eviction
def test_certified_eviction_shrinks_memory_and_keeps_logits(model: LlamaForCausalLM) -> None:
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (1, 36))
    ref, _ = _prefill(model, ids)
    ev, _ = _prefill(model, ids)
    before = [layer.keys.shape[-2] for layer in ev.layers]
    rep = ev.evict()
    assert rep.certified and rep.n_evicted > 0
    assert rep.max_evicted_alpha == 0.0 and rep.as_dict()["max_evicted_alpha"] == 0.0
    after = [layer.keys.shape[-2] for layer in ev.layers]
    assert all(a <= b for a, b in zip(after, before, strict=True)) and sum(after) < sum(before)
    assert ev.memory_bytes() == rep.memory_bytes_after < rep.memory_bytes_before == ref.memory_bytes()
    for le in rep.layers:
        assert len(le.reserve_fraction) == 1 and len(le.reserve_fraction[0]) == 2  # [batch][kv-head]
        # physical eviction needs reserve in every head: realised <= min per-head reserve fraction
        assert le.realised_fraction <= min(le.reserve_fraction[0]) + 1e-12
        assert le.kkt_max < 1e-9
    # next-token logits (across two chunk boundaries) equal those without eviction
    worst = 0.0
    for _ in range(2 * CHUNK + 2):
        tok = torch.randint(0, 64, (1, 1))
        worst = max(worst, float((_step(model, ref, tok) - _step(model, ev, tok)).abs().max()))
    assert worst <= 1e-5
    assert ev.get_seq_length() == ref.get_seq_length()
    assert all(e.restored for e in ev.restore_events)


def test_budget_and_warmup_threshold(model: LlamaForCausalLM) -> None:
    torch.manual_seed(2)
    cache, _ = _prefill(model, torch.randint(0, 64, (1, 30)))
    snap = _state(cache)
    with pytest.raises(InvalidInputError, match="warm-up threshold"):
        cache.evict(budget=cache.warmup_size - 1)
    with pytest.raises(InvalidInputError):
        cache.evict(budget=2.5)  # type: ignore[arg-type]
    _assert_same_state(snap, _state(cache))
    rep = cache.evict(budget=26)
    for le in rep.layers:
        assert le.n_slots_after == max(26, le.n_slots_before - len(le.evicted_positions))
        assert le.n_slots_after <= 26 or not rep.budget_met
    assert all(le.n_slots_after <= 26 for le in rep.layers) == rep.budget_met


def test_prefill_equals_token_by_token_decode(model: LlamaForCausalLM) -> None:
    torch.manual_seed(3)
    ids = torch.randint(0, 64, (1, 3 * CHUNK + 3))
    _, full = _prefill(model, ids)
    cache = CertifiedCache(model.config)
    steps = [_step(model, cache, ids[:, t:t + 1]) for t in range(ids.shape[1])]
    assert float((torch.cat(steps, dim=1) - full).abs().max()) <= 1e-5


def test_generate_uses_the_cache(model: LlamaForCausalLM) -> None:
    torch.manual_seed(4)
    ids = torch.randint(0, 64, (1, 12))
    cache = CertifiedCache(model.config)
    out = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False)
    assert cache.get_seq_length() == out.shape[1] - 1
    # greedy loop with a fresh cache gives the same tokens
    c2, logits = _prefill(model, ids)
    toks = [logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(5):
        toks.append(_step(model, c2, toks[-1])[:, -1].argmax(-1, keepdim=True))
    assert torch.equal(out[:, 12:], torch.cat(toks, dim=1))


# ---------------------------------------------------------------------------------------------- deletion
def test_forget_long_range_is_the_exact_decrement(model: LlamaForCausalLM) -> None:
    torch.manual_seed(5)
    cache, _ = _prefill(model, torch.randint(0, 64, (1, 28)))
    mem0 = cache.memory_bytes()
    rep = cache.forget([3, 11], verify=True)
    assert rep.paths == {3: PATH_EXACT, 11: PATH_EXACT}
    assert len(rep.solvers) == 2 * 2  # layers x kv-heads
    assert rep.max_kkt_residual < 1e-9 and rep.max_refit_deviation < 1e-8
    assert "NOT removed unless reencode=True" in rep.scope
    assert cache.memory_bytes() < mem0
    for layer in cache.layers:
        assert 3 not in layer.positions.tolist() and 11 not in layer.positions.tolist()
    # the gate the next query reads is the from-scratch refit without the forgotten keys
    _step(model, cache, torch.randint(0, 64, (1, 1)))
    layer = cache.layers[0]
    s = layer.bank.solvers[0][1]
    keys = layer.keys[0, 1].double()
    pos = layer.positions.numpy()
    sel = pos < layer.admitted[0]  # unpadded: real positions are positions
    ref = refit(keys[sel].numpy(), C=s.C, sigma=s.sigma, ids=pos[sel])
    np.testing.assert_allclose(s.alpha_of(pos[sel]), ref.alpha, atol=1e-9)
    with pytest.raises(UnknownIdError):
        cache.forget([3])


def test_forget_current_chunk_is_the_local_path(model: LlamaForCausalLM) -> None:
    torch.manual_seed(6)
    ids = torch.randint(0, 64, (1, 2 * CHUNK + 3))  # current chunk holds positions 16..18
    a, _ = _prefill(model, ids)
    b, _ = _prefill(model, ids)
    rep = a.forget([17])
    assert rep.paths == {17: PATH_LOCAL} and rep.solvers == ()
    tok = torch.randint(0, 64, (1, 1))
    la = _step(model, a, tok)
    mask = torch.ones(1, ids.shape[1] + 1, dtype=torch.long)
    mask[0, 17] = 0  # the reference: the same token masked out, softmax renormalised over the rest
    lb = _step(model, b, tok, attention_mask=mask)
    assert float((la - lb).abs().max()) <= 1e-5


def test_forget_reencode_equals_a_cache_that_never_saw_the_token(model: LlamaForCausalLM) -> None:
    torch.manual_seed(7)
    ids = torch.randint(0, 64, (1, 3 * CHUNK + 2))
    cache, _ = _prefill(model, ids)
    rep = cache.forget([10], reencode=True, model=model, input_ids=ids)
    assert rep.reencoded and rep.position_map[11] == 10
    never, _ = _prefill(model, torch.cat([ids[:, :10], ids[:, 11:]], dim=1))
    for la, lb in zip(cache.layers, never.layers, strict=True):
        assert la.positions.tolist() == lb.positions.tolist() and la.seen == lb.seen
        assert la.admitted == lb.admitted
        assert float((la.keys - lb.keys).abs().max()) <= 1e-5
        assert float((la.values - lb.values).abs().max()) <= 1e-5
        for (_, _, sa), (_, _, sb) in zip(la.bank.each(), lb.bank.each(), strict=True):
            assert sa.ids.tolist() == sb.ids.tolist()
            np.testing.assert_allclose(sa.alpha, sb.alpha, atol=1e-6)
    tok = torch.randint(0, 64, (1, 1))
    assert float((_step(model, cache, tok) - _step(model, never, tok)).abs().max()) <= 1e-5


def test_bad_deletions_raise_and_leave_the_cache_unchanged(model: LlamaForCausalLM) -> None:
    torch.manual_seed(8)
    cache, _ = _prefill(model, torch.randint(0, 64, (1, 20)))
    snap = _state(cache)
    for bad, err in [([20], InvalidInputError), ([-1], InvalidInputError), ([2, 2], DuplicateIdError),
                     ([], InvalidInputError), (["a"], InvalidInputError)]:
        with pytest.raises(err):
            cache.forget(bad)
    with pytest.raises(InvalidInputError, match="reencode"):
        cache.forget([1], reencode=True)
    _assert_same_state(snap, _state(cache))
    cache.forget([4])
    snap = _state(cache)
    with pytest.raises(UnknownIdError, match="already forgotten"):
        cache.forget([4, 5])
    _assert_same_state(snap, _state(cache))


def test_deletion_below_the_box_is_refused() -> None:
    cache = CertifiedCache(num_layers=1, C=0.25, sigma=2.0, chunk=6)
    rng = np.random.default_rng(0)
    pts = rng.normal(size=(7, 2)).tolist()
    cache.update(*_kv(pts), 0)  # positions 0..5 admitted at the boundary 6 (n*C = 1.5)
    clear_pending_gates()
    snap = _state(cache)
    with pytest.raises(InfeasibleBoxError, match="n\\*C|C ="):
        cache.forget([0, 1, 2])
    _assert_same_state(snap, _state(cache))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = cache.forget([0, 1])  # 4 keys * 0.25 = 1: feasible, but below warm-up ceil(4)+2
    assert rep.warmup_fallback_layers == (0,)


def test_unsupported_uses_are_refused(model: LlamaForCausalLM) -> None:
    cache, _ = _prefill(model, torch.randint(0, 64, (1, 5)))
    with pytest.raises(UnsupportedFeatureError):
        cache.batch_repeat_interleave(2)
    with pytest.raises(UnsupportedFeatureError):
        cache.reorder_cache(torch.tensor([0]))
    from transformers import Qwen2Config

    qcfg = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
                       max_window_layers=1)
    with pytest.raises(UnsupportedFeatureError):
        CertifiedCache(qcfg)
    assert sv_attention.CertifiedCache is CertifiedCache


def test_crop_returns_to_a_shorter_prefix(model: LlamaForCausalLM) -> None:
    torch.manual_seed(9)
    ids = torch.randint(0, 64, (1, 2 * CHUNK + 4))
    cache, _ = _prefill(model, ids)
    cache.crop(-6)
    short, _ = _prefill(model, ids[:, :-6])
    assert cache.get_seq_length() == short.get_seq_length() == ids.shape[1] - 6
    tok = ids[:, -6:-5]
    assert float((_step(model, cache, tok) - _step(model, short, tok)).abs().max()) <= 1e-5


def test_eviction_keeps_logits_on_the_sv_lm_architecture() -> None:
    """The project's own remote-code LM (randomly initialised here) with the sv_attention function."""
    from configuration_sv import SVConfig
    from modeling_sv import SVForCausalLM

    torch.manual_seed(10)
    cfg = SVConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=128)
    m = SVForCausalLM(cfg).eval()
    sv_attention.enable(m, "sv_attention", nu=0.3, chunk=CHUNK)
    ids = torch.randint(0, 64, (1, 30))
    ref, _ = _prefill(m, ids)
    ev, _ = _prefill(m, ids)
    rep = ev.evict()
    assert rep.certified and ev.memory_bytes() < ref.memory_bytes()
    worst = 0.0
    for _ in range(CHUNK + 2):
        tok = torch.randint(0, 64, (1, 1))
        worst = max(worst, float((_step(m, ref, tok) - _step(m, ev, tok)).abs().max()))
    assert worst <= 1e-5


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_eviction_is_refused_when_the_model_ignores_the_gate(model: LlamaForCausalLM, policy: str) -> None:
    torch.manual_seed(11)
    cache, _ = _prefill(model, torch.randint(0, 64, (1, 20)), policy=policy)
    model.set_attn_implementation("sdpa")
    try:
        snap = _state(cache)
        with pytest.raises(UnsupportedFeatureError, match="ignores the SV gate"):
            cache.evict(budget=12)
        with pytest.raises(UnsupportedFeatureError, match="sv_attention"):
            cache.forget([1])
        _assert_same_state(snap, _state(cache))
        _step(model, cache, torch.randint(0, 64, (1, 1)))
        assert pop_pending_gate(0) is None  # no stale gate is left for another model
    finally:
        model.set_attn_implementation("sv_attention")
    off = CertifiedCache(model.config, gated=False, policy=policy)
    with pytest.raises(UnsupportedFeatureError, match="gated=False"):
        off.evict(budget=12)


def test_eviction_keeps_logits_with_a_left_padded_batch(model: LlamaForCausalLM) -> None:
    """Two rows, the second left-padded: the mask (over positions) is read at the surviving slots."""
    torch.manual_seed(12)
    ids = torch.randint(0, 64, (2, 26))
    mask = torch.ones(2, 26, dtype=torch.long)
    mask[1, :5] = 0
    ref, ev = CertifiedCache(model.config), CertifiedCache(model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=ref, use_cache=True)
        model(ids, attention_mask=mask, cache=ev, use_cache=True)
    rep = ev.evict()
    assert rep.n_evicted > 0 and len(rep.layers[0].reserve_fraction) == 2  # [batch][kv-head]
    worst = 0.0
    for _ in range(CHUNK):
        tok = torch.randint(0, 64, (2, 1))
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        worst = max(worst, float((_step(model, ref, tok, attention_mask=mask)
                                  - _step(model, ev, tok, attention_mask=mask)).abs().max()))
    assert worst <= 1e-5


def test_prefill_gate_streams_the_exact_solver_through_every_boundary() -> None:
    """One prefill call crossing 3 boundaries: each query chunk reads refit(keys before its chunk)."""
    rng = np.random.default_rng(13)
    b, h, n, d, c = 2, 2, 26, 3, 6
    keys = torch.from_numpy(rng.normal(size=(b, h, n, d)))
    cache = CertifiedCache(num_layers=1, nu=0.5, n0=c, sigma=1.5, chunk=c)  # C = 1/3, warm-up 5 keys
    cache.update(keys, keys.clone(), 0)
    w = pop_pending_gate(0).weights  # [b, h, n, n]
    assert w.shape == (b, h, n, n)
    assert torch.equal(w[:, :, :c], torch.ones(b, h, c, n))  # chunk 0 is ungated
    for s in range(c, n, c):
        for i in range(b):
            for j in range(h):
                ref = refit(keys[i, j, :s].numpy(), C=1.0 / 3.0, sigma=1.5)
                rows = w[i, j, s:s + c]
                np.testing.assert_allclose(rows[:, :s].numpy(), np.broadcast_to(ref.alpha, (rows.shape[0], s)),
                                           atol=1e-9)
                assert torch.equal(rows[:, s:], torch.ones_like(rows[:, s:]))  # local chunk read densely


def test_forget_an_evicted_token_drops_it_from_the_offload_tier() -> None:
    cache = _counterexample_cache("cpu")
    cache.evict()
    off = cache.memory_report()["offload_bytes"]
    assert off > 0
    with pytest.warns(UserWarning, match="falls back to warm-up"):
        rep = cache.forget([2], verify=True)  # 2 keys left < ceil(1/C)+2 = 3
    assert rep.paths == {2: PATH_EXACT} and rep.max_refit_deviation < 1e-10
    assert rep.warmup_fallback_layers == (0,)
    assert cache.memory_report()["offload_bytes"] == 0
    assert 2 not in cache.layers[0].evicted and 2 not in cache.layers[0].bank.history
    cache.update(*_kv([[0.3, 0.3]]), 0)  # (0, -10) admitted: nothing to revive any more
    clear_pending_gates()
    assert cache.restore_events == []


_ARTIFACT = Path(__file__).resolve().parents[2] / "hf_artifact"


@pytest.mark.skipif(not (_ARTIFACT / "config.json").exists() or not list(_ARTIFACT.glob("*.safetensors")),
                    reason="no trained sv_lm artifact in hf_artifact/ yet (sv-attention export writes it)")
def test_eviction_keeps_logits_on_the_trained_sv_lm() -> None:
    from modeling_sv import SVForCausalLM

    m = SVForCausalLM.from_pretrained(_ARTIFACT).eval()
    sv_attention.enable(m, "sv_attention", nu=0.3, chunk=16)
    ids = torch.tensor([list(b"Once upon a time there was a little fox who lived by the river.")])
    ref, _ = _prefill(m, ids)
    ev, _ = _prefill(m, ids)
    rep = ev.evict()
    assert rep.certified and ev.memory_bytes() < ref.memory_bytes()
    worst, tok = 0.0, ids[:, -1:]
    for _ in range(20):
        a, b = _step(m, ref, tok), _step(m, ev, tok)
        worst = max(worst, float((a - b).abs().max()))
        tok = a[:, -1].argmax(-1, keepdim=True)
    assert worst <= 1e-5


# ---------------------------------------------------------------------------------------------- transactions
def _fail_on_call(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, k: int) -> list[int]:
    """Make the ``k``-th call (1-based) of ``cls.name`` raise RuntimeError after the earlier ones ran."""
    orig, calls = getattr(cls, name), [0]

    def patched(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == k:
            raise RuntimeError("injected solver failure")
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, patched)
    return calls


def test_forget_rolls_back_when_a_solver_fails_part_way(model: LlamaForCausalLM,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(14)
    ids = torch.randint(0, 64, (1, 28))
    cache, _ = _prefill(model, ids)
    cache.evict()
    twin, _ = _prefill(model, ids)
    twin.evict()
    snap = _state(cache)
    mem = {k: v for k, v in cache.memory_report().items() if k != "gate_bytes"}  # gate_bytes: a derived cache
    calls = _fail_on_call(monkeypatch, IncrementalSVDD, "remove", 3)  # layer 1, after layer 0's solvers ran
    victim = max(cache.layers[0].bank.history)
    with pytest.raises(SolverError, match="rolled back"):
        cache.forget([victim])
    assert calls[0] == 3
    _assert_same_state(snap, _state(cache))
    assert {k: v for k, v in cache.memory_report().items() if k != "gate_bytes"} == mem
    assert pop_pending_gate(0) is None
    monkeypatch.undo()
    # the rolled-back cache behaves exactly like one that never saw the failed call
    ra, rb = cache.forget([victim], verify=True), twin.forget([victim], verify=True)
    assert ra.max_refit_deviation < 1e-8 and rb.max_refit_deviation < 1e-8
    _assert_same_state(_state(twin), _state(cache))
    tok = torch.randint(0, 64, (1, 1))
    assert torch.equal(_step(model, cache, tok), _step(model, twin, tok))


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_evict_rolls_back_when_a_layer_fails_part_way(model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch,
                                                       policy: str) -> None:
    torch.manual_seed(15)
    cache, _ = _prefill(model, torch.randint(0, 64, (1, 28)), policy=policy)
    snap = _state(cache)
    _fail_on_call(monkeypatch, type(cache.policy), "select", 2)  # layer 0 evicted, layer 1 fails
    with pytest.raises(SolverError, match="evict"):
        cache.evict(budget=16)
    _assert_same_state(snap, _state(cache))
    assert cache.memory_report()["offload_bytes"] == 0 and cache.certificate()["exact"]
    monkeypatch.undo()
    assert cache.evict(budget=16).n_evicted > 0


def test_reencode_rolls_back_when_the_model_fails(model: LlamaForCausalLM,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(16)
    ids = torch.randint(0, 64, (1, 2 * CHUNK + 3))
    cache, _ = _prefill(model, ids)
    snap = _state(cache)
    _fail_on_call(monkeypatch, type(model.model.layers[1]), "forward", 1)  # after layer 0 wrote its slots
    with pytest.raises(SolverError, match="reencode=True"):
        cache.forget([3], reencode=True, model=model, input_ids=ids)
    _assert_same_state(snap, _state(cache))
    assert pop_pending_gate(0) is None and pop_pending_gate(1) is None


# ---------------------------------------------------------------------------------------------- padding
def _generate_evict_generate(model: LlamaForCausalLM, ids: torch.Tensor, mask: torch.Tensor | None,
                             declare: bool) -> tuple[torch.Tensor, CertifiedCache]:
    """Greedy-generate 3 tokens, evict, generate CHUNK + 2 more; logits ``[b, steps, vocab]``."""
    cache = CertifiedCache(model.config)
    if declare:
        cache.set_padding(mask)
    kw = {} if mask is None else {"attention_mask": mask}
    a = model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False, output_logits=True,
                       return_dict_in_generate=True, **kw)
    assert cache.evict().max_evicted_alpha == 0.0
    if mask is not None:
        kw = {"attention_mask": torch.cat([mask, torch.ones(ids.shape[0], 3, dtype=torch.long)], dim=1)}
    b = model.generate(a.sequences, cache=cache, max_new_tokens=CHUNK + 2, do_sample=False, output_logits=True,
                       return_dict_in_generate=True, **kw)
    return torch.stack(a.logits + b.logits, dim=1), cache


def test_declared_padding_makes_a_padded_row_compute_what_it_computes_alone(model: LlamaForCausalLM) -> None:
    """A row left-padded by one chunk, padding declared: its pads never enter its solvers, its boundaries
    count its real tokens, and its logits (through eviction) equal the same sequence run alone."""
    torch.manual_seed(17)
    a, b = torch.randint(1, 64, (1, 3 * CHUNK + 2)), torch.randint(1, 64, (1, 2 * CHUNK + 2))
    ids = torch.cat([a, torch.cat([torch.zeros(1, CHUNK, dtype=torch.long), b], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :CHUNK] = 0
    logits, cache = _generate_evict_generate(model, ids, mask, declare=True)
    for layer in cache.layers:
        assert layer.bank.row_start == [CHUNK, CHUNK]  # real boundaries: each row starts at its own chunk 1
        pad_held = {p for s in layer.bank.solvers[1] for p in set(s.ids.tolist()) | set(s.evicted_ids) if p < CHUNK}
        assert pad_held == set() and min(layer.bank.row_history[1]) == CHUNK
    worst = []
    for r, seq in enumerate((a, b)):
        alone, _ = _generate_evict_generate(model, seq, None, declare=False)
        worst.append(float((logits[r] - alone[0]).abs().max()))
    assert max(worst) <= 1e-5, worst


def _padded_prefill(model: LlamaForCausalLM, ids: torch.Tensor, mask: torch.Tensor) -> CertifiedCache:
    """Prefill with the padding declared and generate's position ids."""
    full = torch.cat([mask, torch.ones(ids.shape[0], ids.shape[1] - mask.shape[1], dtype=torch.long)], dim=1)
    cache = CertifiedCache(model.config)
    cache.set_padding(mask)
    with torch.no_grad():
        model(ids, attention_mask=full, position_ids=(full.cumsum(-1) - 1).masked_fill(full == 0, 1), cache=cache,
              use_cache=True)
    return cache


def test_reencode_with_declared_padding_equals_a_cache_that_never_saw_the_token(model: LlamaForCausalLM) -> None:
    torch.manual_seed(18)
    ids = torch.randint(1, 64, (2, 3 * CHUNK + 3))
    ids[1, :CHUNK] = 0
    mask = torch.ones(2, 2 * CHUNK, dtype=torch.long)
    mask[1, :CHUNK] = 0
    cache = _padded_prefill(model, ids, mask)
    victim = 2 * CHUNK + 1
    rep = cache.forget([victim], reencode=True, model=model, input_ids=ids)
    assert rep.reencoded and rep.position_map[victim + 1] == victim
    never = _padded_prefill(model, torch.cat([ids[:, :victim], ids[:, victim + 1:]], dim=1), mask)
    for la, lb in zip(cache.layers, never.layers, strict=True):
        assert la.positions.tolist() == lb.positions.tolist() and la.bank.row_history == lb.bank.row_history
        assert float((la.keys - lb.keys).abs().max()) <= 1e-5
        for (_, _, sa), (_, _, sb) in zip(la.bank.each(), lb.bank.each(), strict=True):
            np.testing.assert_allclose(sa.alpha, sb.alpha, atol=1e-6)


def test_set_padding_is_checked() -> None:
    cache = CertifiedCache(num_layers=1, chunk=4, sigma=1.0)
    with pytest.raises(InvalidInputError, match="2-D"):
        cache.set_padding(torch.ones(4))
    with pytest.raises(InvalidInputError, match="only 0"):
        cache.set_padding(torch.full((1, 4), 2))
    cache.set_padding(torch.tensor([[0, 1, 1, 1]]))
    cache.update(*_kv([[0.0, 0.0]] * 3), 0)
    clear_pending_gates()
    with pytest.raises(InvalidInputError, match="fresh cache"):
        cache.set_padding(torch.ones(1, 4))
    two = CertifiedCache(num_layers=1, chunk=2, sigma=1.0)
    two.set_padding(torch.ones(2, 2))
    with pytest.raises(InvalidInputError, match="declared 2 batch rows"):
        two.update(*_kv([[0.0, 0.0]] * 3), 0)
    assert two.get_seq_length() == 0 and not two.layers[0].is_initialized  # refused before any change


def test_crop_after_eviction_keeps_evicted_tokens_under_the_recheck(model: LlamaForCausalLM) -> None:
    """A rebuild (crop / re-encode) must leave every physically evicted token in the solvers' evicted
    stores, where each later admission re-checks it, and not as an active key whose alpha may grow."""
    torch.manual_seed(19)
    ids = torch.randint(0, 64, (1, 4 * CHUNK + 3))
    ev, _ = _prefill(model, ids)
    ref, _ = _prefill(model, ids)
    assert ev.evict().n_evicted > 0
    ev.crop(-(CHUNK + 1))
    ref.crop(-(CHUNK + 1))
    for layer in ev.layers:
        gone = set(layer.evicted)
        assert gone and all(gone <= set(s.evicted_ids) for _, _, s in layer.bank.each())
        assert not gone & layer.bank.active_positions()
    worst = 0.0
    for _ in range(2 * CHUNK):
        tok = torch.randint(0, 64, (1, 1))
        worst = max(worst, float((_step(model, ref, tok) - _step(model, ev, tok)).abs().max()))
    assert worst <= 1e-5


def test_a_failed_admission_undoes_the_step_in_every_layer(model: LlamaForCausalLM,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(20)
    ids = torch.randint(0, 64, (1, 2 * CHUNK))  # the next token crosses the boundary 2 * CHUNK
    cache, _ = _prefill(model, ids)
    twin, _ = _prefill(model, ids)
    tok = torch.randint(0, 64, (1, 1))
    n_add = len(cache.layers[0].bank.solvers[0])  # layer 0's solvers admit, layer 1's first solver fails
    _fail_on_call(monkeypatch, IncrementalSVDD, "add", n_add + 1)
    with pytest.raises(SolverError, match="undone in every layer"):
        _step(model, cache, tok)
    monkeypatch.undo()
    for la, lb in zip(cache.layers, twin.layers, strict=True):
        assert la.seen == lb.seen == 2 * CHUNK and la.admitted == lb.admitted
        assert torch.equal(la.keys, lb.keys) and la.positions.tolist() == lb.positions.tolist()
        assert la.bank.row_history == lb.bank.row_history
    assert pop_pending_gate(0) is None and pop_pending_gate(1) is None
    assert float((_step(model, cache, tok) - _step(model, twin, tok)).abs().max()) <= 1e-6


def test_a_failed_step_after_eviction_restores_every_layer_bit_identically(model: LlamaForCausalLM,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """errors.py promises "exactly as it was": after evict(), a step whose admission fails in layer 1 leaves
    layer 0 (which already admitted the chunk) with the very solvers, slots, offload tier and restore events
    it had -- not a rebuild (which would hold every reserve key evicted at the solver level)."""
    torch.manual_seed(24)
    ids = torch.randint(0, 64, (1, 2 * CHUNK + 1))
    cache, _ = _prefill(model, ids)
    assert cache.evict().n_evicted > 0
    for _ in range(CHUNK - 1):  # admits the chunk at 2 * CHUNK on top of the evicted state
        _step(model, cache, torch.randint(0, 64, (1, 1)))
    cache.forget([1])
    assert cache.get_seq_length() == 3 * CHUNK  # the next token crosses the boundary 3 * CHUNK
    before = _state(cache)
    n_add = len(cache.layers[0].bank.solvers[0])
    _fail_on_call(monkeypatch, IncrementalSVDD, "add", n_add + 1)
    with pytest.raises(SolverError, match="undone in every layer"):
        _step(model, cache, torch.randint(0, 64, (1, 1)))
    monkeypatch.undo()
    _assert_same_state(before, _state(cache))
    assert pop_pending_gate(0) is None and pop_pending_gate(1) is None


def test_crop_to_the_seen_length_changes_nothing(model: LlamaForCausalLM) -> None:
    """crop(seen), and a crop that keeps every admitted position, keep the solvers exactly as they are."""
    torch.manual_seed(25)
    ids = torch.randint(0, 64, (1, 3 * CHUNK + 3))
    cache, _ = _prefill(model, ids)
    assert cache.evict().n_evicted > 0
    cache.forget([2])  # a rebuild would replay the admissions without it: a different (equivalent) state
    before = _state(cache)
    cache.crop(cache.get_seq_length())
    _assert_same_state(before, _state(cache))
    cache.crop(3 * CHUNK + 1)  # drops 2 current-chunk positions, keeps every admitted one
    after = _state(cache)
    for la, lb in zip(before, after, strict=True):
        assert la[9] and len(la[9]) == len(lb[9])
        for sa, sb in zip(la[9], lb[9], strict=True):
            np.testing.assert_array_equal(sa["alpha"], sb["alpha"])
            np.testing.assert_array_equal(sa["R"], sb["R"])
            assert sa["evicted"].keys() == sb["evicted"].keys()
    assert all(layer.seen == 3 * CHUNK + 1 for layer in cache.layers)


def test_forget_after_evict_is_accepted_when_the_history_allows_it(model: LlamaForCausalLM) -> None:
    """check_removable counts the history the solver counts (active + evicted): a certified eviction never
    changes what can be deleted, and the result equals the deletion without the eviction."""
    torch.manual_seed(26)
    ids = torch.randint(0, 64, (1, 6 * CHUNK))
    plain, _ = _prefill(model, ids)
    ev, _ = _prefill(model, ids)
    ev.evict()
    s = ev.layers[0].bank.solvers[0][0]
    need = int(np.ceil(1 / ev.C))
    sv = [int(p) for p in s.ids[s.alpha > 0]]
    victims = sv[: s.n - need + 1]  # more than the active keys alone could lose
    assert s.n - len(victims) < need <= len(ev.layers[0].bank.history) - len(victims)
    rep_ev = ev.forget(victims, verify=True)
    rep_plain = plain.forget(victims, verify=True)
    assert max(r.refit_deviation for r in rep_ev.solvers) <= 1e-10
    for (_, _, a), (_, _, b) in zip(ev.layers[0].bank.each(), plain.layers[0].bank.each(), strict=True):
        hist = np.array(sorted(set(a.ids.tolist()) | set(a.evicted_ids)))
        np.testing.assert_allclose(a.alpha_of(hist), b.alpha_of(hist), atol=1e-10)
    assert max(r.refit_deviation for r in rep_plain.solvers) <= 1e-10
    # a deletion the history cannot absorb is still refused, with the cache unchanged
    snap = _state(ev)
    too_many = sorted(ev.layers[0].bank.history)[: len(ev.layers[0].bank.history) - need + 1]
    with pytest.raises(InfeasibleBoxError, match="active \\+ evicted"):
        ev.forget(too_many)
    _assert_same_state(snap, _state(ev))


def test_cache_gate_matches_the_attention_functions_own_gate_on_a_padded_batch(model: LlamaForCausalLM) -> None:
    """Cross-check against an independent solver: with the padding declared, the cache's exact gate gives
    the logits the "sv_attention" function computes with its own (batched) gate over a DynamicCache."""
    from transformers import DynamicCache

    torch.manual_seed(21)
    ids = torch.randint(1, 64, (2, 3 * CHUNK + 5))
    mask = torch.ones_like(ids)
    mask[1, :CHUNK] = 0
    cache = CertifiedCache(model.config)
    cache.set_padding(mask)
    with torch.no_grad():
        got = model(ids, attention_mask=mask, cache=cache, use_cache=True).logits
        ref = model(ids, attention_mask=mask, cache=DynamicCache(config=model.config), use_cache=True).logits
    assert float((got[0] - ref[0]).abs().max()) <= 1e-4
    assert float((got[1, CHUNK:] - ref[1, CHUNK:]).abs().max()) <= 1e-4  # the real tokens of the padded row


def test_enable_declares_a_padded_batch_to_a_fresh_cache(model: LlamaForCausalLM) -> None:
    """sv_attention.enable's pre-hook: generate with a padded mask and an undeclared CertifiedCache gives
    exactly what the explicit set_padding gives; a mask without padding declares nothing."""
    torch.manual_seed(23)
    ids = torch.randint(1, 64, (2, 2 * CHUNK + 3))
    mask = torch.ones_like(ids)
    mask[1, :CHUNK] = 0
    explicit, cache_e = _generate_evict_generate(model, ids, mask, declare=True)
    auto, cache_a = _generate_evict_generate(model, ids, mask, declare=False)
    assert cache_a.padding_declared and cache_e.padding_declared
    assert torch.equal(auto, explicit)
    for la, le in zip(cache_a.layers, cache_e.layers):
        assert la.bank.row_start == le.bank.row_start == [CHUNK, CHUNK] and la.admitted == le.admitted
    plain = CertifiedCache(model.config)
    with torch.no_grad():
        model(ids, attention_mask=torch.ones_like(ids), cache=plain, use_cache=True)
    assert not plain.padding_declared


# ---------------------------------------------------------------------------------------------- the reference
@pytest.fixture(scope="module")
def model64() -> LlamaForCausalLM:
    """The tiny Llama in fp64 (so that the cache's gate can be compared with the reference to 1e-9)."""
    torch.manual_seed(30)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    m = LlamaForCausalLM(cfg).double().eval()
    sv_attention.enable(m, "sv_attention", nu=0.5, n0=CHUNK, chunk=CHUNK)
    return m


def _tokens(kind: str, n: int, gen: torch.Generator) -> torch.Tensor:
    """Token ids ``[1, n]``: random, clustered (two alternating runs of 3 ids: clustered keys) or one id
    repeated (duplicate tokens: the keys differ only by their rotary position)."""
    if kind == "random":
        return torch.randint(1, 64, (1, n), generator=gen)
    if kind == "clustered":
        return torch.tensor([[5, 6, 7][int(x)] for x in torch.randint(0, 3, (n,), generator=gen)])[None]
    return torch.full((1, n), 9)


def _record_gates(monkeypatch: pytest.MonkeyPatch) -> list:
    import sv_attention.hf.cache as cache_mod

    seen: list = []
    orig = cache_mod.set_pending_gate

    def record(handoff):
        seen.append(handoff)
        orig(handoff)

    monkeypatch.setattr(cache_mod, "set_pending_gate", record)
    return seen


@pytest.mark.parametrize("kind", ["random", "clustered", "duplicate"])
@pytest.mark.parametrize("pad", [0, 1, CHUNK - 1, CHUNK, CHUNK + 3])
def test_a_padded_row_gives_the_logits_and_gates_of_the_sequence_alone(model64: LlamaForCausalLM,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       kind: str, pad: int) -> None:
    """Row 0 left-padded by ``pad`` (any count, not only multiples of the chunk), row 1 unpadded: row 0's
    logits equal the sequence alone, and the gate the cache deposits for each row equals the naive reference
    (``exact_gate`` per boundary on the row's real keys, bandwidth of its first chunk) to 1e-9."""
    from tests.ops.sv_gate.test_exact_path import reference_weights

    gen = torch.Generator().manual_seed(100 + pad + len(kind))
    n = 3 * CHUNK + 3
    seq = _tokens(kind, n, gen)
    ids = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), seq], 1), _tokens(kind, n + pad, gen)])
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    pid = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    gates = _record_gates(monkeypatch)
    cache = CertifiedCache(model64.config)  # enable's pre-hook declares the padding
    with torch.no_grad():
        padded = model64(ids, attention_mask=mask, position_ids=pid, cache=cache, use_cache=True).logits
    assert cache.padding_declared == (pad > 0)
    monkeypatch.undo()
    _, alone = _prefill(model64, seq)
    assert float((padded[0, pad:] - alone[0]).abs().max()) <= 1e-9
    C = cache.C
    for li, layer in enumerate(cache.layers):
        w = gates[li].weights  # [b, kv-heads, q, slots]
        for row in range(2):
            real = np.flatnonzero(mask[row].numpy())
            for j in range(w.shape[1]):
                ref = reference_weights(layer.keys[row, j, real].numpy(), C, CHUNK)
                got = w[row, j][real][:, real].numpy()
                causal = np.tril(np.ones_like(ref)) > 0
                assert np.abs(np.where(causal, got - ref, 0.0)).max() <= 1e-9, (li, row, j)


def test_generate_with_the_cache_equals_generate_without_it(model64: LlamaForCausalLM) -> None:
    """A batch padded by 0, 1, chunk - 1 and chunk + 3: greedy generate through the certified cache (eviction
    in the middle) gives the tokens of generate with the model's DynamicCache, and each padded row the tokens
    of its sequence alone."""
    gen = torch.Generator().manual_seed(31)
    pads = [0, 1, CHUNK - 1, CHUNK + 3]
    L = 2 * CHUNK + 5 + max(pads)
    ids = torch.randint(1, 64, (len(pads), L), generator=gen)
    mask = torch.ones_like(ids)
    for i, p in enumerate(pads):
        ids[i, :p] = 0
        mask[i, :p] = 0
    plain = model64.generate(ids, attention_mask=mask, max_new_tokens=CHUNK + 4, do_sample=False)
    cache = CertifiedCache(model64.config)
    first = model64.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=4, do_sample=False)
    assert cache.evict().max_evicted_alpha == 0.0
    mask2 = torch.cat([mask, torch.ones(len(pads), 4, dtype=torch.long)], 1)
    out = model64.generate(first, attention_mask=mask2, cache=cache, max_new_tokens=CHUNK, do_sample=False)
    assert torch.equal(out, plain)
    for i, p in enumerate(pads):
        alone = model64.generate(ids[i:i + 1, p:], cache=CertifiedCache(model64.config), max_new_tokens=CHUNK + 4,
                                 do_sample=False)
        assert torch.equal(out[i:i + 1, p:], alone)


# ---------------------------------------------------------------------------------------------- policies
def _padded_cache(model: LlamaForCausalLM, policy: str, pad: int = 3) -> tuple[CertifiedCache, torch.Tensor,
                                                                                 torch.Tensor]:
    """A two-row prefill, row 1 left-padded by ``pad``, padding declared; returns the cache, ids and mask."""
    gen = torch.Generator().manual_seed(40)
    ids = torch.randint(1, 64, (2, 4 * CHUNK + 3), generator=gen)
    ids[1, :pad] = 0
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    cache = CertifiedCache(model.config, policy=policy)
    pid = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=pid, cache=cache, use_cache=True)
    return cache, ids, mask


def _local_positions(layer, mask: torch.Tensor) -> set[int]:
    """Slots some row holds as a real token beyond its admitted boundary (counted in real positions)."""
    out = set()
    for row in range(mask.shape[0]):
        real = np.flatnonzero(np.concatenate([mask[row].numpy(), np.ones(layer.seen - mask.shape[1], dtype=int)]))
        out |= {int(p) for r, p in enumerate(real) if r >= layer.admitted[row]}
    return out & set(layer.positions.tolist())


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_respects_the_budget_and_its_receipt_is_honest(model: LlamaForCausalLM, policy: str) -> None:
    cache, ids, mask = _padded_cache(model, policy)
    twin, _, _ = _padded_cache(model, "certified")
    budget = 2 * CHUNK
    before = []
    for layer in cache.layers:
        alpha = {i: layer.bank.alpha_row(i, layer.seen) for i in range(2)}  # what each row reads now
        before.append((set(layer.positions.tolist()), _local_positions(layer, mask), alpha))
    mem0 = cache.memory_bytes()
    rep = cache.evict(budget=budget)
    assert rep.certified == (policy == "certified") and all(le.policy == policy for le in rep.layers)
    assert rep.budget_met == all(le.n_slots_after <= budget for le in rep.layers)
    for layer, le, (slots, local, alpha) in zip(cache.layers, rep.layers, before, strict=True):
        gone = set(le.evicted_positions)
        assert le.n_slots_after == layer.n_slots == len(slots) - len(gone) and gone <= slots
        assert not gone & set(layer.positions.tolist()) and not gone & local  # the current chunks stay
        assert le.n_local == len(local)
        cand = len(slots) - len(local)
        if policy == "certified":
            assert le.max_evicted_alpha == 0.0
            support = {p for p in slots - local
                       if any(alpha[i][:, p].max() > 0 for i in range(2) if mask[i, p] if p < mask.shape[1])}
            assert le.n_slots_after == len(local) + min(cand, max(len(support), budget - len(local)))
        else:
            assert le.n_slots_after == len(local) + min(cand, max(0, budget - len(local)))
            held = [float(alpha[i][:, p].max()) for p in gone for i in range(2) if p >= mask.shape[1] or mask[i, p]]
            assert le.max_evicted_alpha == max(held, default=0.0)
            assert not le.certified and "without a certificate" in le.reason
    if rep.n_evicted:
        assert cache.memory_bytes() < mem0
    assert cache.certificate()["exact"] == (policy == "certified" or rep.n_evicted == 0)
    # the cache keeps decoding; the certified policy's next logits equal those of the un-evicted twin
    tok = torch.randint(1, 64, (2, 1))
    m2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    got, ref = _step(model, cache, tok, attention_mask=m2), _step(model, twin, tok, attention_mask=m2)
    assert cache.get_seq_length() == twin.get_seq_length() and torch.isfinite(got).all()
    if policy == "certified":
        assert float((got - ref).abs().max()) <= 1e-5


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_refuses_bad_budgets_and_leaves_the_cache_unchanged(model: LlamaForCausalLM,
                                                                         policy: str) -> None:
    cache, _, _ = _padded_cache(model, policy)
    snap = _state(cache)
    bad: list = [2.5, -1, True, "8"]
    if policy == "certified":
        bad.append(cache.warmup_size - 1)  # no certificate exists for fewer keys
    else:
        bad.append(None)  # only the certified policy knows which tokens are inert
    for budget in bad:
        with pytest.raises(InvalidInputError):
            cache.evict(budget=budget)
    _assert_same_state(snap, _state(cache))
    assert pop_pending_gate(0) is None


def test_the_policy_argument_is_checked() -> None:
    from sv_attention.errors import ConfigError
    from sv_attention.hf.policies import CertifiedPolicy, RecencyPolicy

    assert isinstance(CertifiedCache(num_layers=1).policy, CertifiedPolicy)
    mine = RecencyPolicy()
    assert CertifiedCache(num_layers=1, policy=mine).policy is mine
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        CertifiedCache(num_layers=1, policy="lru")
    with pytest.raises(InvalidInputError, match="EvictionPolicy"):
        CertifiedCache(num_layers=1, policy=3)


def test_h2o_keeps_the_tokens_with_the_most_attention_mass(model: LlamaForCausalLM) -> None:
    """The heavy-hitter score: causal softmax mass each slot receives, the layer's keys standing in for the
    queries (the cache never sees them), summed over kv-heads (loop reference)."""
    torch.manual_seed(41)
    cache, _ = _prefill(model, torch.randint(0, 64, (1, 4 * CHUNK + 2)), policy="h2o")
    layer = cache.layers[0]
    keys = layer.keys[0].double().numpy()
    pos = layer.positions.tolist()
    mass = np.zeros(len(pos))
    for j in range(keys.shape[0]):
        for t in range(len(pos)):
            logits = keys[j, : t + 1] @ keys[j, t] / np.sqrt(keys.shape[-1])
            w = np.exp(logits - logits.max())
            mass[: t + 1] += w / w.sum()
    cand = [k for k, p in enumerate(pos) if p < layer.admitted[0]]
    budget = 2 * CHUNK
    keep_n = budget - (len(pos) - len(cand))
    order = sorted(cand, key=lambda k: (-mass[k], -pos[k]))
    expect_gone = {pos[k] for k in order[keep_n:]}
    rep = cache.evict(budget=budget)
    assert set(rep.layers[0].evicted_positions) == expect_gone


# ---------------------------------------------------------------------------------------------- padded deletion / crop
def _padded_step(model: LlamaForCausalLM, cache: CertifiedCache, tok: torch.Tensor, mask: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of a padded batch (mask over every position so far): logits, the extended mask."""
    mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=torch.long)], 1)
    pid = mask.sum(-1, keepdim=True) - 1
    with torch.no_grad():
        out = model(tok, attention_mask=mask, position_ids=pid, cache=cache, use_cache=True).logits
    return out, mask


def test_forget_in_a_padded_batch_equals_forgetting_in_each_sequence_alone(model: LlamaForCausalLM) -> None:
    """Row 1 is padded by 3, so a position can be admitted in row 0 and still in row 1's current chunk: the
    receipt says both paths, and each row then decodes what its sequence alone decodes after the same
    deletion (the exact decrement in row 0, the local path in row 1), across later boundaries."""
    pad = 3
    cache, ids, mask = _padded_cache(model, "certified", pad)
    victim = 4 * CHUNK - 4  # row 0: real position 28 < its boundary 32; row 1: real 25 >= its boundary 24
    assert cache.layers[0].admitted == [4 * CHUNK, 3 * CHUNK]
    rep = cache.forget([victim], verify=True)
    assert rep.paths[victim].startswith(PATH_EXACT) and PATH_LOCAL in rep.paths[victim]
    assert rep.max_refit_deviation < 1e-8
    alone = []
    for row, p in ((0, 0), (1, pad)):
        c, _ = _prefill(model, ids[row:row + 1, p:])
        r = c.forget([victim - p])
        assert r.paths == {victim - p: PATH_EXACT if row == 0 else PATH_LOCAL}
        alone.append(c)
    gen = torch.Generator().manual_seed(42)
    worst = 0.0
    for _ in range(CHUNK + 2):
        tok = torch.randint(1, 64, (2, 1), generator=gen)
        got, mask = _padded_step(model, cache, tok, mask)
        for row in range(2):
            worst = max(worst, float((got[row] - _step(model, alone[row], tok[row:row + 1])[0]).abs().max()))
    assert worst <= 1e-5


def test_crop_of_a_padded_batch_equals_a_cache_that_saw_the_shorter_prefix(model: LlamaForCausalLM) -> None:
    """crop moves each row's boundary back by its own real positions (row 1 padded by 3); the rebuilt solvers
    equal those of a cache that only saw the kept positions, and so do the next logits."""
    pad = 3
    cache, ids, mask = _padded_cache(model, "certified", pad)
    assert cache.evict().n_evicted > 0
    keep = 3 * CHUNK + 2  # row 0 goes back to boundary 24, row 1 (real 23) to 16
    cache.crop(keep)
    short = CertifiedCache(model.config)
    m = mask[:, :keep]
    with torch.no_grad():
        model(ids[:, :keep], attention_mask=m, position_ids=(m.cumsum(-1) - 1).masked_fill(m == 0, 1), cache=short,
              use_cache=True)
    for la, lb in zip(cache.layers, short.layers, strict=True):
        assert la.admitted == lb.admitted == [3 * CHUNK, 2 * CHUNK]
        assert la.bank.row_history == lb.bank.row_history
        for (_, _, sa), (_, _, sb) in zip(la.bank.each(), lb.bank.each(), strict=True):
            hist = np.array(sorted(set(sa.ids.tolist()) | set(sa.evicted_ids)))
            np.testing.assert_allclose(sa.alpha_of(hist), sb.alpha_of(hist), atol=1e-9)
    tok = torch.randint(1, 64, (2, 1), generator=torch.Generator().manual_seed(43))
    a, _ = _padded_step(model, cache, tok, m)
    b, _ = _padded_step(model, short, tok, m)
    assert float((a - b).abs().max()) <= 1e-5
