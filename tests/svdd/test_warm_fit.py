"""Warm-started SVDD fits (sv_attention.svdd.warm_fit): partitions from the previous boundary's."""

import pytest
import torch

from sv_attention.kernels import median_bandwidth, rbf_gram
from sv_attention.svdd import native_build
from sv_attention.svdd.batched import solve_batched
from sv_attention.svdd.polish import POLISH_RIDGE, fixed_partition_solve, polish_ridge
from sv_attention.svdd.warm_fit import (
    fit_warm,
    fit_working_set,
    partition_from_alpha,
)

C = 1.0 / (0.3 * 32)


def _gram(seed: int, G: int = 4, n: int = 128, d: int = 8) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(G, n, d, generator=gen, dtype=torch.float64)
    return rbf_gram(keys, sigma=median_bandwidth(keys)[:, None, None])


def _solve(gram, mask, C, init=None):
    kw = {} if init is None else {"init_alpha": init, "fista_iters": 10}
    return solve_batched(gram, mask, C, check_inputs=False, ridge=POLISH_RIDGE, **kw)


@pytest.mark.parametrize("seed", [0, 3])
def test_fit_warm_and_working_set_equal_the_exact_cold_fit_and_count(seed):
    gram = _gram(seed)
    G, n, _ = gram.shape
    mask = torch.ones(G, n, dtype=torch.bool)
    prev = solve_batched(gram[:, :96, :96], mask[:, :96], C, ridge=0.0).alpha.clamp_min(0.0)
    init = torch.nn.functional.pad(prev, (0, 32))
    margin, error = partition_from_alpha(init, C)
    assert not (margin & error).any() and not (margin | error)[:, 96:].any()
    stats: dict[str, int] = {}

    def count(key: str, k: int = 1) -> None:
        stats[key] = stats.get(key, 0) + k

    warm = fit_warm(gram, init, C, 32, solve=_solve, count=count, stat="my_fits")
    ws = fit_working_set(gram, init, C, 32, solve=_solve, count=count)
    exact = solve_batched(gram, mask, C, ridge=0.0).alpha.clamp_min(0.0)
    assert stats["my_fits"] == 1 and stats["pdas_problems"] == G
    assert stats.get("working_set_full", 0) == 0
    assert torch.allclose(warm, exact, atol=1e-5) and torch.allclose(ws, exact, atol=1e-5)
    assert torch.allclose(warm.sum(-1), torch.ones(G, dtype=gram.dtype), atol=1e-10)


@pytest.mark.parametrize("seed", [0, 1])
def test_active_set_fit_equals_the_polish_and_the_exact_solve(seed):
    """The lean active-set iteration lands on the partition and the exact optimum of the general polish."""
    from sv_attention.svdd.polish import POLISH_RIDGE, active_set_polish
    from sv_attention.svdd.warm_fit import active_set_fit

    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(3, 96, 6, generator=gen, dtype=torch.float64)
    gram = rbf_gram(keys, sigma=median_bandwidth(keys)[:, None, None])
    C = 1.0 / (0.3 * 32)
    mask = torch.ones(3, 96, dtype=torch.bool)
    mask[1, 80:] = False  # a shorter problem: its padded keys never enter
    uniform = torch.where(mask, 1.0 / mask.sum(-1, keepdim=True), torch.zeros(3, 96, dtype=torch.float64))
    start_m, start_e = uniform > 0, torch.zeros_like(mask)
    fit = active_set_fit(gram, mask, start_m, start_e, C, 40, 1e-12, POLISH_RIDGE)
    assert fit.settled.all() and (fit.violation <= 1e-10).all()
    assert not (fit.margin | fit.error)[1, 80:].any()
    Ct = torch.full((3,), C, dtype=torch.float64)
    pol = active_set_polish(gram, mask, start_m, start_e, Ct, 40, 1e-12)
    assert torch.equal(fit.margin, pol.margin) and torch.equal(fit.error, pol.error)
    exact = fixed_partition_solve(gram, mask, fit.margin, fit.error, Ct, POLISH_RIDGE)
    assert torch.allclose(fit.alpha, exact.alpha, atol=1e-12)
    assert torch.allclose(fit.rho, exact.rho, atol=1e-12)
    assert torch.allclose(fit.alpha.sum(-1), torch.ones(3, dtype=torch.float64), atol=1e-10)


def test_a_known_starting_solution_skips_the_first_solve_without_changing_the_result():
    from sv_attention.svdd.polish import POLISH_RIDGE
    from sv_attention.svdd.warm_fit import active_set_fit, partition_from_alpha

    gen = torch.Generator().manual_seed(4)
    keys = torch.randn(2, 128, 8, generator=gen, dtype=torch.float64)
    gram = rbf_gram(keys, sigma=median_bandwidth(keys)[:, None, None])
    C = 1.0 / (0.3 * 32)
    mask = torch.ones(2, 128, dtype=torch.bool)
    prev = active_set_fit(gram[:, :64, :64].contiguous(), mask[:, :64], *partition_from_alpha(
        torch.full((2, 64), 1.0 / 64, dtype=torch.float64), C), C, 40, 1e-12, POLISH_RIDGE)
    assert prev.settled.all()
    init = torch.nn.functional.pad(prev.alpha, (0, 64))
    margin, error = partition_from_alpha(init, C)
    solved = active_set_fit(gram, mask, margin, error, C, 40, 1e-12, POLISH_RIDGE)
    known = active_set_fit(gram, mask, margin, error, C, 40, 1e-12, POLISH_RIDGE, start_alpha=init)
    assert solved.settled.all() and known.settled.all()
    assert torch.equal(known.margin, solved.margin) and torch.equal(known.error, solved.error)
    assert torch.allclose(known.alpha, solved.alpha, atol=1e-12)
    assert known.steps == solved.steps - 1  # one solve fewer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cold_start_from_uniform_on_clustered_keys_gives_valid_gates(dtype):
    """A cold start (uniform alpha, new = 0) whose active-set steps oscillate falls back to the cold solve,
    never to a warm-settings solve: every gate sums to 1 within the box and equals the cold solution."""
    from sv_attention.ops.sv_gate.fit import CountingSolve, count

    gen = torch.Generator().manual_seed(0)
    keys = (torch.randn(24, 64, 8, generator=gen) * 0.1 + torch.randn(24, 64, 1, generator=gen).sign()).to(dtype)
    gram = rbf_gram(keys, sigma=median_bandwidth(keys)[:, None, None])
    C = 1.0 / 9.6
    alpha = fit_warm(gram, torch.full((24, 64), 1.0 / 64, dtype=dtype), C, 0, solve=CountingSolve(), count=count,
                     stat="cold_pdas_fits")
    tol = 1e-4 if dtype == torch.float32 else 1e-9
    assert (alpha >= 0).all() and (alpha <= C * (1 + tol)).all()
    assert torch.allclose(alpha.sum(-1), torch.ones(24, dtype=dtype), atol=tol)
    cold = solve_batched(gram, torch.ones(24, 64, dtype=torch.bool), C, ridge=polish_ridge(dtype))
    ok = cold.status == 0
    assert ok.any()
    assert torch.allclose(alpha[ok], cold.alpha.clamp_min(0.0)[ok], atol=1e-3 if dtype == torch.float32 else 1e-8)


def test_a_start_that_is_not_the_solution_of_its_partition_is_solved():
    """start_alpha is verified (equal margin values of K_ii - 2 (K alpha)_i - ridge alpha_i, sum 1): a
    perturbed start costs a solve and the result is the exact optimum, not the perturbed input."""
    from sv_attention.svdd.warm_fit import active_set_fit, partition_from_alpha

    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 96, 8, generator=gen, dtype=torch.float64)
    gram = rbf_gram(keys, sigma=median_bandwidth(keys)[:, None, None])
    C = 1.0 / (0.3 * 32)
    mask = torch.ones(2, 96, dtype=torch.bool)
    exact = active_set_fit(gram, mask, *partition_from_alpha(torch.full((2, 96), 1.0 / 96, dtype=torch.float64),
                                                               C), C, 40, 1e-12, POLISH_RIDGE)
    assert exact.settled.all()
    margin, error = exact.margin, exact.error
    bad = torch.where(margin, exact.alpha * (1 + 1e-3 * torch.randn(2, 96, generator=gen, dtype=torch.float64)),
                      exact.alpha)
    fit = active_set_fit(gram, mask, margin, error, C, 40, 1e-12, POLISH_RIDGE, start_alpha=bad)
    assert fit.steps >= 1  # the perturbed start was not trusted
    assert fit.settled.all() and torch.allclose(fit.alpha, exact.alpha, atol=1e-12)
    trusted = active_set_fit(gram, mask, margin, error, C, 40, 1e-12, POLISH_RIDGE, start_alpha=exact.alpha)
    assert trusted.steps == 0 and torch.allclose(trusted.alpha, exact.alpha, atol=1e-12)


def test_active_set_fit_on_an_empty_batch():
    from sv_attention.svdd.warm_fit import active_set_fit

    fit = active_set_fit(torch.zeros(0, 5, 5), torch.zeros(0, 5, dtype=torch.bool), torch.zeros(0, 5, dtype=torch.bool),
                         torch.zeros(0, 5, dtype=torch.bool), 0.5, 10, 1e-6, 1e-6)
    assert fit.alpha.shape == (0, 5) and fit.settled.shape == (0,) and fit.steps == 0


def _low_rank_gram(seed: int) -> torch.Tensor:
    """Keys near a 2-d subspace in 64 dims: the flat, ill-conditioned Grams of a deeper layer at initialisation,
    on which the all-violators-at-once rule cycles."""
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(16, 64, 2, generator=gen, dtype=torch.float64)
    keys = latent @ torch.randn(2, 64, generator=gen, dtype=torch.float64) \
        + 0.3 * torch.randn(16, 64, 64, generator=gen, dtype=torch.float64)
    return rbf_gram(keys, sigma=median_bandwidth(keys)[:, None, None])


@pytest.mark.parametrize("engine", ["torch", pytest.param("native", marks=pytest.mark.skipif(
    native_build.compiler() is None, reason="no C compiler: the native kernel cannot be built"))])
def test_block_pivoting_safeguard_settles_problems_on_which_the_plain_rule_cycles(monkeypatch, engine):
    """Moving every violator at once cycles on these Grams (problems left unsettled after 64 steps); the
    block-pivoting safeguard (single largest pivots once the violator count stops improving) settles every
    problem, at the exact fp64 optimum (reference: the exact solver / clarabel)."""
    from sv_attention.svdd import warm_fit
    from sv_attention.svdd.batched_reference import reference_solution
    from sv_attention.svdd.polish import POLISH_RIDGE_FP64

    gram = _low_rank_gram(0)
    G, n, _ = gram.shape
    C = 1.0 / 32
    mask = torch.ones(G, n, dtype=torch.bool)
    start = (mask.clone(), torch.zeros_like(mask))
    monkeypatch.setattr(warm_fit, "PIVOT_BACKUP", 10**6)  # the plain rule: never falls back to single pivots
    plain = warm_fit.active_set_fit(gram, mask, *start, C, 64, 1e-12, POLISH_RIDGE_FP64, engine=engine)
    assert (~plain.settled).any()
    monkeypatch.undo()
    fit = warm_fit.active_set_fit(gram, mask, *start, C, 64, 1e-12, POLISH_RIDGE_FP64, engine=engine)
    assert fit.settled.all() and (fit.violation <= 1e-10).all() and fit.steps < 64
    for p in range(G):
        ref = reference_solution(gram[p], C)
        assert ref.kkt_residual < 1e-9
        assert torch.allclose(fit.alpha[p], torch.as_tensor(ref.alpha), atol=1e-8), p


def test_finished_problems_leave_the_batch_without_changing_any_result():
    """Compaction (the torch loop): a batch mixing fast and slow problems gives every problem the result it gets
    alone."""
    from sv_attention.svdd.polish import POLISH_RIDGE_FP64
    from sv_attention.svdd.warm_fit import active_set_fit

    gram = torch.cat([_gram(5, G=3, n=64), _low_rank_gram(0)[:5]])
    G, n, _ = gram.shape
    mask = torch.ones(G, n, dtype=torch.bool)
    start = (mask.clone(), torch.zeros_like(mask))
    both = active_set_fit(gram, mask, *start, 1.0 / 32, 64, 1e-12, POLISH_RIDGE_FP64, engine="torch")
    for p in range(G):
        alone = active_set_fit(gram[p:p + 1], mask[p:p + 1], start[0][p:p + 1], start[1][p:p + 1], 1.0 / 32, 64,
                               1e-12, POLISH_RIDGE_FP64, engine="torch")
        assert torch.equal(alone.margin[0], both.margin[p]) and torch.equal(alone.error[0], both.error[p])
        assert torch.allclose(alone.alpha[0], both.alpha[p], atol=1e-12) and bool(alone.settled[0]) == bool(both.settled[p])
