"""Tests for sv_attention.svdd.gram_rows: RBF Gram rows on demand."""

from __future__ import annotations

import pytest
import torch

from sv_attention.kernels import median_bandwidth, rbf_gram
from sv_attention.svdd.gram_rows import LazyRBFGram
from sv_attention.svdd.polish import POLISH_RIDGE
from sv_attention.svdd.warm_fit import active_set_fit, fit_warm, partition_from_alpha


def _keys(G=3, N=40, d=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(G, N, d, generator=gen, dtype=torch.float64)
    return keys, median_bandwidth(keys)


def test_rows_equal_the_dense_gram_and_are_kept():
    keys, sigma = _keys()
    dense = rbf_gram(keys, sigma=sigma[:, None, None])
    lazy = LazyRBFGram(keys, sigma)
    gen = torch.Generator().manual_seed(1)
    for s in (7, 23, 40):
        pre = lazy.prefix(s)
        assert pre.shape == (3, s, s)
        assert torch.equal(pre.diagonal(), torch.ones(3, s, dtype=torch.float64))
        for _ in range(3):
            index = torch.randint(0, s, (3, 4), generator=gen)
            got = pre.rows(index)
            want = dense[:, :s, :s].gather(1, index[:, :, None].expand(3, 4, s))
            assert torch.allclose(got, want, atol=1e-13)
        assert torch.allclose(pre.dense(), dense[:, :s, :s], atol=1e-13)
        assert torch.allclose(pre.dense(torch.tensor([2, 0])), dense[[2, 0], :s, :s], atol=1e-13)
    assert lazy.rows_computed <= 3 * 36  # at most the distinct keys asked for so far
    rows = lazy.prefix(40).rows(torch.arange(40).expand(3, 40).contiguous())  # every row
    assert lazy.rows_computed == 3 * 40  # each computed exactly once
    assert torch.equal(torch.diagonal(rows, dim1=-2, dim2=-1), torch.ones(3, 40, dtype=torch.float64))
    lazy.prefix(13).rows(torch.randint(0, 13, (3, 5), generator=gen))
    assert lazy.rows_computed == 3 * 40  # nothing recomputed


def test_bad_prefixes_and_rows_are_refused():
    keys, sigma = _keys()
    lazy = LazyRBFGram(keys, sigma)
    with pytest.raises(ValueError):
        lazy.prefix(0)
    with pytest.raises(ValueError):
        lazy.prefix(41)
    with pytest.raises(IndexError):
        lazy.prefix(10).rows(torch.full((3, 1), 10))


@pytest.mark.parametrize("seed", [0, 1])
def test_fits_on_lazy_rows_equal_fits_on_the_dense_gram(seed):
    keys, sigma = _keys(G=4, N=160, d=8, seed=seed)
    keys[2] = keys[2] * 0.1 + torch.randn(160, 1, generator=torch.Generator().manual_seed(9),
                                          dtype=torch.float64).sign()  # clustered keys (may fall back)
    sigma = median_bandwidth(keys)
    dense = rbf_gram(keys, sigma=sigma[:, None, None])
    lazy = LazyRBFGram(keys, sigma)
    C = 1.0 / (0.3 * 32)
    mask = torch.ones(4, 96, dtype=torch.bool)
    start = partition_from_alpha(torch.full((4, 96), 1.0 / 96, dtype=torch.float64), C)
    a = active_set_fit(dense[:, :96, :96].contiguous(), mask, *start, C, 40, 1e-12, POLISH_RIDGE)
    b = active_set_fit(lazy.prefix(96), mask, *start, C, 40, 1e-12, POLISH_RIDGE)
    assert torch.equal(a.settled, b.settled) and a.settled.sum() >= 3
    ok = a.settled  # unsettled problems are the caller's to refit (fit_warm below does)
    assert torch.equal(a.margin[ok], b.margin[ok])
    assert torch.allclose(a.alpha[ok], b.alpha[ok], atol=1e-12)

    def solve(gram, mask, C, init=None):
        from sv_attention.svdd.batched import solve_batched

        return solve_batched(gram, mask, C, ridge=POLISH_RIDGE, init_alpha=init)

    init = torch.nn.functional.pad(torch.where(ok[:, None], a.alpha, 1.0 / 96).clamp_min(0.0), (0, 64))
    wd = fit_warm(dense, init, C, 64, solve=solve)
    wl = fit_warm(lazy.prefix(160), init, C, 64, solve=solve)
    assert torch.allclose(wd, wl, atol=1e-10)
    assert lazy.rows_computed < 4 * 160  # only margin / error keys' rows were ever built
