"""gradcheck of the implicit backward (DESIGN §2.3) and comparison with the plain second-solve reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sv_attention.errors import InvalidInputError, WarmupError
from sv_attention.svdd import IncrementalSVDD
from sv_attention.svdd.implicit import (
    decision_scores,
    rbf_readout,
    svdd_alpha_rho,
    svdd_alpha_rho_reference,
)


@pytest.fixture(scope="module")
def solver() -> IncrementalSVDD:
    X = 0.8 * np.random.default_rng(0).standard_normal((14, 3))
    s = IncrementalSVDD.from_nu(nu=0.4, n0=14, sigma=1.5)
    s.add(X)
    sizes = s.partition.sizes
    assert sizes["margin"] >= 2 and sizes["error"] >= 1  # exercise every term of the backward
    return s


def keys_of(s: IncrementalSVDD) -> torch.Tensor:
    return torch.from_numpy(s.keys).requires_grad_(True)


def test_forward_matches_solver(solver):
    alpha, rho = svdd_alpha_rho(keys_of(solver), solver)
    np.testing.assert_allclose(alpha.detach().numpy(), solver.alpha, atol=1e-13)
    assert abs(rho.item() - solver.rho) <= 1e-13


def test_gradcheck_scalarisation_of_alpha_and_rho(solver):
    w = torch.from_numpy(np.random.default_rng(1).standard_normal(solver.n))

    def f(keys: torch.Tensor) -> torch.Tensor:
        alpha, rho = svdd_alpha_rho(keys, solver)
        return (w * alpha).sum() + 0.7 * rho

    assert torch.autograd.gradcheck(f, (keys_of(solver),), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradient_equals_second_solve_reference(solver):
    w = torch.from_numpy(np.random.default_rng(2).standard_normal(solver.n))
    grads = []
    for fn in (svdd_alpha_rho, svdd_alpha_rho_reference):
        k = keys_of(solver)
        alpha, rho = fn(k, solver)
        ((w * alpha).sum() - 1.3 * rho).backward()
        grads.append(k.grad.clone())
    rel = (grads[0] - grads[1]).norm() / grads[1].norm()
    assert rel <= 1e-10


def test_gradcheck_decision_scores(solver):
    X = torch.from_numpy(np.random.default_rng(3).standard_normal((5, 3))).requires_grad_(True)

    def f(keys: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        alpha, rho = svdd_alpha_rho(keys, solver)
        return decision_scores(X, keys, alpha, rho, solver.sigma)

    assert torch.autograd.gradcheck(f, (keys_of(solver), X), eps=1e-6, atol=1e-7, rtol=1e-5)
    with torch.no_grad():
        f0 = f(torch.from_numpy(solver.keys), X)
    np.testing.assert_allclose(f0.numpy(), solver.decision_function(X.detach().numpy()), atol=1e-13)


def test_gradcheck_rbf_readout(solver):
    rng = np.random.default_rng(4)
    Q = torch.from_numpy(rng.standard_normal((4, 3))).requires_grad_(True)
    V = torch.from_numpy(rng.standard_normal((solver.n, 2))).requires_grad_(True)

    def f(keys: torch.Tensor, V: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
        alpha, _ = svdd_alpha_rho(keys, solver)
        return rbf_readout(Q, keys, V, alpha, solver.sigma)

    assert torch.autograd.gradcheck(f, (keys_of(solver), V, Q), eps=1e-6, atol=1e-7, rtol=1e-5)
    with torch.no_grad():
        out = f(torch.from_numpy(solver.keys), V, Q)
    np.testing.assert_allclose(out.numpy(), solver.readout(Q.detach().numpy(), V.detach().numpy()), atol=1e-13)


def test_errors():
    s = IncrementalSVDD(C=0.1, sigma=1.0)
    s.add(np.zeros((2, 3)))
    with pytest.raises(WarmupError):
        svdd_alpha_rho(torch.zeros(2, 3, dtype=torch.float64), s)
    s2 = IncrementalSVDD.from_nu(nu=0.5, n0=10, sigma=1.0)
    s2.add(np.random.default_rng(0).standard_normal((10, 3)))
    with pytest.raises(InvalidInputError):
        svdd_alpha_rho(torch.zeros(10, 3), s2)  # float32
    with pytest.raises(InvalidInputError):
        svdd_alpha_rho(torch.zeros(9, 3, dtype=torch.float64), s2)
