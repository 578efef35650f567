"""Plain reference implementations of the baselines the experiments compare against.

* **softmax attention** ``o_t = sum_i softmax_i(q_t . k_i * scale) v_i``;
* **linear attention** (Katharopoulos et al., 2020) with the ``elu(x) + 1`` feature map,
  ``o_t = phi(q_t)^T S_t / (phi(q_t)^T z_t)``, ``S_t = sum_{i<=t} phi(k_i) v_i^T``, ``z_t = sum_{i<=t} phi(k_i)``;
* **DeltaNet** (Schlag et al., 2021; Yang et al., 2024) with L2-normalised keys and queries,
  ``S_t = S_{t-1} + beta_t (v_t - S_{t-1} k_t) k_t^T``, ``o_t = S_t q_t``.

Each recurrent form (an obviously correct Python loop over time) sits beside a parallel form
(masked quadratic for linear attention; the triangular "UT" solve for DeltaNet). Tests compare the two.
All functions take ``[..., n, d]`` tensors (any leading batch / head dims) and keep the dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sv_attention.errors import InvalidHyperparameterError, InvalidInputError


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() < 2 or k.dim() < 2 or v.dim() < 2:
        raise InvalidInputError("q, k, v must be at least 2-D [..., n, d]")
    if q.shape[-1] != k.shape[-1]:
        raise InvalidInputError(f"q and k feature dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise InvalidInputError(f"k and v have different lengths: {k.shape[-2]} vs {v.shape[-2]}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not torch.isfinite(t).all():
            raise InvalidInputError(f"{name} contains NaN or inf; clean the input")


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """The positive feature map ``elu(x) + 1`` of linear attention."""
    return F.elu(x) + 1.0


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                      causal: bool = False) -> torch.Tensor:
    """Softmax attention (reference).

    Parameters
    ----------
    q : ``[..., m, d]``; k : ``[..., n, d]``; v : ``[..., n, dv]``
    scale : logit scale, default ``1 / sqrt(d)``
    causal : if True, ``m == n`` and query t reads keys ``0..t``

    Returns
    -------
    ``[..., m, dv]``
    """
    _check_qkv(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = (q @ k.transpose(-1, -2)) * scale
    if causal:
        m, n = q.shape[-2], k.shape[-2]
        if m != n:
            raise InvalidInputError(f"causal softmax needs as many queries as keys, got {m} and {n}")
        keep = torch.ones(m, n, dtype=torch.bool, device=q.device).tril()
        logits = logits.masked_fill(~keep, float("-inf"))
    return torch.softmax(logits, dim=-1) @ v


def linear_attention_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               eps: float = 1e-12) -> torch.Tensor:
    """Causal linear attention as a recurrence over time (reference).

    Parameters
    ----------
    q, k : ``[..., n, d]``; v : ``[..., n, dv]``

    Returns
    -------
    ``[..., n, dv]``; row t reads keys ``0..t``.
    """
    _check_qkv(q, k, v)
    pq, pk = elu_feature_map(q), elu_feature_map(k)
    n = k.shape[-2]
    state = torch.zeros(*k.shape[:-2], k.shape[-1], v.shape[-1], dtype=v.dtype, device=v.device)
    z = torch.zeros(*k.shape[:-2], k.shape[-1], dtype=v.dtype, device=v.device)
    outs = []
    for t in range(n):
        state = state + pk[..., t, :, None] * v[..., t, None, :]
        z = z + pk[..., t, :]
        num = (pq[..., t, :, None] * state).sum(-2)
        den = (pq[..., t, :] * z).sum(-1, keepdim=True)
        outs.append(num / (den + eps))
    return torch.stack(outs, dim=-2)


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                     eps: float = 1e-12) -> torch.Tensor:
    """Linear attention, parallel (masked quadratic) form.

    Parameters
    ----------
    q : ``[..., m, d]``; k : ``[..., n, d]``; v : ``[..., n, dv]``
    causal : if True (``m == n``) row t reads keys ``0..t``; otherwise every query reads every key
        (the state after the whole sequence).

    Returns
    -------
    ``[..., m, dv]``
    """
    _check_qkv(q, k, v)
    w = elu_feature_map(q) @ elu_feature_map(k).transpose(-1, -2)
    if causal:
        if q.shape[-2] != k.shape[-2]:
            raise InvalidInputError("causal linear attention needs as many queries as keys")
        w = w.tril()
    return (w @ v) / (w.sum(-1, keepdim=True) + eps)


def _normalise(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _beta_tensor(beta: float | torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    b = torch.as_tensor(beta, dtype=k.dtype, device=k.device)
    if not torch.isfinite(b).all() or (b < 0).any() or (b > 2).any():
        raise InvalidHyperparameterError(f"DeltaNet beta must lie in [0, 2] (stable range), got {beta}")
    return b.expand(k.shape[:-1]) if b.dim() == 0 else b


def delta_net_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        beta: float | torch.Tensor = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal DeltaNet as a recurrence over time (reference).

    Keys and queries are L2-normalised. ``S_t = S_{t-1} + beta_t (v_t - S_{t-1} k_t) k_t^T``,
    ``o_t = S_t q_t``.

    Parameters
    ----------
    q, k : ``[..., n, d]``; v : ``[..., n, dv]``
    beta : scalar or ``[..., n]`` writing strengths in ``[0, 2]``

    Returns
    -------
    (outputs ``[..., n, dv]``, final state ``[..., dv, d]``)
    """
    _check_qkv(q, k, v)
    b = _beta_tensor(beta, k)
    qn, kn = _normalise(q), _normalise(k)
    n = k.shape[-2]
    state = torch.zeros(*k.shape[:-2], v.shape[-1], k.shape[-1], dtype=v.dtype, device=v.device)
    outs = []
    for t in range(n):
        kt = kn[..., t, :]
        pred = (state @ kt[..., None])[..., 0]
        state = state + (b[..., t, None] * (v[..., t, :] - pred))[..., :, None] * kt[..., None, :]
        outs.append((state @ qn[..., t, :, None])[..., 0])
    return torch.stack(outs, dim=-2), state


def delta_net(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              beta: float | torch.Tensor = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal DeltaNet, parallel form (one unit-lower-triangular solve).

    With ``S_{t-1} = sum_{i<t} u_i k_i^T`` the delta rule gives
    ``u_t = beta_t (v_t - sum_{i<t} (k_i . k_t) u_i)``, i.e. ``(I + diag(beta) tril(K K^T, -1)) U = diag(beta) V``;
    then ``o_t = sum_{i<=t} (k_i . q_t) u_i`` and the final state is ``U^T K``.

    Parameters and returns as :func:`delta_net_recurrent`.
    """
    _check_qkv(q, k, v)
    b = _beta_tensor(beta, k)
    qn, kn = _normalise(q), _normalise(k)
    n = k.shape[-2]
    gram = kn @ kn.transpose(-1, -2)
    eye = torch.eye(n, dtype=k.dtype, device=k.device)
    a = eye + b[..., :, None] * gram.tril(-1)
    u = torch.linalg.solve_triangular(a, b[..., :, None] * v, upper=False, unitriangular=True)
    out = (qn @ kn.transpose(-1, -2)).tril() @ u
    state = u.transpose(-1, -2) @ kn
    return out, state


def delta_net_read(state: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Read a DeltaNet state ``[..., dv, d]`` with queries ``[..., m, d]`` (L2-normalised) -> ``[..., m, dv]``."""
    if state.shape[-1] != q.shape[-1]:
        raise InvalidInputError(f"state key dim {state.shape[-1]} != query dim {q.shape[-1]}")
    return _normalise(q) @ state.transpose(-1, -2)


def linear_attention_read(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Read the linear-attention state after the whole sequence ``k, v`` with queries ``q`` -> ``[..., m, dv]``."""
    return linear_attention(q, k, v, causal=False, eps=eps)
