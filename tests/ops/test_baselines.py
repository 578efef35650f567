import pytest
import torch

from sv_attention.errors import InvalidHyperparameterError, InvalidInputError
from sv_attention.ops.baselines import (
    delta_net,
    delta_net_read,
    delta_net_recurrent,
    linear_attention,
    linear_attention_read,
    linear_attention_recurrent,
    softmax_attention,
)


def _qkv(seed=0, b=2, n=9, d=5, dv=3):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return mk(b, n, d), mk(b, n, d), mk(b, n, dv)


def _rel(a, b):
    return float(((a - b).norm() / b.norm()).detach())


def test_linear_attention_parallel_matches_recurrence_outputs_and_grads():
    q, k, v = (t.requires_grad_() for t in _qkv())
    fast = linear_attention(q, k, v)
    ref = linear_attention_recurrent(q, k, v)
    assert _rel(fast, ref) < 1e-12
    gf = torch.autograd.grad(fast.square().sum(), (q, k, v))
    gr = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(gf, gr):
        assert _rel(a, b) < 1e-10


def test_linear_attention_read_is_last_row_of_causal():
    q, k, v = _qkv(1)
    full = linear_attention(q, k, v)
    read = linear_attention_read(k, v, q[:, -1:])
    assert _rel(read, full[:, -1:]) < 1e-12


def test_delta_net_parallel_matches_recurrence_outputs_state_and_grads():
    q, k, v = (t.requires_grad_() for t in _qkv(2))
    beta = torch.rand(2, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    of, sf = delta_net(q, k, v, beta)
    orr, sr = delta_net_recurrent(q, k, v, beta)
    assert _rel(of, orr) < 1e-12 and _rel(sf, sr) < 1e-12
    gf = torch.autograd.grad(of.square().sum() + sf.sum(), (q, k, v))
    gr = torch.autograd.grad(orr.square().sum() + sr.sum(), (q, k, v))
    for a, b in zip(gf, gr):
        assert _rel(a, b) < 1e-10


def test_delta_net_stores_orthogonal_keys_exactly():
    # beta = 1 with orthonormal keys: the state is an exact associative memory.
    d = 6
    k = torch.eye(d, dtype=torch.float64)[None]
    v = torch.randn(1, d, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    _, state = delta_net(k, k, v, 1.0)
    assert torch.allclose(delta_net_read(state, k), v, atol=1e-14)


def test_softmax_attention_causal_first_row_copies_first_value():
    q, k, v = _qkv(4)
    out = softmax_attention(q, k, v, causal=True)
    assert torch.allclose(out[:, 0], v[:, 0], atol=1e-14)
    w = torch.softmax(q @ k.transpose(-1, -2) / 5**0.5, -1)
    assert torch.allclose(softmax_attention(q, k, v), w @ v, atol=1e-14)


def test_bad_inputs_raise_typed_errors():
    q, k, v = _qkv()
    with pytest.raises(InvalidInputError):
        linear_attention(q, k[..., :3], v)
    with pytest.raises(InvalidInputError):
        delta_net(q, k, v[:, :4])
    with pytest.raises(InvalidHyperparameterError):
        delta_net(q, k, v, beta=3.0)
    bad = q.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(InvalidInputError):
        softmax_attention(bad, k, v)
