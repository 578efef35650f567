"""The C decoding row of ceq's sgate hop engine (sv_attention.ops.ceq.row_native) against the torch row."""

from __future__ import annotations

import pytest
import torch

from sv_attention.ops.ceq import row_native
from sv_attention.ops.ceq.common import CeqParams
from sv_attention.ops.ceq.engine import _sgate_decode_row
from sv_attention.svdd.native_build import compiler, native_enabled
from sv_attention.threads import torch_threads

needs_kernel = pytest.mark.skipif(compiler() is None or not native_enabled() or row_native.kernel() is None,
                                  reason="no C compiler (or SV_ATTENTION_NATIVE=0): the torch row runs instead")


def _inputs(b, h, hkv, e, d, dv, hops, dtype, seed=0, strided_q=False):
    gen = torch.Generator().manual_seed(seed)
    if strided_q:  # the model's layout: [b, 1, h, d] transposed
        q = torch.randn(b, 1, h, d, generator=gen, dtype=dtype).transpose(1, 2)
    else:
        q = torch.randn(b, h, 1, d, generator=gen, dtype=dtype)
    k = torch.randn(b, hkv, e, d, generator=gen, dtype=dtype)
    v = torch.randn(b, hkv, e, dv, generator=gen, dtype=dtype)
    store = [torch.randn(b, h, e + 5, dv, generator=gen, dtype=dtype) for _ in range(hops - 1)]
    return q, k, v, store


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("b,h,hkv,e,d,dv,hops", [(1, 8, 2, 300, 32, 32, 2), (2, 4, 4, 70, 16, 16, 3),
                                                 (1, 6, 2, 2, 8, 8, 1), (2, 4, 1, 129, 64, 64, 4),
                                                 (1, 2, 1, 65, 5, 7, 2)])
@pytest.mark.parametrize("with_stock", [True, False])
def test_the_kernel_equals_the_torch_row(dtype, tol, b, h, hkv, e, d, dv, hops, with_stock):
    """Stock output, every hop and the history rows it writes equal the torch row's, to rounding; the rows it
    must not touch stay as they were (any head sizes, 1..4 hops, the shortest row e = 2, strided queries)."""
    params = CeqParams(operator="sgate", rho=1.3, lam=0.2, hops=hops)
    q, k, v, store = _inputs(b, h, hkv, e, d, dv, hops, dtype, seed=e + hops, strided_q=e % 2 == 1)
    store_t = [t.clone() for t in store]
    ys_n, out_n = _sgate_decode_row(q, k, v, params, 0.3, store, with_stock, engine="native")
    with torch_threads(1):  # (the torch row's first call on two threads was seen off by ~1e-9 in fp64, in MKL)
        ys_t, out_t = _sgate_decode_row(q, k, v, params, 0.3, store_t, with_stock, engine="torch")
    scale = max(float(t.abs().max()) for t in ys_t)
    for a, c in zip(ys_n, ys_t, strict=True):
        assert a.shape == c.shape and float((a - c).abs().max()) <= tol * scale
    if with_stock:
        assert float((out_n - out_t).abs().max()) <= tol * float(out_t.abs().max())
    else:
        assert out_n is None and out_t is None
    for a, c in zip(store, store_t, strict=True):  # row e - 1 written (checked above), every other row untouched
        assert torch.equal(a[:, :, : e - 1], c[:, :, : e - 1]) and torch.equal(a[:, :, e:], c[:, :, e:])


@needs_kernel
def test_non_finite_logits_give_non_finite_outputs_as_the_torch_row_does():
    """A NaN query is not hidden: both rows return NaN."""
    params = CeqParams(operator="sgate", rho=1.0, lam=0.1, hops=2)
    q, k, v, store = _inputs(1, 4, 2, 40, 8, 8, 2, torch.float32)
    q[0, 1, 0, 3] = float("nan")
    ys_n, out_n = _sgate_decode_row(q, k, v, params, 0.3, [t.clone() for t in store], True, engine="native")
    ys_t, out_t = _sgate_decode_row(q, k, v, params, 0.3, [t.clone() for t in store], True, engine="torch")
    assert torch.equal(out_n.isnan(), out_t.isnan()) and bool(out_n[0, 1].isnan().all())
    assert torch.equal(ys_n[-1].isnan(), ys_t[-1].isnan())


def test_inputs_the_kernel_does_not_take_use_the_torch_row():
    """Mixed dtypes, a strided last dimension or autograd: no kernel call (None), and ``engine='native'``
    says so; ``engine='auto'`` still answers with the torch row; an unknown engine is refused."""
    params = CeqParams(operator="sgate", rho=1.0, lam=0.1, hops=2)
    q, k, v, store = _inputs(1, 4, 2, 20, 8, 8, 2, torch.float32)
    strided_v = torch.randn(1, 2, 20, 16)[..., ::2]
    assert row_native.sgate_decode_row(q, k, strided_v, 0.3, 1.0, 0.1, store, True) is None
    assert row_native.sgate_decode_row(q.double(), k, v, 0.3, 1.0, 0.1, store, True) is None
    assert row_native.sgate_decode_row(q.requires_grad_(), k, v, 0.3, 1.0, 0.1, store, True) is None
    with pytest.raises(RuntimeError, match="cannot run"):
        _sgate_decode_row(q, k, strided_v, params, 0.3, store, True, engine="native")
    ys, out = _sgate_decode_row(q.detach(), k, strided_v, params, 0.3, store, True, engine="auto")
    assert out.shape == (1, 4, 1, 8) and len(ys) == 2
    with pytest.raises(ValueError, match="engine"):
        _sgate_decode_row(q.detach(), k, v, params, 0.3, store, True, engine="fast")


def test_without_the_kernel_the_torch_row_answers(monkeypatch):
    """SV_ATTENTION_NATIVE=0 (or a failed build): the kernel is None and decoding runs the torch row."""
    monkeypatch.setattr(row_native, "kernel", lambda: None)
    params = CeqParams(operator="sgate", rho=1.0, lam=0.1, hops=2)
    q, k, v, store = _inputs(1, 4, 2, 20, 8, 8, 2, torch.float64)
    assert row_native.sgate_decode_row(q, k, v, 0.3, 1.0, 0.1, store, True) is None
    ys, out = _sgate_decode_row(q, k, v, params, 0.3, [t.clone() for t in store], True)
    ys_t, out_t = _sgate_decode_row(q, k, v, params, 0.3, [t.clone() for t in store], True, engine="torch")
    assert torch.equal(out, out_t) and all(torch.equal(a, c) for a, c in zip(ys, ys_t, strict=True))


@needs_kernel
def test_rows_on_several_threads_equal_one_thread(monkeypatch):
    """Each (sequence, kv head) is one unit of work: the thread count changes nothing, bit for bit."""
    params = CeqParams(operator="sgate", rho=1.3, lam=0.2, hops=3)
    q, k, v, store = _inputs(3, 8, 2, 200, 32, 32, 3, torch.float32, seed=3)
    results = []
    for threads in (1, 4):
        monkeypatch.setattr(row_native, "ROW_THREADS", threads)
        st = [t.clone() for t in store]
        ys, out = _sgate_decode_row(q, k, v, params, 0.3, st, True, engine="native")
        results.append(([y.clone() for y in ys], out, st))
    (ys1, out1, st1), (ys4, out4, st4) = results
    assert torch.equal(out1, out4) and all(torch.equal(a, c) for a, c in zip(ys1 + st1, ys4 + st4, strict=True))
