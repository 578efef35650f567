"""RBF kernels and bandwidth calibration.

The kernel is ``k(a, b) = exp(-||a - b||^2 / sigma^2)`` (sigma squared, *not* 2 sigma squared), as in
DESIGN §2.1. All functions accept float32 or float64 torch tensors and keep the dtype.
"""

from __future__ import annotations

import functools

import torch

from sv_attention.errors import InvalidHyperparameterError, InvalidInputError


def _check_sigma(sigma: float | torch.Tensor) -> None:
    if isinstance(sigma, torch.Tensor):
        if not torch.isfinite(sigma).all() or (sigma <= 0).any():
            raise InvalidHyperparameterError(f"sigma must be finite and > 0, got {sigma}; pass a positive bandwidth")
    elif not (sigma > 0 and sigma < float("inf")):
        raise InvalidHyperparameterError(f"sigma must be finite and > 0, got {sigma!r}; pass a positive bandwidth")


def pairwise_sq_dists(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Squared Euclidean distances, clamped at 0.

    Parameters
    ----------
    a : Tensor ``[..., n, d]``
    b : Tensor ``[..., m, d]``

    Returns
    -------
    Tensor ``[..., n, m]`` with ``||a_i - b_j||^2``.
    """
    if a.shape[-1] != b.shape[-1]:
        raise InvalidInputError(f"feature dims differ: a has d={a.shape[-1]}, b has d={b.shape[-1]}")
    an = (a * a).sum(-1, keepdim=True)
    bn = (b * b).sum(-1, keepdim=True).transpose(-1, -2)
    d2 = an + bn - 2.0 * (a @ b.transpose(-1, -2))
    return d2.clamp_min(0.0)


def rbf_gram(a: torch.Tensor, b: torch.Tensor | None = None, sigma: float | torch.Tensor = 1.0) -> torch.Tensor:
    """RBF Gram matrix ``exp(-||a_i - b_j||^2 / sigma^2)``.

    Parameters
    ----------
    a : Tensor ``[..., n, d]``
    b : Tensor ``[..., m, d]`` or None (then ``b = a`` and the diagonal is exactly 1)
    sigma : float or Tensor broadcastable to ``[..., 1, 1]``

    Returns
    -------
    Tensor ``[..., n, m]``.
    """
    _check_sigma(sigma)
    same = b is None
    b = a if b is None else b
    needs_grad = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad
                                              or (isinstance(sigma, torch.Tensor) and sigma.requires_grad))
    same_dtype = not isinstance(sigma, torch.Tensor) or torch.result_type(a, sigma) == a.dtype == b.dtype
    if not needs_grad and a.shape[-1] == b.shape[-1] and same_dtype:
        return _rbf_gram_inplace(a, b, sigma, same)
    d2 = pairwise_sq_dists(a, b)
    if same:
        # Exact zeros on the diagonal (the expansion above leaves rounding noise there).
        n = a.shape[-2]
        eye = torch.eye(n, dtype=torch.bool, device=a.device)
        d2 = d2.masked_fill(eye, 0.0)
    s2 = sigma * sigma if not isinstance(sigma, torch.Tensor) else (sigma * sigma)
    return torch.exp(-d2 / s2)


@functools.lru_cache(maxsize=16)
def _upper_pairs(n: int, device: torch.device) -> torch.Tensor:
    """``torch.triu_indices(n, n, 1)`` (kept per size and device: every gate call of a layer asks for it)."""
    return torch.triu_indices(n, n, offset=1, device=device)


def median_bandwidth(keys: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Median pairwise distance of the keys, the default bandwidth rule.

    Parameters
    ----------
    keys : Tensor ``[..., n, d]``
    mask : bool Tensor ``[..., n]`` or None; False entries are ignored.

    Returns
    -------
    Tensor ``[...]``: the median of ``||x_i - x_j||`` over valid pairs i < j (1.0 where fewer than two
    valid keys exist, or where every distance is 0).
    """
    n = keys.shape[-2]
    d = pairwise_sq_dists(keys.detach(), keys.detach()).sqrt()
    iu = _upper_pairs(n, keys.device)
    vals = d[..., iu[0], iu[1]]  # [..., P]
    if mask is not None:
        pm = mask[..., iu[0]] & mask[..., iu[1]]
        vals = torch.where(pm, vals, torch.full_like(vals, float("nan")))
    if vals.shape[-1] == 0:
        return torch.ones(keys.shape[:-2], dtype=keys.dtype, device=keys.device)
    med = torch.nanmedian(vals, dim=-1).values
    ok = torch.isfinite(med) & (med > 0)
    return torch.where(ok, med, torch.ones_like(med))


def _rbf_gram_inplace(a: torch.Tensor, b: torch.Tensor, sigma: float | torch.Tensor, same: bool) -> torch.Tensor:
    """:func:`rbf_gram` without autograd: the same formula on one ``[..., n, m]`` buffer updated in place
    (one allocation instead of six; the Gram of a long prefix is the gate's largest tensor)."""
    an = (a * a).sum(-1, keepdim=True)
    bn = (b * b).sum(-1, keepdim=True).transpose(-1, -2)
    out = a @ b.transpose(-1, -2)
    out.mul_(-2.0).add_(an).add_(bn).clamp_min_(0.0)  # ||a_i - b_j||^2
    if same:
        out.diagonal(dim1=-2, dim2=-1).zero_()
    s2 = sigma * sigma
    if isinstance(s2, torch.Tensor) and torch.broadcast_shapes(out.shape, s2.shape) != out.shape:
        out = out / s2  # sigma adds batch dimensions: one more buffer of the broadcast shape
        return out.neg_().exp_()
    return out.div_(s2).neg_().exp_()
