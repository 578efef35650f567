"""torch.compile: ceq prefill and decode trace to one graph (fullgraph=True, 0 graph breaks). sv_attention
without autograd traces to one graph too: each layer call is one opaque operator node
(``torch.ops.sv_attention.layer_call``, the gate fit running eagerly inside it), so the target of at most one
graph break per layer holds with none; with autograd it breaks only at its one ``torch.compiler.disable``
boundary. Compiled outputs (eager backend and inductor) equal eager ones, decoding state included."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import sv_attention
from sv_attention.hf.attention import STATE_ATTR, reset_state, sv_attention_forward
from sv_attention.ops.sv_gate import GateState

from . import tiny

IDS = torch.randint(1, 97, (1, 12), generator=torch.Generator().manual_seed(7))
#: Wall-clock budget (s) of the inductor test (prefill + 4 decode steps, two compilations) on a 2-core CPU:
#: measured 27-40 s with an empty inductor cache, 8 s with a warm one.
INDUCTOR_BUDGET_S = 180.0


def _explain(fn, *args):
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch._dynamo.explain(fn)(*args)


def _explain_with_grad(fn, *args):
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch._dynamo.explain(fn)(*args)


def _operator_nodes(explained) -> int:
    op = torch.ops.sv_attention.layer_call.default
    return sum(t is op for ops in explained.ops_per_graph for t in ops)


def _sv_llama():
    m = tiny.llama()
    sv_attention.enable(m, "sv_attention", nu=0.5, chunk=4)
    return m


def _prefill_then_decode(step, m, prompt: int = 8) -> torch.Tensor:
    """Logits ``[1, 12, vocab]`` of a prefill of ``prompt`` tokens and one-token decode steps through ``step``."""
    from transformers import DynamicCache

    reset_state(m)
    cache = DynamicCache(config=m.config)
    with torch.no_grad():
        out = [step(IDS[:, :prompt], cache)]
        out += [step(IDS[:, t:t + 1], cache) for t in range(prompt, IDS.shape[1])]
    return torch.cat(out, 1)


def test_ceq_prefill_and_decode_have_no_graph_break_and_compile_fullgraph():
    from transformers import DynamicCache

    m = tiny.llama()
    sv_attention.enable(m, "ceq", path_weight=0.05)
    with torch.no_grad():
        m(IDS, use_cache=False)  # settings resolved and checked once, eagerly
    assert _explain(lambda x: m(x, use_cache=False).logits, IDS).graph_break_count == 0
    assert _explain(lambda x, c: m(x, cache=c, use_cache=True).logits, IDS,
                    DynamicCache(config=m.config)).graph_break_count == 0
    with torch.no_grad():
        ref_cache = DynamicCache(config=m.config)
        ref_pre = m(IDS[:, :8], cache=ref_cache, use_cache=True).logits
        ref_dec = [m(IDS[:, t:t + 1], cache=ref_cache, use_cache=True).logits for t in range(8, 11)]
    cache = DynamicCache(config=m.config)
    with torch.no_grad():
        m(IDS[:, :8], cache=cache, use_cache=True)
    assert _explain(lambda x, c: m(x, cache=c, use_cache=True).logits, IDS[:, 8:9], cache).graph_break_count == 0
    torch._dynamo.reset()
    step = torch.compile(lambda x, c: m(x, cache=c, use_cache=True).logits, fullgraph=True, backend="eager")
    cache = DynamicCache(config=m.config)
    with torch.no_grad():
        pre = step(IDS[:, :8], cache)
        dec = [step(IDS[:, t:t + 1], cache) for t in range(8, 11)]
    assert (pre - ref_pre).abs().max() <= 1e-5
    assert all((a - b).abs().max() <= 1e-5 for a, b in zip(dec, ref_dec))


def test_sv_attention_prefill_and_decode_break_at_most_once_per_layer():
    from transformers import DynamicCache

    m = _sv_llama()
    n_layers = m.config.num_hidden_layers
    cases = {"prefill": (lambda x: m(x, use_cache=False).logits, (IDS,)),
             "prefill+cache": (lambda x, c: m(x, cache=c, use_cache=True).logits,
                               (IDS[:, :8], DynamicCache(config=m.config)))}
    cache = DynamicCache(config=m.config)
    with torch.no_grad():
        m(IDS[:, :8], cache=cache, use_cache=True)  # a filled cache and a decoding state on every layer
    cases["decode"] = (lambda x, c: m(x, cache=c, use_cache=True).logits, (IDS[:, 8:9], cache))
    for name, (fn, args) in cases.items():
        e = _explain(fn, *args)
        assert e.graph_break_count <= n_layers, (name, [r.reason for r in e.break_reasons])
        assert e.graph_break_count == 0, (name, [r.reason for r in e.break_reasons])  # one graph, no break at all
        assert _operator_nodes(e) == n_layers, name  # each layer call is one opaque operator node
    state = m.model.layers[0].self_attn.__dict__[STATE_ATTR]
    assert isinstance(state, GateState) and state.fingerprint.shape[-1] == 9  # the traced decode step ran, kept state
    m.set_attn_implementation("sdpa")  # the model's own path has no break either: none is inherent in transformers
    assert _explain(cases["prefill"][0], IDS).graph_break_count == 0


def test_sv_attention_compiled_prefill_and_decode_equal_eager():
    m = _sv_llama()
    ref = _prefill_then_decode(lambda x, c: m(x, cache=c, use_cache=True).logits, m)
    with torch.no_grad():
        ref_full = m(IDS, use_cache=False).logits
    torch._dynamo.reset()
    step = torch.compile(lambda x, c: m(x, cache=c, use_cache=True).logits, fullgraph=True, backend="eager")
    full = torch.compile(lambda x: m(x, use_cache=False).logits, fullgraph=True, backend="eager")
    out = _prefill_then_decode(step, m)
    with torch.no_grad():
        out_full = full(IDS)
    assert torch.equal(out, ref)  # the same eager computation inside the operator, decoding state included
    assert torch.equal(out_full, ref_full)
    assert (ref - ref_full).abs().max() <= 1e-5  # and the cached decode is the recomputation


@pytest.mark.filterwarnings("ignore:sv_attention on sliding-window layers")
def test_sv_attention_compiled_padding_window_and_weights_equal_eager():
    """Qwen2 with a sliding-window layer, a left-padded batch and output_attentions, compiled fullgraph."""
    m = tiny.qwen2_sliding()
    sv_attention.enable(m, "sv_attention", chunk=4)
    ids = torch.randint(1, 97, (2, 14), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1, :3] = 0

    def fn(x, am):
        out = m(x, attention_mask=am, use_cache=False, output_attentions=True)
        return out.logits, out.attentions

    with torch.no_grad():
        ref_logits, ref_w = fn(ids, mask)
        e = _explain(fn, ids, mask)
        torch._dynamo.reset()
        logits, w = torch.compile(fn, fullgraph=True, backend="eager")(ids, mask)
    assert e.graph_break_count == 0 and _operator_nodes(e) == m.config.num_hidden_layers
    assert torch.equal(logits, ref_logits)
    assert len(w) == len(ref_w) == 2 and all(torch.equal(a, b) for a, b in zip(w, ref_w))


def test_one_compiled_function_keeps_each_modules_state_apart():
    """The operator finds its module by identity (the trace guards on it): two modules calling the same
    compiled function keep their own decoding state, and each equals its eager twin."""

    class Mod(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("Cfg", (), {"sv_attention": {"chunk": 4}})()
            self.is_causal, self.layer_idx, self.sliding_window = True, 0, None
            self.eval()

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=gen) for _ in range(3))
    fn = torch.compile(lambda mod, q_, k_, v_: sv_attention_forward(mod, q_, k_, v_, None)[0], fullgraph=True,
                       backend="eager")
    eager, compiled = [Mod(), Mod()], [Mod(), Mod()]
    torch._dynamo.reset()
    with torch.no_grad():
        for i, (me, mc) in enumerate(zip(eager, compiled)):
            s = 1.0 + i  # the two modules see different keys
            ref = sv_attention_forward(me, q[:, :, :10], s * k[:, :, :10], v[:, :, :10], None)[0]
            assert torch.equal(fn(mc, q[:, :, :10], s * k[:, :, :10], v[:, :, :10]), ref)
        for i, (me, mc) in enumerate(zip(eager, compiled)):
            s = 1.0 + i
            ref = sv_attention_forward(me, q[:, :, 10:11], s * k[:, :, :11], v[:, :, :11], None)[0]
            assert torch.equal(fn(mc, q[:, :, 10:11], s * k[:, :, :11], v[:, :, :11]), ref)
    for me, mc in zip(eager, compiled):
        assert torch.equal(mc.__dict__[STATE_ATTR].fingerprint, me.__dict__[STATE_ATTR].fingerprint)
    assert not torch.equal(compiled[0].__dict__[STATE_ATTR].fingerprint, compiled[1].__dict__[STATE_ATTR].fingerprint)


def test_sv_attention_with_autograd_breaks_only_at_its_one_boundary_and_gradients_match():
    m = _sv_llama()
    m.train()
    e = _explain_with_grad(lambda x: m(x, use_cache=False).logits, IDS)
    sites = {(r.user_stack[-1].filename, r.user_stack[-1].lineno) for r in e.break_reasons}
    assert e.break_reasons and all("disable()" in r.reason for r in e.break_reasons), [r.reason for r in e.break_reasons]
    assert len(sites) == 1  # the one call of the eager boundary in sv_attention.hf.attention.compiled_call
    assert _operator_nodes(e) == 0
    ref = m(IDS, use_cache=False).logits
    ref.square().sum().backward()
    ref_grad = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    torch._dynamo.reset()
    out = torch.compile(lambda x: m(x, use_cache=False).logits, backend="eager")(IDS)
    out.square().sum().backward()
    assert torch.equal(out, ref)
    assert ref_grad and all(torch.allclose(p.grad, ref_grad[n], atol=1e-6) for n, p in m.named_parameters()
                            if n in ref_grad)


@pytest.mark.slow
def test_sv_attention_inductor_compiles_prefill_and_decode_within_budget():
    m = _sv_llama()
    ref = _prefill_then_decode(lambda x, c: m(x, cache=c, use_cache=True).logits, m)
    torch._dynamo.reset()
    step = torch.compile(lambda x, c: m(x, cache=c, use_cache=True).logits)  # default backend: inductor
    t0 = time.perf_counter()
    out = _prefill_then_decode(step, m)
    elapsed = time.perf_counter() - t0
    assert elapsed <= INDUCTOR_BUDGET_S, f"inductor compile + run took {elapsed:.1f} s"
    assert (out - ref).abs().max() <= 1e-4
