"""Every path of the SV gate equals the naive reference (ops/sv_gate/naive.py): the plug-in's prefill and
decode, the model's forward, its generate and its plug-in twin, and CausalSVAttention (tests/ops/test_causal.py),
on random, clustered and duplicate keys, unpadded and left-padded with pad counts 1, chunk - 1, chunk, chunk + 3."""

from __future__ import annotations

import pytest
import torch

from sv_attention.hf.attention import sv_attention_forward
from sv_attention.ops.settings import SVSettings
from sv_attention.ops.sv_gate import gate_stats, naive_sv_gate_attention, sv_gate_attention

CHUNK = 6
SETTINGS = SVSettings(chunk=CHUNK, nu=0.5)
PADS = [0, 1, CHUNK - 1, CHUNK, CHUNK + 3]


def keys_of(kind: str, b: int, g: int, n: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[b, g, n, d]``; "duplicate" repeats the first half (key and value: a repeated token),
    which makes alpha non-unique among the copies but not the output."""
    k = torch.randn(b, g, n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, g, n, d, generator=gen, dtype=torch.float64)
    if kind == "clustered":
        k = 0.05 * k + torch.randn(b, g, n, 1, generator=gen, dtype=torch.float64).sign()
    elif kind == "duplicate":
        k[:, :, n // 2:] = k[:, :, : n - n // 2]
        v[:, :, n // 2:] = v[:, :, : n - n // 2]
    return k, v


def causal(b: int, n: int) -> torch.Tensor:
    return torch.tril(torch.ones(n, n, dtype=torch.bool))[None].expand(b, n, n)


def left_pad(t: torch.Tensor, pad: int, gen: torch.Generator) -> torch.Tensor:
    junk = torch.randn(*t.shape[:2], pad, t.shape[-1], generator=gen, dtype=t.dtype)
    return torch.cat([junk, t], 2)


class Module(torch.nn.Module):
    """A stand-in transformers attention module whose config carries the plug-in's settings."""

    def __init__(self, settings: SVSettings) -> None:
        super().__init__()
        self.config = type("Cfg", (), {"sv_attention": settings.to_dict()})()
        self.layer_idx, self.is_causal = 0, True
        self.eval()  # the plug-in keeps its decoding state outside training


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))


# fp64: the batched gate is its partition's optimum with ridge 1e-10 (polish_ridge), the reference the exact one
TOL = {"random": 1e-8, "clustered": 1e-6, "duplicate": 1e-8}


@pytest.mark.parametrize("kind", ["random", "clustered", "duplicate"])
@pytest.mark.parametrize("pad", PADS)
def test_plugin_prefill_and_decode_equal_the_reference(kind, pad):
    gen = torch.Generator().manual_seed(len(kind) * 10 + pad)
    n, d = 26, 4
    q = torch.randn(1, 4, n, d, generator=gen, dtype=torch.float64)
    k, v = keys_of(kind, 1, 2, n, d, gen)
    ref = naive_sv_gate_attention(q, k, v, causal(1, n), SETTINGS, scaling=0.5)
    qp, kp, vp = left_pad(q, pad, gen), left_pad(k, pad, gen), left_pad(v, pad, gen)
    mask = causal(1, n + pad).clone()
    mask[:, :, :pad] = False
    out, _ = sv_attention_forward(Module(SETTINGS), qp, kp, vp, mask[:, None], scaling=0.5, use_cache=False)
    assert rel(out.transpose(1, 2)[:, :, pad:], ref) < TOL[kind]
    # decode: a prefill of 9 positions, then one token at a time with the kept state
    reused = gate_stats().get("reused", 0)
    mod = Module(SETTINGS)
    first = 9 + pad
    steps = [sv_attention_forward(mod, qp[:, :, :first], kp[:, :, :first], vp[:, :, :first], mask[:, None, :first, :first],
                                  scaling=0.5, use_cache=True)[0]]
    for t in range(first, n + pad):
        steps.append(sv_attention_forward(mod, qp[:, :, t:t + 1], kp[:, :, :t + 1], vp[:, :, :t + 1],
                                          mask[:, None, t:t + 1, :t + 1], scaling=0.5, use_cache=True)[0])
    decoded = torch.cat(steps, 1).transpose(1, 2)[:, :, pad:]
    assert rel(decoded, ref) < TOL[kind]
    assert gate_stats().get("reused", 0) > reused  # decoding reused the kept gates


@pytest.mark.parametrize("kind", ["random", "clustered"])
def test_gradients_equal_the_reference(kind):
    gen = torch.Generator().manual_seed(7)
    n, d = 20, 3
    q = torch.randn(2, 2, n, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = keys_of(kind, 2, 1, n, d, gen)
    k, v = k.requires_grad_(True), v.requires_grad_(True)
    vis = causal(2, n).clone()
    vis[1, :, :CHUNK + 3] = False  # the second sequence is left-padded
    out = sv_gate_attention(q, k, v, vis, SETTINGS).out
    ref = naive_sv_gate_attention(q, k, v, vis, SETTINGS)
    assert rel(out[0], ref[0]) < TOL[kind] and rel(out[1, :, CHUNK + 3:], ref[1, :, CHUNK + 3:]) < TOL[kind]
    up = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    up[1, :, :CHUNK + 3] = 0  # pad queries
    for a, b in zip(torch.autograd.grad((out * up).sum(), (q, k, v)), torch.autograd.grad((ref * up).sum(), (q, k, v))):
        assert rel(a, b) < 10 * TOL[kind]


def test_exact_solver_path_equals_the_reference_in_prefill_and_decode():
    gen = torch.Generator().manual_seed(3)
    n, d = 30, 4
    q, k, v = (torch.randn(1, 2, n, d, generator=gen, dtype=torch.float64) for _ in range(3))
    st = SETTINGS.replace(solver="exact")
    ref = naive_sv_gate_attention(q, k, v, causal(1, n), st)
    full = sv_gate_attention(q, k, v, causal(1, n), st)
    assert rel(full.out, ref) < 1e-12
    state, outs = None, []
    for t in range(n):
        res = sv_gate_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], causal(1, t + 1)[:, -1:], st,
                                state=state, keep_state=True)
        state = res.state
        outs.append(res.out)
    assert rel(torch.cat(outs, 2), ref) < 1e-12
    assert state.exact is not None  # the maintained solvers were kept and extended, not refitted


# ----------------------------------------------------------------------------------------------- the model
def tiny_sv(seed: int = 0, **knobs):
    from configuration_sv import SVConfig
    from modeling_sv import SVForCausalLM

    torch.manual_seed(seed)
    cfg = SVConfig(operator="sv", operator_config={"chunk": CHUNK, "nu": 0.5, **knobs}, hidden_size=32,
                   num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64)
    return SVForCausalLM(cfg).eval()


def test_model_operator_equals_the_reference():
    from modeling_sv import sv_operator

    model = tiny_sv()
    attn = model.model.layers[0].attn
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen) for _ in range(3))
    out, _ = sv_operator(attn, q, k, v, causal(1, 20)[:, None], 0.25)
    ref = naive_sv_gate_attention(q.double(), k.double(), v.double(), causal(1, 20), attn.operator_settings,
                                  scaling=0.25)
    assert rel(out.transpose(1, 2).double(), ref) < 1e-5


def test_plugin_twin_gives_the_model_its_own_logits_and_warns_on_another_operator(caplog):
    import sv_attention  # noqa: F401  (registers the plug-in)

    model = tiny_sv(seed=2)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    builtin = model(ids).logits
    model.set_attn_implementation("sv_attention")
    twin = model(ids).logits
    assert torch.allclose(twin, builtin, atol=1e-5)
    model.set_attn_implementation("eager")
    assert torch.equal(model(ids).logits, builtin)
    with caplog.at_level("WARNING"):
        model.set_attn_implementation("ceq")
    assert any("trained with operator 'sv'" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("pad", [1, CHUNK - 1, CHUNK, CHUNK + 3])
def test_model_left_padded_forward_and_generate_equal_the_sequence_alone(pad):
    model = tiny_sv(seed=3)
    gen = torch.Generator().manual_seed(pad)
    ids = torch.randint(1, 256, (1, 30), generator=gen)
    batch = torch.cat([torch.zeros(1, pad, dtype=torch.long), ids], 1)
    batch = torch.cat([batch, torch.randint(1, 256, (1, 30 + pad), generator=gen)], 0)  # a second, unpadded row
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    alone = model(ids).logits
    padded = model(batch, attention_mask=mask).logits
    assert torch.allclose(padded[0, pad:], alone[0], atol=1e-4)
    g_alone = model.generate(ids, max_new_tokens=8, do_sample=False)
    g_pad = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(g_pad[0, pad:], g_alone[0])


def test_mlx_gate_backend_gives_the_torch_partitions_and_logits():
    pytest.importorskip("mlx.core")
    from sv_attention.ops.sv_gate import gate_stats

    ids = torch.randint(0, 256, (2, 60), generator=torch.Generator().manual_seed(4))
    torch_model = tiny_sv(seed=4, gate_backend="torch")
    mlx_model = tiny_sv(seed=4, gate_backend="mlx")
    before = gate_stats().get("mlx_finder_calls", 0)
    a, b = torch_model(ids).logits, mlx_model(ids).logits
    assert gate_stats().get("mlx_finder_calls", 0) > before  # the finder did run on MLX
    assert torch.allclose(a, b, atol=1e-4)
    gates = {}
    for name, m in (("torch", torch_model), ("mlx", mlx_model)):
        from sv_attention.ops.sv_gate.gate import observe_gates

        seen: list[torch.Tensor] = []

        def record(s, alpha, seen=seen):
            seen.append(alpha > 0)

        with observe_gates(record):
            m(ids)
        gates[name] = seen
    assert all(torch.equal(x, y) for x, y in zip(gates["torch"], gates["mlx"], strict=True))  # same partitions


def test_an_infeasible_fitted_gate_is_refitted_not_returned():
    """A solver result that is not a feasible SVDD solution (here: four keys at C = 1/3, sum 4/3, what the
    cold batched solve once returned on clustered keys) is refitted by the primal active-set method."""
    from sv_attention.kernels import rbf_gram
    from sv_attention.ops.sv_gate.fit import ensure_valid, invalid_gates

    gen = torch.Generator().manual_seed(0)
    keys = 0.05 * torch.randn(2, 12, 4, generator=gen, dtype=torch.float64) + \
        torch.randn(2, 12, 1, generator=gen, dtype=torch.float64).sign()
    gram = rbf_gram(keys, sigma=2.0)
    C = 1.0 / 3.0
    bad = torch.zeros(2, 12, dtype=torch.float64)
    bad[:, [0, 2, 4, 8]] = C
    assert invalid_gates(bad, C).all()
    before = gate_stats().get("primal_fallback", 0)
    fixed = ensure_valid(gram, bad, C)
    assert gate_stats().get("primal_fallback", 0) == before + 2
    assert not invalid_gates(fixed, C).any()
    from sv_attention.ops.sv_gate.naive import exact_gate

    for i in range(2):
        ref = torch.from_numpy(exact_gate(keys[i].numpy(), C, 2.0))
        def obj(a, k=gram[i]):
            return float(a @ k @ a - k.diagonal() @ a)

        assert obj(fixed[i]) <= obj(ref) + 1e-9  # the optimum (possibly another one among near-duplicates)


def test_a_prefill_fitted_as_one_chain_equals_the_boundary_by_boundary_fits(monkeypatch):
    """A prefill of few sequences fits all its boundaries in one native call (gate.CHAIN_MAX_PROBLEMS); on the
    dense Gram the outputs are the bits of the boundary-by-boundary path, on the kernel's row store equal to
    rounding."""
    from sv_attention.ops.sv_gate import gate as gate_module
    from sv_attention.svdd import native_build

    if native_build.compiler() is None:
        pytest.skip("no C compiler: the native kernels cannot be built")
    gen = torch.Generator().manual_seed(3)
    b, g, h, n, d = 2, 2, 4, 8 * CHUNK, 8
    k, v = keys_of("random", b, g, n, d, gen)
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    before = gate_stats().get("chain_fits", 0)
    chained = sv_gate_attention(q, k, v, causal(b, n), SETTINGS).out  # rows the kernel computes
    monkeypatch.setattr(gate_module, "CHAIN_ROW_STORE", False)
    chained_dense = sv_gate_attention(q, k, v, causal(b, n), SETTINGS).out  # the dense Gram
    assert gate_stats().get("chain_fits", 0) == before + 2
    monkeypatch.setattr(gate_module, "CHAIN_MAX_PROBLEMS", 0)
    looped = sv_gate_attention(q, k, v, causal(b, n), SETTINGS).out
    assert gate_stats().get("chain_fits", 0) == before + 2
    assert torch.equal(chained_dense, looped)
    assert rel(chained, looped) < 1e-10  # (the kernel's rows equal rbf_gram's to rounding)
