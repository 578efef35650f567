"""torch.compile: ceq prefill and decode trace to one graph (fullgraph=True, 0 graph breaks); sv_attention
breaks only at the solver boundary (the gate fit, run eagerly); compiled outputs equal eager ones."""

from __future__ import annotations

import warnings

import torch

import sv_attention

from . import tiny

IDS = torch.randint(1, 97, (1, 12), generator=torch.Generator().manual_seed(7))


def _explain(fn, *args):
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch._dynamo.explain(fn)(*args)


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


def test_sv_attention_breaks_only_at_the_solver_boundary():
    m = tiny.llama()
    sv_attention.enable(m, "sv_attention", nu=0.5, chunk=4)
    with torch.no_grad():
        ref = m(IDS, use_cache=False).logits
    e = _explain(lambda x: m(x, use_cache=False).logits, IDS)
    sites = {(r.user_stack[-1].filename, r.user_stack[-1].lineno) for r in e.break_reasons}
    assert all("disable()" in r.reason for r in e.break_reasons), [r.reason for r in e.break_reasons]
    assert len(sites) <= 1  # the one call of the gate fit in sv_gate_attention (per layer call)
    assert len(e.break_reasons) <= m.config.num_hidden_layers + 1
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(lambda x: m(x, use_cache=False).logits, backend="eager")(IDS)
    assert (out - ref).abs().max() <= 1e-5
