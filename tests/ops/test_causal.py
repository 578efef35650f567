"""CausalSVAttention and sv_hybrid_attention: thin callers of the single gate, tested against its reference."""

import pytest
import torch

from sv_attention.errors import InfeasibleBoxError, InvalidHyperparameterError, InvalidInputError
from sv_attention.ops.causal import CausalSVAttention, sv_hybrid_attention
from sv_attention.ops.settings import SVSettings
from sv_attention.ops.sv_gate import naive_sv_gate_attention


def _qkv(seed=0, b=2, h=4, hk=2, T=40, d=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, T, d, generator=g, dtype=dtype), torch.randn(b, hk, T, d, generator=g, dtype=dtype),
            torch.randn(b, hk, T, d, generator=g, dtype=dtype))


def _causal(b, T):
    return torch.tril(torch.ones(T, T, dtype=torch.bool))[None].expand(b, T, T)


def test_functional_layer_equals_the_naive_reference():
    q, k, v = _qkv()
    st = SVSettings(chunk=16, nu=0.5)
    out, w = sv_hybrid_attention(q, k, v, st, return_weights=True)
    ref = naive_sv_gate_attention(q, k, v, _causal(2, 40), st)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 40, dtype=torch.float64))
    assert (w[:, :, 16:32, :16] == 0).any()  # reserve keys of the gated prefix get exactly zero weight


def test_chunk0_and_warmup_are_plain_causal_softmax():
    q, k, v = _qkv(T=24)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            is_causal=True)
    out, _ = sv_hybrid_attention(q, k, v, SVSettings(chunk=16))
    assert torch.allclose(out[:, :, :16], sdpa[:, :, :16], atol=1e-12)
    out_w, _ = sv_hybrid_attention(q, k, v, chunk=16, C=0.05)  # ceil(1/C) + 2 = 22 > 16: all warm-up
    assert torch.allclose(out_w, sdpa, atol=1e-12)


def test_no_future_leak():
    q, k, v = _qkv(seed=1, T=26)
    base, _ = sv_hybrid_attention(q, k, v, chunk=8, nu=0.5)
    for t in (5, 8, 20):
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[:, :, t] += 3.0
        k2[:, :, t] -= 2.0
        v2[:, :, t] *= -4.0
        out, _ = sv_hybrid_attention(q2, k2, v2, chunk=8, nu=0.5)
        assert torch.equal(out[:, :, :t], base[:, :, :t])


@pytest.mark.parametrize("pad", [1, 7, 8, 11])
def test_left_padding_any_count_equals_the_sequence_alone(pad):
    q, k, v = _qkv(seed=2, b=1, T=30)
    g = torch.Generator().manual_seed(5)
    qp = torch.cat([torch.randn(1, 4, pad, 6, generator=g, dtype=torch.float64), q], 2)
    kp = torch.cat([torch.randn(1, 2, pad, 6, generator=g, dtype=torch.float64), k], 2)
    vp = torch.cat([torch.randn(1, 2, pad, 6, generator=g, dtype=torch.float64), v], 2)
    mask = torch.ones(1, 30 + pad, dtype=torch.bool)
    mask[:, :pad] = False
    alone, _ = sv_hybrid_attention(q, k, v, chunk=8, nu=0.5)
    padded, _ = sv_hybrid_attention(qp, kp, vp, chunk=8, nu=0.5, mask=mask)
    assert torch.allclose(padded[:, :, pad:], alone, atol=1e-12)


def _module_reference(mod, x):
    b, s, _ = x.shape

    def heads(t):
        return t.view(b, s, mod.n_heads, mod.head_dim).transpose(1, 2)

    ref = naive_sv_gate_attention(heads(mod.q_proj(x)), heads(mod.k_proj(x)), heads(mod.v_proj(x)), _causal(b, s),
                                  mod.settings)
    return mod.o_proj(ref.transpose(1, 2).reshape(b, s, mod.d_model))


@pytest.mark.parametrize("kind", ["random", "clustered", "duplicate"])
def test_module_forward_and_backward_equal_the_naive_reference(kind):
    torch.manual_seed(0)
    mod = CausalSVAttention(16, 2, chunk=8, nu=0.5).double()
    x = torch.randn(2, 32, 16, dtype=torch.float64)
    if kind == "clustered":
        x = 0.05 * x + torch.randn(2, 32, 1, dtype=torch.float64).sign()
    elif kind == "duplicate":
        x[:, 16:] = x[:, :16]
    x.requires_grad_(True)
    out = mod(x)
    ref = _module_reference(mod, x)
    rel = (out - ref).norm() / ref.norm()
    assert rel < 1e-5
    up = torch.randn_like(out)
    # exact duplicates make the optimum non-unique (how alpha splits among copies of a key): the output and
    # the parameters' gradients do not depend on the split, the gradient of one copy's input does
    wrt = [*mod.parameters()] if kind == "duplicate" else [x, *mod.parameters()]
    g_out = torch.autograd.grad((out * up).sum(), wrt)
    g_ref = torch.autograd.grad((ref * up).sum(), wrt)
    # the batched gate is the optimum of its partition with ridge 1e-6 (POLISH_RIDGE); near-duplicate keys make
    # 2 K_SS ill-conditioned, so its deviation from the exact (ridge-0) reference grows there
    tol = 1e-4 if kind == "clustered" else 1e-5
    for a, b_ in zip(g_out, g_ref):
        assert (a - b_).norm() <= tol * b_.norm() + 1e-9


def test_exact_solver_equals_the_naive_reference_to_rounding_and_is_detached():
    q, k, v = _qkv(seed=3)
    st = SVSettings(chunk=16, nu=0.5, solver="exact")
    out, _ = sv_hybrid_attention(q, k, v, st)
    assert torch.allclose(out, naive_sv_gate_attention(q, k, v, _causal(2, 40), st), atol=1e-12)
    with pytest.raises(InvalidHyperparameterError, match="not differentiable"):
        SVSettings(solver="exact", detach_gate=False)


def test_differentiable_gate_has_the_same_value_and_passes_gradcheck():
    q, k, v = _qkv(seed=4, b=1, h=2, hk=1, T=14, d=3)
    detached, _ = sv_hybrid_attention(q, k, v, chunk=6, nu=0.5)
    k = k.clone().requires_grad_(True)
    live, _ = sv_hybrid_attention(q, k, v, chunk=6, nu=0.5, detach_gate=False)
    assert torch.allclose(live, detached, atol=1e-12)
    g_live = torch.autograd.grad(live.sum(), k)[0]
    g_det = torch.autograd.grad(sv_hybrid_attention(q, k, v, chunk=6, nu=0.5)[0].sum(), k)[0]
    assert not torch.allclose(g_live, g_det)  # the gate's own derivative is included
    assert torch.autograd.gradcheck(lambda kk: sv_hybrid_attention(q, kk, v, chunk=6, nu=0.5, sigma=2.0,
                                                                   detach_gate=False)[0], (k,), eps=1e-6, atol=1e-5)


def test_module_validation():
    with pytest.raises(InvalidHyperparameterError):
        CausalSVAttention(10, 3)
    with pytest.raises(InfeasibleBoxError):
        CausalSVAttention(8, 2, chunk=4, C=0.1)
    mod = CausalSVAttention(8, 2, chunk=4, nu=0.5)
    assert mod.settings == SVSettings(chunk=4, nu=0.5) and mod.C == pytest.approx(0.5)
    with pytest.raises(InvalidInputError):
        mod(torch.randn(2, 5, 7))
    with pytest.raises(InvalidInputError):
        mod(torch.full((1, 5, 8), float("nan")))
    with pytest.raises(InvalidHyperparameterError):
        CausalSVAttention(8, 2, gate_backend="jax")


@pytest.mark.parametrize("seed", [0, 1])
def test_trainable_gate_gradient_equals_the_implicit_vjp_reference(seed):
    """detach_gate=False: the batched path differentiates its ridged bordered solve; the reference
    differentiates the exact solver's coefficients by the paper's implicit VJP (svdd/implicit.py)."""
    q, k, v = _qkv(seed=seed, b=1, h=2, hk=1, T=24, d=3)
    st = SVSettings(chunk=8, nu=0.5, sigma=1.5, detach_gate=False)
    k = k.clone().requires_grad_(True)
    out, _ = sv_hybrid_attention(q, k, v, st)
    ref = naive_sv_gate_attention(q, k, v, _causal(1, 24), st)
    assert torch.allclose(out, ref, atol=1e-9)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g_out = torch.autograd.grad((out * up).sum(), k)[0]
    g_ref = torch.autograd.grad((ref * up).sum(), k)[0]
    g_frozen = torch.autograd.grad((naive_sv_gate_attention(q, k, v, _causal(1, 24), st.replace(detach_gate=True))
                                    * up).sum(), k)[0]
    assert (g_out - g_ref).norm() <= 1e-6 * g_ref.norm()
    assert (g_ref - g_frozen).norm() > 1e-3 * g_ref.norm()  # the gate's own derivative is really included
