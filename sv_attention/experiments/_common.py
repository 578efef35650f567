"""Helpers shared by the experiments: RBF readouts with arbitrary weights, decoding, table rows."""

from __future__ import annotations

from typing import Any

import numpy as np

from sv_attention.errors import InvalidInputError


def sq_dists(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Squared distances ``[q, n]`` computed from differences (exact for near-duplicates)."""
    diff = a[:, None, :] - b[None, :, :]
    return np.einsum("qnd,qnd->qn", diff, diff)


def rbf_readout(Q: np.ndarray, keys: np.ndarray, weights: np.ndarray, values: np.ndarray,
                sigma: float) -> np.ndarray:
    """``o(q) = sum_i w_i k(q, x_i) v_i / sum_i w_i k(q, x_i)`` with ``k = exp(-||q-x||^2/sigma^2)``.

    Keys with weight 0 are ignored (they contribute exactly nothing). Computed as a softmax over
    ``log w_i - ||q - x_i||^2 / sigma^2``.

    Parameters
    ----------
    Q : ``[q, d]``; keys : ``[n, d]``; weights : ``[n]`` (>= 0, at least one > 0); values : ``[n, dv]``
    sigma : bandwidth

    Returns
    -------
    ``[q, dv]``
    """
    w = np.asarray(weights, dtype=np.float64)
    if (w < 0).any() or not (w > 0).any():
        raise InvalidInputError("readout weights must be >= 0 with at least one > 0")
    nz = w > 0
    logits = np.log(w[nz])[None, :] - sq_dists(Q, keys[nz]) / (sigma * sigma)
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    return p @ values[nz]


def softmax_readout(Q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float) -> np.ndarray:
    """Softmax attention readout ``softmax(scale * Q K^T) V`` -> ``[q, dv]``."""
    logits = scale * (Q @ keys.T)
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    return p @ values


def nearest(outputs: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Index of the nearest candidate (Euclidean) for each output: ``[q, dv] x [c, dv] -> [q]``."""
    return np.argmin(sq_dists(outputs, candidates), axis=1)


def row(metric: str, published: Any, ours: Any, note: str = "") -> dict[str, Any]:
    """One "published vs this implementation" table row."""
    out = {"metric": metric, "published": published, "ours": ours}
    if note:
        out["note"] = note
    return out


def mean(xs: Any) -> float:
    a = np.asarray(xs, dtype=np.float64)
    return float(a.mean()) if a.size else float("nan")
