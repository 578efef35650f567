import pytest
import torch

from sv_attention.errors import InvalidHyperparameterError, InvalidInputError
from sv_attention.kernels import median_bandwidth, pairwise_sq_dists, rbf_gram


def test_rbf_gram_matches_definition_sigma_squared():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 3, generator=g, dtype=torch.float64)
    b = torch.randn(5, 3, generator=g, dtype=torch.float64)
    sigma = 1.7
    ref = torch.tensor([[float(torch.exp(-((x - y) ** 2).sum() / sigma**2)) for y in b] for x in a],
                       dtype=torch.float64)
    assert torch.allclose(rbf_gram(a, b, sigma), ref, rtol=0, atol=1e-14)
    k = rbf_gram(a, sigma=sigma)
    assert torch.equal(torch.diagonal(k), torch.ones(7, dtype=torch.float64))
    assert torch.allclose(k, k.T, atol=1e-15)


def test_rbf_gram_rejects_bad_sigma_and_dims():
    a = torch.randn(3, 2)
    with pytest.raises(InvalidHyperparameterError):
        rbf_gram(a, sigma=0.0)
    with pytest.raises(InvalidHyperparameterError):
        rbf_gram(a, sigma=float("nan"))
    with pytest.raises(InvalidInputError):
        pairwise_sq_dists(a, torch.randn(3, 4))


def test_median_bandwidth_with_mask():
    keys = torch.tensor([[0.0, 0.0], [3.0, 4.0], [100.0, 0.0]], dtype=torch.float64)
    med = median_bandwidth(keys, mask=torch.tensor([True, True, False]))
    assert float(med) == pytest.approx(5.0)
    assert float(median_bandwidth(torch.zeros(4, 2))) == 1.0


@pytest.mark.parametrize("sigma_shape", [None, (1, 1), (3, 1, 1), (2, 3, 1, 1)])
def test_rbf_gram_without_autograd_equals_the_autograd_formula(sigma_shape):
    """The in-place no-grad path of rbf_gram equals the differentiable one (also when sigma broadcasts)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 7, 4, generator=gen, dtype=torch.float64)
    b = torch.randn(3, 5, 4, generator=gen, dtype=torch.float64)
    sigma = 1.3 if sigma_shape is None else torch.rand(sigma_shape, generator=gen, dtype=torch.float64) + 0.5
    for other in (None, b):
        with torch.no_grad():
            fast = rbf_gram(a, other, sigma=sigma)
        slow = rbf_gram(a.clone().requires_grad_(), other, sigma=sigma).detach()
        assert fast.shape == slow.shape
        assert torch.allclose(fast, slow, atol=1e-14)
        if other is None:
            assert (torch.diagonal(fast, dim1=-2, dim2=-1) == 1).all()


def test_rbf_gram_dtype_does_not_depend_on_grad_mode():
    a = torch.randn(4, 3)
    for sigma in (torch.tensor(1.5, dtype=torch.float64), torch.full((1, 1), 1.5, dtype=torch.float64)):
        with torch.no_grad():
            fast = rbf_gram(a, sigma=sigma)
        slow = rbf_gram(a.clone().requires_grad_(), sigma=sigma)
        assert fast.dtype == slow.dtype  # fp32 for a 0-d sigma (no promotion), fp64 for a [1, 1] one
        assert torch.allclose(fast, slow.detach().to(fast.dtype))
