"""Tests of the batched SVDD path (sv_attention.svdd.batched and its helpers)."""

import numpy as np
import pytest
import torch

from sv_attention.errors import BackendUnavailableError, InvalidHyperparameterError, InvalidInputError
from sv_attention.kernels import median_bandwidth, rbf_gram
from sv_attention.svdd.batched import (
    STATUS_INFEASIBLE,
    STATUS_OK,
    STATUS_WARMUP,
    mlx_available,
    select_backend,
    solve_batched,
)
from sv_attention.svdd.batched_reference import clustered_keys, gaussian_keys, reference_solution
from sv_attention.svdd.batched_torch import project_capped_simplex
from sv_attention.svdd.polish import fixed_partition_solve, kkt_gradient


def _problems(kind: str, G: int, n: int, d: int, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    X = (gaussian_keys if kind == "gaussian" else clustered_keys)(G, n, d, g)
    sig = median_bandwidth(X)
    return X, rbf_gram(X, sigma=sig[:, None, None]).to(dtype)


def _partition(sol) -> np.ndarray:
    return (sol.margin.int() + 2 * sol.error.int()).numpy()


@pytest.mark.parametrize("kind", ["gaussian", "clustered"])
def test_partition_and_alpha_match_exact_reference(kind):
    _, K = _problems(kind, 24, 48, 8, seed=1)
    C = 1.0 / (0.3 * 48)
    refs = [reference_solution(K[i], C) for i in range(K.shape[0])]
    mask = torch.ones(K.shape[:2], dtype=torch.bool)
    sol = solve_batched(K.float(), mask, C, ridge=0.0)
    part = _partition(sol)
    ref_part = np.stack([r.partition for r in refs])
    assert (part == ref_part).all(1).mean() >= 0.95
    assert (part == ref_part).mean() >= 0.995
    agree = (part == ref_part).all(1)
    ref_alpha = np.stack([r.alpha for r in refs])
    # ridge 0 + exact partition: alpha equals the exact one to fp32 rounding.
    assert np.abs(sol.alpha.double().numpy() - ref_alpha)[agree].max() < 1e-4
    assert sol.valid.all()
    # Ridge 1e-3 (default): a stabilised approximation close to the exact coefficients.
    sol_r = solve_batched(K.float(), mask, C)
    assert np.abs(sol_r.alpha.double().numpy() - ref_alpha)[agree].max() < 5e-3


def test_fp64_exact_partition_reproduces_reference_to_machine_precision():
    _, K = _problems("gaussian", 6, 32, 4, seed=2)
    C = 1.0 / (0.5 * 32)
    mask = torch.ones(6, 32, dtype=torch.bool)
    sol = solve_batched(K, mask, C, ridge=0.0, fista_iters=60)
    for i in range(6):
        ref = reference_solution(K[i], C)
        assert np.array_equal(_partition(sol)[i], ref.partition)
        assert np.abs(sol.alpha[i].numpy() - ref.alpha).max() < 1e-12
        assert abs(float(sol.rho[i]) - ref.rho) < 1e-12
    assert torch.allclose(sol.alpha.sum(-1), torch.ones(6, dtype=torch.float64), atol=1e-13)


def test_padding_is_invisible_and_gets_zero_gradient():
    """A problem packed with padding gives the same answer as alone, and padded entries get no gradient."""
    X, _ = _problems("clustered", 1, 40, 6, seed=3)
    Xp = torch.cat([X, 5 * torch.randn(1, 24, 6, dtype=torch.float64)], dim=1)
    sig = float(median_bandwidth(X)[0])
    C = 1.0 / (0.4 * 40)
    K1 = rbf_gram(X, sigma=sig)
    Kp = rbf_gram(Xp, sigma=sig).clone().requires_grad_(True)
    mask = torch.zeros(1, 64, dtype=torch.bool)
    mask[0, :40] = True
    s1 = solve_batched(K1, torch.ones(1, 40, dtype=torch.bool), C)
    sp = solve_batched(Kp, mask, C)
    assert torch.allclose(sp.alpha[0, :40], s1.alpha[0], atol=1e-12)
    assert (sp.alpha[0, 40:] == 0).all() and not sp.margin[0, 40:].any() and not sp.reserve[0, 40:].any()
    (sp.alpha * torch.arange(64, dtype=torch.float64)).sum().backward()
    gmask = torch.zeros(64, 64, dtype=torch.bool)
    gmask[:40, :40] = True
    assert (Kp.grad[0][~gmask] == 0).all()
    assert Kp.grad[0][gmask].abs().max() > 0


def test_gradcheck_through_ridged_solve_wrt_keys_and_C():
    g = torch.Generator().manual_seed(4)
    X = torch.randn(2, 12, 3, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 10:] = False
    sol0 = solve_batched(rbf_gram(X, sigma=1.5), mask, 0.2)
    m0, e0 = sol0.margin, sol0.error
    assert m0.any() and e0.any()

    def f(x, c):
        # masks held fixed (migrations are kinks): the fixed-partition ridged solve
        return fixed_partition_solve(rbf_gram(x, sigma=1.5), mask, m0, e0, c.expand(2), 1e-3).alpha

    assert torch.autograd.gradcheck(f, (X.clone().requires_grad_(True),
                                        torch.tensor(0.2, dtype=torch.float64, requires_grad=True)))
    # and solve_batched itself is differentiable with the same result
    Xr = X.clone().requires_grad_(True)
    out = solve_batched(rbf_gram(Xr, sigma=1.5), mask, 0.2).alpha
    assert torch.allclose(out, f(X, torch.tensor(0.2, dtype=torch.float64)), atol=1e-12)


def test_kkt_conditions_hold_at_returned_solution():
    _, K = _problems("clustered", 16, 64, 8, seed=5)
    C = 1.0 / (0.2 * 64)
    sol = solve_batched(K, torch.ones(16, 64, dtype=torch.bool), C, ridge=0.0)
    g = kkt_gradient(K, sol.alpha, sol.rho)
    assert (sol.margin | sol.error | sol.reserve).all()
    assert (g[sol.margin].abs() < 1e-9).all()
    assert (g[sol.reserve] > -1e-9).all() and (g[sol.error] < 1e-9).all()
    assert (sol.alpha[sol.margin] > 0).all() and (sol.alpha[sol.margin] < C).all()
    assert (sol.alpha[sol.error] == C).all() and (sol.alpha[sol.reserve] == 0).all()
    assert (sol.kkt_violation < 1e-9).all()


def test_warmup_infeasible_and_status_reporting():
    _, K = _problems("gaussian", 3, 20, 4, seed=6)
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[1, 8:] = False   # 8 keys: 8 * 0.1 < 1 -> infeasible
    mask[2, 11:] = False  # 11 keys: feasible but below ceil(1/C) + 2 = 12 -> warm-up
    sol = solve_batched(K, mask, 0.1)
    assert sol.status.tolist() == [STATUS_OK, STATUS_INFEASIBLE, STATUS_WARMUP]
    assert sol.valid.tolist() == [True, False, False]
    assert torch.allclose(sol.alpha[1, :8], torch.full((8,), 1 / 8, dtype=torch.float64))
    assert sol.counts["infeasible"] == 1 and sol.counts["warm-up"] == 1
    assert torch.isfinite(sol.alpha).all() and torch.isfinite(sol.rho).all()


def test_per_problem_C_tensor():
    _, K = _problems("gaussian", 2, 30, 4, seed=7)
    mask = torch.ones(2, 30, dtype=torch.bool)
    both = solve_batched(K, mask, torch.tensor([0.05, 0.2], dtype=torch.float64), ridge=0.0)
    for i, c in enumerate((0.05, 0.2)):
        one = solve_batched(K[i:i + 1], mask[i:i + 1], c, ridge=0.0)
        assert torch.allclose(both.alpha[i], one.alpha[0], atol=1e-12)
        assert both.alpha[i].max() <= c + 1e-12


def test_singular_margin_block_falls_back_and_is_reported():
    """Duplicate keys make 2 K_SS singular: the guarded solve reports it per problem, never NaN."""
    X = torch.zeros(1, 6, 2, dtype=torch.float64)
    X[0, 3:] = 1.0
    K = rbf_gram(X, sigma=1.0)
    mask = torch.ones(1, 6, dtype=torch.bool)
    margin = torch.tensor([[True, True, False, False, False, False]])
    error = torch.zeros_like(margin)
    res = fixed_partition_solve(K, mask, margin, error, torch.tensor([0.5], dtype=torch.float64), 0.0)
    assert not bool(res.ok[0])
    assert torch.isfinite(res.alpha).all()
    sol = solve_batched(K, mask, 0.5)
    assert torch.isfinite(sol.alpha).all()
    assert abs(float(sol.alpha.sum()) - 1) < 1e-9


def test_projection_matches_long_bisection():
    g = torch.Generator().manual_seed(8)
    y = 0.05 * torch.randn(64, 40, generator=g, dtype=torch.float64)
    m = torch.ones(64, 40, dtype=torch.float64)
    m[:, 30:] = 0
    C = torch.full((64,), 1 / (0.3 * 30), dtype=torch.float64)
    # plain reference: 200 bisection steps
    lo, hi = y[:, :30].min(-1).values - C, y[:, :30].max(-1).values
    for _ in range(200):
        mid = (lo + hi) / 2
        s = (y[:, :30] - mid[:, None]).clamp(0).minimum(C[:, None]).sum(-1)
        lo, hi = torch.where(s > 1, mid, lo), torch.where(s > 1, hi, mid)
    ref = (y[:, :30] - ((lo + hi) / 2)[:, None]).clamp(0).minimum(C[:, None])
    a, tau = project_capped_simplex(y, m, C, 16)
    assert torch.allclose(a[:, :30], ref, atol=1e-12) and (a[:, 30:] == 0).all()
    a2, _ = project_capped_simplex(y, m, C, 2, tau0=tau + 1e-3)  # warm start converges in few steps
    assert torch.allclose(a2, a, atol=1e-12)


@pytest.mark.skipif(not mlx_available(), reason="mlx.core not importable")
def test_mlx_backend_matches_torch_backend():
    _, K = _problems("clustered", 8, 32, 4, seed=9, dtype=torch.float32)
    mask = torch.ones(8, 32, dtype=torch.bool)
    st = solve_batched(K, mask, 1 / 9.6, backend="torch")
    sm = solve_batched(K, mask, 1 / 9.6, backend="mlx")
    assert sm.backend == "mlx" and isinstance(sm.alpha, torch.Tensor)
    assert torch.equal(st.margin, sm.margin) and torch.equal(st.error, sm.error)
    assert torch.allclose(st.alpha, sm.alpha, atol=1e-6)


def test_backend_selection_and_bad_input():
    assert select_backend("auto", torch.device("cpu")) in ("torch", "mlx")
    assert select_backend("torch", torch.device("cpu")) == "torch"
    K = torch.eye(4).expand(2, 4, 4).contiguous()
    m = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(InvalidInputError):
        solve_batched(K, m, 0.5, backend="cuda-magic")
    with pytest.raises(InvalidInputError):
        solve_batched(K[0], m, 0.5)
    with pytest.raises(InvalidInputError):
        solve_batched(K, m.float(), 0.5)
    bad = K.clone()
    bad[0, 1, 2] = float("nan")
    with pytest.raises(InvalidInputError):
        solve_batched(bad, m, 0.5)
    with pytest.raises(InvalidHyperparameterError):
        solve_batched(K, m, 0.0)
    with pytest.raises(InvalidHyperparameterError):
        solve_batched(K, m, 0.5, fista_iters=-1)
    if not mlx_available():
        with pytest.raises(BackendUnavailableError):
            solve_batched(K, m, 0.5, backend="mlx")


def test_bordered_system_fast_and_autograd_builders_agree():
    from sv_attention.svdd.polish import _bordered_system

    _, K = _problems("clustered", 5, 20, 3, seed=10)
    g = torch.Generator().manual_seed(11)
    margin = torch.rand(5, 20, generator=g) < 0.3
    error = ~margin & (torch.rand(5, 20, generator=g) < 0.3)
    margin[4] = False  # an empty margin set
    C = torch.full((5,), 0.1, dtype=torch.float64)
    with torch.no_grad():
        fast = _bordered_system(K, margin, error, C, 1e-3)
    slow = _bordered_system(K.clone().requires_grad_(True), margin, error, C, 1e-3)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b.detach())


def test_the_two_references_agree():
    """The exact solver's refit and the independent Clarabel oracle give the same solution."""
    _, K = _problems("clustered", 3, 30, 4, seed=12)
    for i in range(3):
        a = reference_solution(K[i], 0.1)
        b = reference_solution(K[i], 0.1, use_exact=False)
        assert a.method == "refit" and b.method.startswith("clarabel")
        assert np.array_equal(a.partition, b.partition)
        assert np.abs(a.alpha - b.alpha).max() < 1e-9 and abs(a.rho - b.rho) < 1e-9


@pytest.mark.parametrize("kind", ["gaussian", "clustered"])
def test_warm_start_from_shorter_prefix_reaches_the_exact_partition(kind):
    # the causal gate warm-starts boundary s from boundary s - chunk's solution padded with zeros
    _, K = _problems(kind, 12, 64, 8, seed=5)
    C = 1.0 / (0.3 * 32)
    short = solve_batched(K[:, :40, :40].float(), torch.ones(12, 40, dtype=torch.bool), C, ridge=0.0)
    init = torch.nn.functional.pad(short.alpha, (0, 24))
    refs = [reference_solution(K[i], C) for i in range(12)]
    ref_part = np.stack([r.partition for r in refs])
    mask = torch.ones(12, 64, dtype=torch.bool)
    for iters in (0, 5):
        warm = solve_batched(K.float(), mask, C, ridge=0.0, init_alpha=init, fista_iters=iters, power_iters=iters)
        part = _partition(warm)
        assert (part == ref_part).all(1).mean() >= 0.95
        agree = (part == ref_part).all(1)
        assert np.abs(warm.alpha.double().numpy() - np.stack([r.alpha for r in refs]))[agree].max() < 1e-4
    with pytest.raises(InvalidInputError, match="init_alpha"):
        solve_batched(K.float(), mask, C, init_alpha=init[:, :10])


@pytest.mark.parametrize("sizes", [(0, 0), (3, 0), (3, 40), (60, 64)])
def test_gram_times_indicator_equals_the_plain_product(sizes):
    """K 1_E summed from gathered rows (small E), skipped (empty E) or multiplied (large E) is K @ 1_E."""
    from sv_attention.svdd.polish import _gram_times_indicator

    gen = torch.Generator().manual_seed(sum(sizes))
    x = torch.randn(2, 64, 5, generator=gen, dtype=torch.float64)
    gram = torch.exp(-torch.cdist(x, x) ** 2 / 4.0)
    subset = torch.zeros(2, 64, dtype=torch.bool)
    for i, k in enumerate(sizes):
        subset[i, torch.randperm(64, generator=gen)[:k]] = True
    f = subset.to(gram.dtype)
    assert torch.allclose(_gram_times_indicator(gram, subset, f), (gram @ f[..., None])[..., 0], atol=1e-12)


def test_gather_rows_equals_gather_on_contiguous_sliced_and_expanded_batches():
    from sv_attention.svdd.polish import gather_rows

    gen = torch.Generator().manual_seed(0)
    full = torch.randn(2, 3, 11, 11, generator=gen)
    cases = [full.reshape(6, 11, 11), full[:, :, :7, :7].reshape(6, 7, 7), full[:1, :, :7, :7].reshape(3, 7, 7),
             full[0, 0, :7, :7].expand(4, 7, 7), full.reshape(6, 11, 11).transpose(1, 2)]
    for mat in cases:
        G, r, c = mat.shape
        index = torch.stack([torch.randperm(r, generator=gen)[:4] for _ in range(G)])
        ref = mat.gather(1, index[:, :, None].expand(G, 4, c))
        assert torch.equal(gather_rows(mat, index), ref)
        problems = torch.tensor([G - 1, 0, G - 1])  # rows of chosen problems (repeats allowed), no copy first
        sub = index[:3]
        assert torch.equal(gather_rows(mat, sub, problems), mat[problems].gather(1, sub[:, :, None].expand(3, 4, c)))
    leaf = full[0].clone().requires_grad_()
    index = torch.tensor([[1, 2], [0, 0], [3, 1]])
    gather_rows(leaf, index).sum().backward()  # the differentiable path
    assert torch.equal(leaf.grad, torch.zeros(3, 11, 11).scatter_add(1, index[:, :, None].expand(3, 2, 11),
                                                                    torch.ones(3, 2, 11)))


def test_gather_rows_refuses_an_out_of_range_row():
    from sv_attention.svdd.polish import gather_rows

    mat = torch.arange(18.0).reshape(2, 3, 3)
    with pytest.raises(IndexError):
        gather_rows(mat, torch.tensor([[3], [0]]))  # row 3 of problem 0 would be row 0 of problem 1
    with pytest.raises(IndexError):
        gather_rows(mat, torch.tensor([[-1], [0]]))
