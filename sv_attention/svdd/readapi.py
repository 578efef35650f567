"""Read API shared by the maintained solver and the from-scratch reference.

Both expose ``ids``, ``keys``, ``alpha``, ``rho``, ``sigma``; this mixin adds the decision function
(DESIGN §2.1, ``f(x) = 2 sum_j alpha_j k(x, x_j) - rho``) and the RBF readout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sv_attention.errors import InvalidInputError, UnknownIdError


def as_float64_matrix(x: Any, name: str, d: int | None = None) -> np.ndarray:
    """Validate a ``[m, d]`` float64 array (numpy or torch) and return a contiguous numpy copy.

    Raises :class:`InvalidInputError` on a wrong type, dtype, shape or non-finite entries.
    """
    try:
        import torch

        if isinstance(x, torch.Tensor):
            if x.dtype != torch.float64:
                raise InvalidInputError(
                    f"{name} must be float64, got {x.dtype}; convert with .double() (the exact solver is fp64)")
            x = x.detach().cpu().numpy()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    if not isinstance(x, np.ndarray):
        raise InvalidInputError(f"{name} must be a numpy array or torch tensor, got {type(x).__name__}")
    if x.dtype != np.float64:
        raise InvalidInputError(
            f"{name} must be float64, got {x.dtype}; convert with .astype(np.float64) (the exact solver is fp64)")
    if x.ndim != 2:
        raise InvalidInputError(
            f"{name} must have shape [m, d], got shape {tuple(x.shape)}; a single key x is passed as x[None, :]")
    if d is not None and x.shape[1] != d:
        raise InvalidInputError(f"{name} has feature dim {x.shape[1]}, but this solver holds d={d} keys")
    if not np.isfinite(x).all():
        raise InvalidInputError(f"{name} contains NaN or Inf; clean the input before passing it")
    return np.ascontiguousarray(x, dtype=np.float64).copy()


def as_id_array(ids: Any, name: str = "ids") -> np.ndarray:
    """Validate ids (an int, or a 1-D sequence / array / tensor of integers) as int64 ``[m]``.

    Raises :class:`InvalidInputError` for bools, non-integer values (``5.7`` is not truncated to 5) and
    arrays of more than one dimension (not flattened).
    """
    if type(ids).__module__.startswith("torch"):
        ids = ids.detach().cpu().numpy()
    if isinstance(ids, (int, np.integer)) and not isinstance(ids, (bool, np.bool_)):
        ids = [ids]
    arr = np.asarray(ids)
    if arr.size == 0 and arr.ndim <= 1:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool:
        raise InvalidInputError(f"{name} must be an int or a 1-D sequence of integers, got dtype {arr.dtype} "
                                f"shape {arr.shape}")
    return arr.astype(np.int64)


def sq_dists(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact squared distances ``[q, n]`` by differences (no cancellation for near-duplicates)."""
    diff = a[:, None, :] - b[None, :, :]
    return np.einsum("qnd,qnd->qn", diff, diff)


KERNEL_ABS_TOL = 1e-15
"""Largest rounding error :func:`rbf_cross` tolerates in a kernel value before recomputing it by differences."""


def rbf_cross(a: np.ndarray, b: np.ndarray, inv_s2: float) -> np.ndarray:
    """RBF kernel ``exp(-||a_i - b_j||^2 * inv_s2)``, ``[m, p]``, accurate for keys far from the origin.

    One matrix product on keys centred on the mean of ``b`` (so an offset shared by the keys cancels
    before any product is formed); every entry whose rounding bound could still move the kernel value by
    more than :data:`KERNEL_ABS_TOL` -- keys far from that centre but close to each other, or non-finite
    intermediate values from huge keys -- is recomputed by differences. Never NaN for finite input.
    """
    m, p = a.shape[0], b.shape[0]
    if m == 0 or p == 0:
        return np.zeros((m, p))
    d = a.shape[1]
    with np.errstate(over="ignore", invalid="ignore"):
        c = b.mean(axis=0)
        if not np.isfinite(c).all():
            c = b[0]
        ac, bc = a - c, b - c
        a2 = np.einsum("md,md->m", ac, ac)
        b2 = np.einsum("pd,pd->p", bc, bc)
        norms = a2[:, None] + b2[None, :]
        d2 = norms - 2.0 * (ac @ bc.T)
        err = (d + 8) * np.finfo(np.float64).eps * norms
        risky = ~np.isfinite(d2) | (err * inv_s2 * np.exp(-np.maximum(d2 - err, 0.0) * inv_s2) > KERNEL_ABS_TOL)
    if risky.any():
        ii, jj = np.nonzero(risky)
        with np.errstate(over="ignore"):
            diff = a[ii] - b[jj]
            d2[ii, jj] = np.einsum("kd,kd->k", diff, diff)
    return np.exp(-np.maximum(d2, 0.0) * inv_s2)


class ReadAPI:
    """Mixin: ``decision_function`` and ``readout`` from ``ids``, ``keys``, ``alpha``, ``rho``, ``sigma``."""

    ids: np.ndarray
    keys: np.ndarray
    alpha: np.ndarray
    rho: float
    sigma: float

    def _support(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a = self.alpha
        nz = a > 0
        return self.ids[nz], self.keys[nz], a[nz]

    def decision_function(self, X: Any) -> Any:
        """``f(x) = 2 sum_j alpha_j k(x, x_j) - rho``.

        Parameters
        ----------
        X : float64 ``[q, d]`` (numpy or torch)

        Returns
        -------
        ``[q]`` float64, of the input's type (numpy or torch).
        """
        is_torch = type(X).__module__.startswith("torch")
        Xn = as_float64_matrix(X, "X", d=self.keys.shape[1] if self.keys.size else None)
        _, xs, a = self._support()
        kx = np.exp(-sq_dists(Xn, xs) / (self.sigma * self.sigma))
        out = 2.0 * kx @ a - self.rho
        if is_torch:
            import torch

            return torch.from_numpy(out)
        return out

    def readout(self, Q: Any, values_by_id: Mapping[int, Any] | Any) -> Any:
        """RBF readout ``o(q) = sum_i alpha_i k(q, x_i) v_i / sum_i alpha_i k(q, x_i)`` (DESIGN §2.1).

        Computed as a softmax over ``log alpha_i - ||q - x_i||^2 / sigma^2`` (the same number, with no
        0/0 for far queries).

        Parameters
        ----------
        Q : float64 ``[q, d]`` (numpy or torch)
        values_by_id : a mapping ``id -> value [dv]`` covering every support id, or an array
            ``[n, dv]`` aligned with ``self.ids``

        Returns
        -------
        ``[q, dv]`` float64, of Q's type.
        """
        is_torch = type(Q).__module__.startswith("torch")
        Qn = as_float64_matrix(Q, "Q", d=self.keys.shape[1] if self.keys.size else None)
        sid, xs, a = self._support()
        if isinstance(values_by_id, Mapping):
            missing = [int(i) for i in sid if int(i) not in values_by_id]
            if missing:
                raise UnknownIdError(f"values_by_id lacks support ids {missing[:10]}; pass a value for every id "
                                     "with alpha > 0 (see .ids / .alpha)")
            V = np.stack([np.asarray(_to_numpy(values_by_id[int(i)]), dtype=np.float64).reshape(-1) for i in sid])
        else:
            V = np.asarray(_to_numpy(values_by_id), dtype=np.float64)
            if V.ndim != 2 or V.shape[0] != len(self.ids):
                raise InvalidInputError(f"values must be [n={len(self.ids)}, dv] aligned with .ids, "
                                        f"got shape {tuple(V.shape)}")
            V = V[self.alpha > 0]
        if not np.isfinite(V).all():
            raise InvalidInputError("values contain NaN or Inf; clean them before the readout")
        logits = np.log(a)[None, :] - sq_dists(Qn, xs) / (self.sigma * self.sigma)
        logits -= logits.max(axis=1, keepdims=True)
        w = np.exp(logits)
        w /= w.sum(axis=1, keepdims=True)
        out = w @ V
        if is_torch:
            import torch

            return torch.from_numpy(out)
        return out


def _to_numpy(v: Any) -> Any:
    if type(v).__module__.startswith("torch"):
        return v.detach().cpu().double().numpy()
    return v
