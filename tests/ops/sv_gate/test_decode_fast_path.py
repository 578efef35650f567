"""The decode fast path of the causal gate (ops/sv_gate/gate.py, issue #17): a decode step whose gate is already
in the state is served from the state's DecodeCache; it must be taken (counted ``decode_fast_path``) and return
exactly what the general path returns (``DECODE_FAST_PATH = False``): the log-bias (dense, and its factored
table, slots and key positions), the bandwidth, the alphas and the state, bit for bit. Op level (unpadded, left-padded, floors, fixed bandwidth, warm-up, crops, the
exact solver) and through the plug-in (Llama, left-padded batches, a cache crop, sliding-window layers)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

import sv_attention
from sv_attention.ops.settings import SVSettings
from sv_attention.ops.sv_gate import attention as attention_mod
from sv_attention.ops.sv_gate import gate as gate_mod
from sv_attention.ops.sv_gate import gate_stats
from sv_attention.ops.sv_gate.gate import Gate, GateBias, causal_gate
from sv_attention.ops.sv_gate.state import GateState

from ...hf import tiny

CHUNK = 4
SETTINGS = SVSettings(chunk=CHUNK, nu=0.5)


# ---------------------------------------------------------------------------------------------- helpers
def fast_count() -> int:
    return gate_stats().get("decode_fast_path", 0)


def snapshot(gate: Gate) -> dict:
    """Everything a call returns, copied (the state is updated in place by later calls)."""
    bias = gate.bias
    dense = bias.dense() if isinstance(bias, GateBias) else bias
    st = gate.state
    return {
        "bias": None if dense is None else dense.clone(),
        "factored": None if not isinstance(bias, GateBias) else
        {"log_table": bias.log_table.clone(), "slot": bias.slot.clone(), "key_position": bias.key_position.clone()},
        "sigma": None if gate.sigma is None else gate.sigma.clone(),
        "alphas": {s: a.clone() for s, a in gate.alphas.items()},
        "state": None if st is None else state_snapshot(st),
    }


def state_snapshot(st: GateState) -> dict:
    return {"batch": st.batch, "kv_heads": st.kv_heads, "fingerprint": st.fingerprint.clone(),
            "sigma": st.sigma.clone(), "gates": {s: a.clone() for s, a in st.gates.items()},
            "done": {s: f.clone() for s, f in st.done.items()},
            "exact_ingested": None if st.exact_ingested is None else list(st.exact_ingested),
            "exact": st.exact is not None}


def assert_same(a, b, where: str = "") -> None:
    """Exact equality (NaN equal to NaN) of nested snapshots."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, where
        assert torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0)), \
            f"{where}: max diff {(a - b).abs().nan_to_num(0.0).max()}"
        assert torch.equal(torch.isnan(a), torch.isnan(b)), where
    else:
        assert a == b, f"{where}: {a} != {b}"


def both_paths(run: Callable[[], list], monkeypatch) -> tuple[list, list, int]:
    """``run()`` with the fast path on and off: (results on, results off, fast steps taken when on)."""
    monkeypatch.setattr(gate_mod, "DECODE_FAST_PATH", True)
    before = fast_count()
    on = run()
    taken = fast_count() - before
    monkeypatch.setattr(gate_mod, "DECODE_FAST_PATH", False)
    before = fast_count()
    off = run()
    assert fast_count() == before  # off means off
    return on, off, taken


def padded_keys(b: int, g: int, n: int, d: int, pads: list[int], dtype: torch.dtype,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[b, g, n, d]`` and validity ``[b, n]`` (sequence ``i`` left-padded with ``pads[i]`` junk columns)."""
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(b, g, n, d, generator=gen, dtype=dtype)
    valid = torch.ones(b, n, dtype=torch.bool)
    for i, p in enumerate(pads):
        valid[i, :p] = False
    return key, valid


def decode_calls(key: torch.Tensor, valid: torch.Tensor, settings: SVSettings, prompt: int,
                 crop: tuple[int, int] | None = None) -> list[dict]:
    """A prefill of ``prompt`` columns then one column per call with the kept state; ``crop=(at, to)``: after
    column ``at``, continue from ``to`` columns (a cache crop). Returns every call's snapshot."""
    b, _, n, _ = key.shape
    cols = list(range(prompt + 1, n + 1))
    if crop is not None:
        at, to = crop
        cols = [c for c in cols if c <= at] + list(range(to + 1, n + 1))
    out = []
    vis = valid[:, None, :prompt] & torch.ones(prompt, prompt, dtype=torch.bool).tril()
    res = causal_gate(key[:, :, :prompt], vis, settings, keep_state=True)
    out.append(snapshot(res))
    state = res.state
    for c in cols:
        res = causal_gate(key[:, :, :c], valid[:, None, :c], settings, state=state, keep_state=True)
        state = res.state
        out.append(snapshot(res))
    return out


# ---------------------------------------------------------------------------------------------- op level
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("pads", [[0], [0, 0], [0, 3], [5, 0, 2]])
def test_decode_steps_equal_the_general_path(dtype, pads, monkeypatch):
    key, valid = padded_keys(len(pads), 2, 30, 5, pads, dtype, seed=len(pads) + sum(pads))
    on, off, taken = both_paths(lambda: decode_calls(key, valid, SETTINGS, 9), monkeypatch)
    assert len(on) == len(off)
    for i, (a, b) in enumerate(zip(on, off)):
        assert_same(a, b, f"call {i}")
    # a step is served from the state unless some sequence's query sits on a boundary (a new gate to fit)
    positions = [[c - 1 - p for p in pads] for c in range(10, 31)]
    crossing = [any(t % CHUNK == 0 and t >= CHUNK for t in pos) for pos in positions]
    assert taken == crossing.count(False)


@pytest.mark.parametrize("headroom", [1, 3])
def test_buffers_grown_past_their_headroom_equal_the_general_path(headroom, monkeypatch):
    """Warm-up keeps the steps on the fast path for many columns: its buffers are grown on demand."""
    monkeypatch.setattr(gate_mod, "DECODE_HEADROOM", headroom)
    settings = SETTINGS.replace(n0=16)  # warm-up 10 keys: boundaries 4 and 8 are not gated
    key, valid = padded_keys(2, 2, 24, 4, [0, 5], torch.float64, seed=9)
    on, off, taken = both_paths(lambda: decode_calls(key, valid, settings, 3), monkeypatch)
    for i, (a, b) in enumerate(zip(on, off)):
        assert_same(a, b, f"call {i}")
    assert taken >= 8


@pytest.mark.parametrize("knobs", [{"gate_floor": 0.05}, {"sigma": 1.3}, {"nu": 0.2, "chunk": 3},
                                   {"solver": "exact"}])
def test_settings_variants_equal_the_general_path(knobs, monkeypatch):
    settings = SETTINGS.replace(**knobs)
    key, valid = padded_keys(2, 2, 26, 4, [0, 2], torch.float64, seed=3)
    on, off, taken = both_paths(lambda: decode_calls(key, valid, settings, 7), monkeypatch)
    for i, (a, b) in enumerate(zip(on, off)):
        assert_same(a, b, f"call {i}")
    assert taken > 0


def test_warm_up_steps_take_the_fast_path_without_a_gate(monkeypatch):
    """A prompt inside chunk 0: the steps return no bias (as the general path) and still skip its bookkeeping."""
    key, valid = padded_keys(1, 2, 12, 4, [0], torch.float64, seed=4)
    on, off, taken = both_paths(lambda: decode_calls(key, valid, SETTINGS, 2), monkeypatch)
    for i, (a, b) in enumerate(zip(on, off)):
        assert_same(a, b, f"call {i}")
    assert on[1]["bias"] is None and taken >= 2


@pytest.mark.parametrize("crop", [(20, 14), (20, 12), (21, 6)])
def test_a_crop_equals_the_general_path(crop, monkeypatch):
    """A crop (fewer columns than the state saw) goes through the general path, then decoding is fast again."""
    key, valid = padded_keys(2, 2, 30, 4, [0, 1], torch.float64, seed=5)
    on, off, taken = both_paths(lambda: decode_calls(key, valid, SETTINGS, 9, crop=crop), monkeypatch)
    for i, (a, b) in enumerate(zip(on, off)):
        assert_same(a, b, f"call {i}")
    assert taken > 0


def test_changed_keys_or_validity_take_the_general_path(monkeypatch):
    """Another conversation in the same state (different keys), a padding change: never served from the cache."""
    monkeypatch.setattr(gate_mod, "DECODE_FAST_PATH", True)
    key, valid = padded_keys(1, 2, 16, 4, [0], torch.float64, seed=6)
    vis = torch.ones(1, 10, 10, dtype=torch.bool).tril()
    state = causal_gate(key[:, :, :10], vis, SETTINGS, keep_state=True).state
    other = key.clone()
    other[:, :, 3] += 1.0  # an old column changed
    before = fast_count()
    got = causal_gate(other[:, :, :11], valid[:, None, :11], SETTINGS, state=state, keep_state=True)
    assert fast_count() == before
    ref = causal_gate(other[:, :, :11], valid[:, None, :11], SETTINGS, keep_state=True)
    assert_same(snapshot(got), snapshot(ref))
    # an old column now invisible (not a plain decode step)
    state = causal_gate(key[:, :, :10], vis, SETTINGS, keep_state=True).state
    hidden = valid[:, None, :11].clone()
    hidden[:, :, 0] = False
    monkeypatch.setattr(gate_mod, "DECODE_FAST_PATH", False)
    ref_state = causal_gate(key[:, :, :10], vis, SETTINGS, keep_state=True).state
    ref = causal_gate(key[:, :, :11], hidden, SETTINGS, state=ref_state, keep_state=True)
    monkeypatch.setattr(gate_mod, "DECODE_FAST_PATH", True)
    before = fast_count()
    got = causal_gate(key[:, :, :11], hidden, SETTINGS, state=state, keep_state=True)
    assert fast_count() == before
    assert_same(snapshot(got), snapshot(ref))


def test_the_readouts_give_the_same_attention(monkeypatch):
    """Sequences reading different boundaries (left padding): the fused readout of the fast path's bias equals the
    general path's bit for bit, and the explicit readout of its dense bias."""
    from sv_attention.ops.sv_gate.fused import fused_gated_sdpa
    from sv_attention.ops.sv_gate.readout import grouped_attention

    key, valid = padded_keys(2, 2, 15, 4, [0, 3], torch.float64, seed=7)
    gen = torch.Generator().manual_seed(8)
    query = torch.randn(2, 4, 1, 4, generator=gen, dtype=torch.float64)
    value = torch.randn(2, 2, 15, 4, generator=gen, dtype=torch.float64)
    vis = valid[:, None, :14] & torch.ones(14, 14, dtype=torch.bool).tril()
    gates = {}
    for fast in (True, False):
        monkeypatch.setattr(gate_mod, "DECODE_FAST_PATH", fast)
        state = causal_gate(key[:, :, :14], vis, SETTINGS, keep_state=True).state
        before = fast_count()
        gates[fast] = causal_gate(key, valid[:, None], SETTINGS, state=state, keep_state=True)
        assert fast_count() == before + fast
    assert sorted(gates[True].alphas) == [8, 12]  # the two sequences read different boundaries
    outs = {fast: fused_gated_sdpa(query, key, value, valid[:, None], gate.bias, 0.5) for fast, gate in gates.items()}
    assert torch.equal(outs[True], outs[False])
    ref, _ = grouped_attention(query, key, value, valid[:, None], gates[True].bias.dense(), 0.5)
    assert (outs[True] - ref).abs().max() <= 1e-12


# ---------------------------------------------------------------------------------------------- the plug-in
def recorded_decode(model, ids: torch.Tensor, prompt: int, attention_mask: torch.Tensor | None = None,
                    crop: tuple[int, int] | None = None) -> tuple[torch.Tensor, list[dict]]:
    """Logits of a prefill of ``prompt`` tokens then token-by-token (teacher-forced) decoding of ``ids`` with a
    DynamicCache (``crop=(at, to)``: after ``at`` tokens, crop the cache to ``to`` and continue from there), and
    the snapshot of every causal gate call."""
    from transformers import DynamicCache

    calls: list[dict] = []
    original = attention_mod.causal_gate

    def recording(*args, **kwargs):
        gate = original(*args, **kwargs)
        calls.append(snapshot(gate))
        return gate

    attention_mod.causal_gate = recording
    try:
        cache = DynamicCache(config=model.config)
        spans = [(0, prompt)] + [(t, t + 1) for t in range(prompt, ids.shape[1])]
        if crop is not None:
            at, to = crop
            spans = [sp for sp in spans if sp[1] <= at] + [(t, t + 1) for t in range(to, ids.shape[1])]
        out = []
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for t0, t1 in spans:
                if crop is not None and t0 == crop[1] and t1 == t0 + 1:
                    cache.crop(crop[1] - crop[0])  # drop the last at - to tokens
                kw = {} if attention_mask is None else {"attention_mask": attention_mask[:, :t1]}
                out.append(model(ids[:, t0:t1], cache=cache, use_cache=True, **kw).logits)
    finally:
        attention_mod.causal_gate = original
    return torch.cat(out, 1), calls


def plugin_paths(make, ids, prompt, monkeypatch, **kw) -> int:
    """Decode with the fast path on and off; assert equal logits and equal gate calls; return the fast steps."""
    m = make()
    sv_attention.enable(m, "sv_attention", nu=0.5, chunk=CHUNK)
    (logits_on, calls_on), (logits_off, calls_off), taken = both_paths(
        lambda: recorded_decode(m, ids, prompt, **kw), monkeypatch)
    assert torch.equal(logits_on, logits_off)
    assert len(calls_on) == len(calls_off)
    for i, (a, b) in enumerate(zip(calls_on, calls_off)):
        assert_same(a, b, f"call {i}")
    return taken


IDS = torch.randint(1, tiny.VOCAB, (2, 19), generator=torch.Generator().manual_seed(11))


def test_plugin_llama_decode_is_fast_and_equal(monkeypatch):
    taken = plugin_paths(tiny.llama, IDS, 6, monkeypatch)
    # 13 steps at positions 6..18, of which 8, 12, 16 cross a boundary; two layers
    assert taken == 2 * (13 - 3)


def test_plugin_left_padded_batch(monkeypatch):
    mask = torch.ones(2, IDS.shape[1], dtype=torch.long)
    mask[1, :3] = 0
    assert plugin_paths(tiny.llama, IDS, 7, monkeypatch, attention_mask=mask) > 0


@pytest.mark.parametrize("crop", [(15, 11), (16, 8)])
def test_plugin_cache_crop(crop, monkeypatch):
    assert plugin_paths(tiny.llama, IDS, 6, monkeypatch, crop=crop) > 0


@pytest.mark.parametrize("arch,window", [("mistral", 64), ("mistral", 5), ("qwen2", 64), ("qwen2", 6),
                                         ("gemma3", 64), ("gemma3", 5)])
def test_plugin_sliding_window_layers(arch, window, monkeypatch):
    make = {"mistral": lambda: tiny.mistral(sliding_window=window),
            "qwen2": lambda: tiny.qwen2_sliding(window=window),
            "gemma3": lambda: tiny.gemma3(window=window)}[arch]
    taken = plugin_paths(make, IDS[:, :16], 3, monkeypatch)
    if window == 64 or arch != "mistral":  # a window covering every key (or a full-attention layer) is fast
        assert taken > 0
