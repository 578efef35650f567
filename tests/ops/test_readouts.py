"""Tests of the SV readouts against their plain-loop references (outputs and gradients)."""

import pytest
import torch

from sv_attention.errors import InvalidInputError
from sv_attention.ops.readouts import rbf_readout, readout_reference, softmax_hybrid_readout


def _inputs(seed=0, b=2, h=2, nq=5, nk=7, d=4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, h, nk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, h, nk, 3, generator=g, dtype=torch.float64)
    gate = torch.rand(b, h, nq, nk, generator=g, dtype=torch.float64)
    gate[..., 1] = 0.0  # an inert key
    mask = torch.rand(b, 1, nq, nk, generator=g) > 0.3
    mask[..., 0] = True
    return q, k, v, gate, mask


def test_softmax_hybrid_matches_reference_outputs_and_grads():
    q, k, v, gate, mask = _inputs()
    args = [t.clone().requires_grad_(True) for t in (q, k, v, gate)]
    out, w = softmax_hybrid_readout(*args, mask=mask, scaling=0.7, return_weights=True)
    ref_args = [t.clone().requires_grad_(True) for t in (q, k, v, gate)]
    ref = readout_reference(*ref_args, mask=mask, kind="softmax", scaling=0.7)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(w.sum(-1), torch.ones_like(w.sum(-1)))
    assert (w[..., 1] == 0).all() and (w[~mask.expand_as(w)] == 0).all()
    out.square().sum().backward()
    ref.square().sum().backward()
    for a, r in zip(args, ref_args):
        assert torch.allclose(a.grad, r.grad, rtol=1e-10, atol=1e-12)


def test_rbf_matches_reference_and_gate_one_is_kernel_regression():
    q, k, v, gate, mask = _inputs(seed=1)
    sigma = torch.tensor([[1.3, 2.0], [0.9, 1.1]], dtype=torch.float64)
    args = [t.clone().requires_grad_(True) for t in (q, k, v, gate)]
    out, _ = rbf_readout(*args, sigma=sigma, mask=mask)
    ref_args = [t.clone().requires_grad_(True) for t in (q, k, v, gate)]
    ref = readout_reference(*ref_args, mask=mask, kind="rbf", sigma=sigma)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    out.sum().backward()
    ref.sum().backward()
    for a, r in zip(args, ref_args):
        assert torch.allclose(a.grad, r.grad, rtol=1e-10, atol=1e-12)
    # alpha-weighted kernel regression o(q) = sum a_i k(q, x_i) v_i / sum a_i k(q, x_i) (DESIGN §2.1)
    alpha = torch.rand(7, dtype=torch.float64)
    o, _ = rbf_readout(q[:1, :1], k[:1, :1], v[:1, :1], alpha, sigma=1.5)
    kq = torch.exp(-((q[0, 0, :, None, :] - k[0, 0, None, :, :]) ** 2).sum(-1) / 1.5**2) * alpha
    assert torch.allclose(o[0, 0], (kq @ v[0, 0]) / kq.sum(-1, keepdim=True), atol=1e-12)


def test_gate_none_is_plain_softmax_and_empty_rows_are_zero():
    q, k, v, _, mask = _inputs(seed=2)
    out, _ = softmax_hybrid_readout(q, k, v, None, mask=None)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(out, sdpa, atol=1e-12)
    none = torch.zeros(1, 1, 5, 7, dtype=torch.bool)
    o, _ = softmax_hybrid_readout(q[:1, :1], k[:1, :1], v[:1, :1], None, mask=none)
    assert torch.equal(o, torch.zeros_like(o))


def test_tiny_gates_do_not_underflow():
    q, k, v, _, _ = _inputs(seed=3)
    gate = torch.full((2, 2, 5, 7), 1e-30, dtype=torch.float64)
    out, _ = softmax_hybrid_readout(q * 50, k, v, gate)
    ref, _ = softmax_hybrid_readout(q * 50, k, v, None)
    assert torch.isfinite(out).all() and torch.allclose(out, ref, atol=1e-10)


def test_readout_shape_errors():
    q, k, v, gate, _ = _inputs()
    with pytest.raises(InvalidInputError):
        softmax_hybrid_readout(q[0], k, v, gate)
    with pytest.raises(InvalidInputError):
        softmax_hybrid_readout(q, k[..., :3], v, gate)


def test_fused_path_for_detached_gate_matches_reference_outputs_and_grads():
    q, k, v, gate, mask = _inputs(seed=4)
    args = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, w = softmax_hybrid_readout(*args, gate, mask=mask, scaling=0.7)  # gate without grad: fused SDPA
    assert w is None
    ref_args = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = readout_reference(*ref_args, gate, mask=mask, kind="softmax", scaling=0.7)
    assert torch.allclose(out, ref, rtol=1e-10, atol=1e-12)
    out.square().sum().backward()
    ref.square().sum().backward()
    for a, r in zip(args, ref_args):
        assert torch.allclose(a.grad, r.grad, rtol=1e-8, atol=1e-10)
    # a row with no live key falls back to the explicit path and returns 0
    m2 = mask.clone()
    m2[0, 0, 2] = False
    o2, _ = softmax_hybrid_readout(q, k, v, gate, mask=m2)
    assert torch.equal(o2[0, :, 2], torch.zeros_like(o2[0, :, 2])) and torch.isfinite(o2).all()
