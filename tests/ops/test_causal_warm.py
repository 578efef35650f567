"""The warm-started training-path gate (sv_attention.ops.causal, WARM_START) equals the cold path."""

import pytest
import torch

import sv_attention.ops.causal as causal
import sv_attention.svdd.warm_fit as warm_fit
from sv_attention.ops.causal import GateCache, compute_boundary_gates, fit_stats, sv_hybrid_attention

C = 1.0 / (0.5 * 32)  # nu = 0.5 at n0 = chunk = 32
BOUNDS = [32, 64, 96, 128]


def _keys(kind: str, seed: int, b: int = 2, hk: int = 2, n: int = 128, d: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hk, n, d, generator=g, dtype=torch.float64)
    if kind == "clustered":  # four tight clusters: the primal-dual steps may oscillate (then: fallback)
        centres = 2.0 * torch.randn(b, hk, 4, d, generator=g, dtype=torch.float64)
        label = torch.randint(0, 4, (b, hk, n), generator=g)
        k = centres.gather(2, label[..., None].expand(b, hk, n, d)) + 0.3 * k
    return k


def _gates_and_grad(k0: torch.Tensor, warm: bool, monkeypatch, key_valid=None, weights_seed: int = 5):
    monkeypatch.setattr(causal, "WARM_START", warm)
    k = k0.clone().requires_grad_(True)
    gates = compute_boundary_gates(k, BOUNDS, C=C, chunk=32, detach=False, key_valid=key_valid)
    w = torch.randn(k.shape[:3], generator=torch.Generator().manual_seed(weights_seed), dtype=k.dtype)
    loss = sum((a * w[..., :s]).sum() for s, a in gates.alpha.items())
    loss.backward()
    return gates, k.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.mark.parametrize("kind", ["random", "clustered"])
@pytest.mark.parametrize("seed", [0, 1])
def test_warm_gates_and_gradients_equal_the_cold_path(kind, seed, monkeypatch):
    k0 = _keys(kind, seed)
    cold, g_cold = _gates_and_grad(k0, False, monkeypatch)
    warm, g_warm = _gates_and_grad(k0, True, monkeypatch)
    assert cold.fit_counts == {"cold": 4 * len(BOUNDS)}
    fc = warm.fit_counts
    assert fc["cold"] == 4  # the first boundary
    assert fc.get("warm", 0) + fc.get("warm_fallback", 0) + fc["cold"] == 4 * len(BOUNDS)  # each problem once
    if kind == "random":
        assert fc["warm"] == 4 * (len(BOUNDS) - 1)  # settled from the previous partition
    assert warm.status_counts == cold.status_counts
    for s in BOUNDS:
        assert torch.equal(warm.active[s], cold.active[s])
        assert _rel(warm.alpha[s].detach(), cold.alpha[s].detach()) < 1e-9
    assert _rel(g_warm, g_cold) < 1e-8


def test_warm_gate_with_padding_equals_the_cold_path(monkeypatch):
    k0 = _keys("random", 3)
    valid = torch.ones(k0.shape[:3], dtype=torch.bool)
    valid[0, :, :10] = False  # left padding of sequence 0
    valid[1, 1, 40:50] = False  # a masked span
    cold, g_cold = _gates_and_grad(k0, False, monkeypatch, key_valid=valid)
    warm, g_warm = _gates_and_grad(k0, True, monkeypatch, key_valid=valid)
    assert warm.fit_counts.get("warm", 0) > 0
    for s in BOUNDS:
        assert _rel(warm.alpha[s].detach(), cold.alpha[s].detach()) < 1e-9
        assert (warm.alpha[s].detach()[~valid[..., :s]] == 0).all()
    assert _rel(g_warm, g_cold) < 1e-8
    assert (g_warm[~valid] == 0).all()  # padded keys get no gradient through the gate


def test_unsettled_warm_problems_fall_back_to_the_cold_solve_and_are_counted(monkeypatch):
    k0 = _keys("random", 4)
    cold, g_cold = _gates_and_grad(k0, False, monkeypatch)
    monkeypatch.setattr(warm_fit, "WARM_PDAS_STEPS", 0)  # one solve, no move: new violators stay unsettled
    before = fit_stats().get("warm_fallback", 0)
    warm, g_warm = _gates_and_grad(k0, True, monkeypatch)
    assert warm.fit_counts.get("warm_fallback", 0) > 0
    assert fit_stats().get("warm_fallback", 0) - before == warm.fit_counts["warm_fallback"]
    for s in BOUNDS:
        assert _rel(warm.alpha[s].detach(), cold.alpha[s].detach()) < 1e-9
    assert _rel(g_warm, g_cold) < 1e-8


def test_layer_output_and_input_gradients_equal_the_cold_path(monkeypatch):
    g = torch.Generator().manual_seed(7)
    q0, k0, v0 = (torch.randn(1, 4, 96, 8, generator=g, dtype=torch.float64) for _ in range(3))
    k0 = k0[:, :2]
    v0 = v0[:, :2]
    res = {}
    for warm in (False, True):
        monkeypatch.setattr(causal, "WARM_START", warm)
        q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
        out, _ = sv_hybrid_attention(q, k, v, C=C, chunk=32, detach_gate=False)
        out.square().sum().backward()
        res[warm] = (out.detach(), q.grad, k.grad, v.grad)
    for a, b in zip(res[True], res[False]):
        assert _rel(a, b) < 1e-9


def test_decoding_starts_warm_from_the_cached_partition(monkeypatch):
    k0 = _keys("random", 5)
    monkeypatch.setattr(causal, "WARM_START", False)
    ref = compute_boundary_gates(k0, BOUNDS, C=C, chunk=32)
    monkeypatch.setattr(causal, "WARM_START", True)
    cache = GateCache()
    for n, s in zip((32, 64, 96, 128), BOUNDS):  # one boundary per call, as when decoding
        gates = compute_boundary_gates(k0[:, :, :n], [s], C=C, chunk=32, cache=cache)
        assert torch.allclose(gates.alpha[s], ref.alpha[s], atol=1e-12)
    assert cache.fit_counts == {"cold": 4, "warm": 4 * (len(BOUNDS) - 1)}
    cache.reset()
    assert not cache.partition


def test_an_empty_margin_is_counted_not_warned(monkeypatch):
    """An empty margin set is an exact optimum: compute_boundary_gates counts it without a warning, while a
    non-converged polish is still warned about."""
    import warnings

    real = causal._fit_batched

    def with_status(name):
        def fake(*args, **kw):
            fit = real(*args, **kw)
            fit.counts[name] = fit.counts.get(name, 0) + 1
            return fit
        return fake

    k = torch.randn(1, 1, 24, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    monkeypatch.setattr(causal, "_fit_batched", with_status("empty margin"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gates = causal.compute_boundary_gates(k, [8, 16], C=0.25, sigma=None, chunk=8)
    assert gates.status_counts["empty margin"] >= 1
    monkeypatch.setattr(causal, "_fit_batched", with_status("not converged"))
    with pytest.warns(RuntimeWarning, match="not converged"):
        causal.compute_boundary_gates(k, [8, 16], C=0.25, sigma=None, chunk=8)
