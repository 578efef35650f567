"""One layer's smprime parameters: the learnable scalars and the per-position gate heads."""

from __future__ import annotations

import torch
from torch import nn

from sv_attention.errors import InvalidInputError
from sv_attention.ops.smprime.attention import smprime_attention

M_BIAS = 1.0 - 1e-3
THETA_BIAS = 1e-3


class SMPrime(nn.Module):
    """One layer's smprime arm: learnable scalars ``beta``, ``qk``, ``g`` (init 1) and the per-position
    linear heads for u (-> m) and theta.

    Parameters
    ----------
    d_model : int
        Hidden size the heads read.
    n_heads : int
        Query heads (one m and one theta per head and position).

    Notes
    -----
    The heads start with zero weights and biases ``1 - 1e-3`` (u) / ``1e-3`` (theta), so at init
    ``m = 1 - 1e-3`` everywhere: away from the annihilating ``m = 0`` point and from the ``m = 1`` clamp
    (where the gradient would vanish).
    """

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model < 1 or n_heads < 1:
            raise InvalidInputError(f"d_model and n_heads must be >= 1, got {d_model}, {n_heads}")
        self.n_heads = n_heads
        self.beta = nn.Parameter(torch.tensor(1.0))
        self.qk = nn.Parameter(torch.tensor(1.0))
        self.g = nn.Parameter(torch.tensor(1.0))
        self.u_head = nn.Linear(d_model, n_heads)
        self.theta_head = nn.Linear(d_model, n_heads)
        with torch.no_grad():
            self.u_head.weight.zero_()
            self.u_head.bias.fill_(M_BIAS)
            self.theta_head.weight.zero_()
            self.theta_head.bias.fill_(THETA_BIAS)

    def gates(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``m, theta'`` ``[b, h, s]`` from hidden states ``[b, s, d_model]``."""
        u = self.u_head(hidden).transpose(1, 2)
        th = self.theta_head(hidden).transpose(1, 2)
        g = self.g.to(u.dtype)
        m = torch.clamp(1.0 + g * (u - 1.0), 0.0, 1.0)
        return m, g * th

    def forward(self, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None, scaling: float | None = None) -> torch.Tensor:
        """``[b, s, d_model]`` hidden + q ``[b, h, s, d]``, k/v ``[b, h_kv, s, d]`` -> ``[b, h, s, d]``."""
        if hidden.dim() != 3 or hidden.shape[0] != q.shape[0] or hidden.shape[1] != q.shape[2]:
            raise InvalidInputError(f"hidden must be [b, s, d_model] matching q {tuple(q.shape)}, "
                                    f"got {tuple(hidden.shape)}")
        if q.shape[1] != self.n_heads:
            raise InvalidInputError(f"q has {q.shape[1]} heads, this SMPrime was built for {self.n_heads}")
        m, th = self.gates(hidden)
        return smprime_attention(q, k, v, m.to(q.dtype), th.to(q.dtype), beta=self.beta.to(q.dtype),
                                 qk=self.qk.to(q.dtype), mask=mask, scaling=scaling)


__all__ = ["M_BIAS", "THETA_BIAS", "SMPrime"]
