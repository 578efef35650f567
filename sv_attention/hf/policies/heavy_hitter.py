"""Heavy hitters ("H2O"): keep the tokens that have received the most attention mass."""

from __future__ import annotations

import numpy as np

from sv_attention.hf.policies.base import EvictionPolicy, PolicyContext, top_k_mask


class HeavyHitterPolicy(EvictionPolicy):
    """Keep the ``budget`` tokens with the largest accumulated attention mass (ties: the more recent).

    The mass comes from ``ctx.attention_mass``; :func:`softmax_attention_mass` (dot-product attention,
    as in H2O) and :func:`rbf_attention_mass` compute it for key streams.
    """

    name = "h2o"
    needs = ("attention_mass",)

    def _keep(self, ctx: PolicyContext, budget: int) -> tuple[np.ndarray, dict]:
        return top_k_mask(np.asarray(ctx.attention_mass, dtype=float), budget, ctx.positions), {}



def _accumulated_softmax_mass(logits: np.ndarray, causal: bool, query_positions: np.ndarray | None,
                              key_positions: np.ndarray | None) -> np.ndarray:
    """Row-softmax of ``logits [m, n]`` (causally masked by positions when asked), summed over rows -> ``[n]``.

    Rows with no visible key contribute 0 (no NaN).
    """
    from sv_attention.errors import InvalidInputError

    if causal:
        if query_positions is None or key_positions is None:
            raise InvalidInputError("causal attention mass needs query_positions and key_positions")
        visible = np.asarray(key_positions)[None, :] <= np.asarray(query_positions)[:, None]
        logits = np.where(visible, logits, -np.inf)
    mx = logits.max(axis=1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    w = np.exp(logits - mx)
    z = w.sum(axis=1, keepdims=True)
    return np.divide(w, z, out=np.zeros_like(w), where=z > 0).sum(axis=0)

def rbf_attention_mass(queries: np.ndarray, keys: np.ndarray, sigma: float, causal: bool = False,
                       query_positions: np.ndarray | None = None,
                       key_positions: np.ndarray | None = None) -> np.ndarray:
    """Accumulated attention mass each key receives from the queries.

    Attention is the normalised RBF kernel ``a_qj = k(q, x_j) / sum_l k(q, x_l)`` (a softmax over
    ``-||q - x||^2 / sigma^2``), summed over queries. With ``causal=True`` a query at position ``p`` only
    attends to keys at positions ``<= p`` (as in H2O's online accumulation); otherwise every query sees
    every key (the "oracle" accumulation, which also uses future queries).

    Parameters
    ----------
    queries : ``[m, d]``
    keys : ``[n, d]``
    sigma : bandwidth (> 0)
    causal : bool
    query_positions : ``[m]`` (needed when causal)
    key_positions : ``[n]`` (needed when causal)

    Returns
    -------
    float64 ``[n]``: the mass received by each key.
    """
    from sv_attention.errors import InvalidHyperparameterError, InvalidInputError

    if not sigma > 0:
        raise InvalidHyperparameterError(f"sigma must be > 0, got {sigma!r}")
    q = np.asarray(queries, dtype=np.float64)
    x = np.asarray(keys, dtype=np.float64)
    if q.ndim != 2 or x.ndim != 2 or q.shape[1] != x.shape[1]:
        raise InvalidInputError(f"queries [m, d] and keys [n, d] must share d; got {q.shape} and {x.shape}")
    d2 = ((q[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    return _accumulated_softmax_mass(-d2 / sigma**2, causal, query_positions, key_positions)


def softmax_attention_mass(queries: np.ndarray, keys: np.ndarray, scale: float | None = None, causal: bool = False,
                           query_positions: np.ndarray | None = None,
                           key_positions: np.ndarray | None = None) -> np.ndarray:
    """Accumulated dot-product softmax attention mass (what H2O accumulates in a transformer).

    ``a_qj = softmax_j(scale * q . x_j)`` summed over queries; ``scale`` defaults to ``1 / sqrt(d)``.
    ``causal`` as in :func:`rbf_attention_mass`.

    Parameters
    ----------
    queries : ``[m, d]``; keys : ``[n, d]``

    Returns
    -------
    float64 ``[n]``.
    """
    from sv_attention.errors import InvalidInputError

    q = np.asarray(queries, dtype=np.float64)
    x = np.asarray(keys, dtype=np.float64)
    if q.ndim != 2 or x.ndim != 2 or q.shape[1] != x.shape[1]:
        raise InvalidInputError(f"queries [m, d] and keys [n, d] must share d; got {q.shape} and {x.shape}")
    sc = 1.0 / np.sqrt(q.shape[1]) if scale is None else float(scale)
    return _accumulated_softmax_mass(sc * (q @ x.T), causal, query_positions, key_positions)
