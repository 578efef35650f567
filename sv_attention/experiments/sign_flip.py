"""Content-conditional sign flips of ``d out_i / d v_j`` (the sign-flip experiment).

For a linear-in-v operator ``out = M v`` (M depends on q, k only), ``d out_i / d v_j = M_ij I``: the sign
of the scalar ``M_ij`` says whether token j's value pushes out_i along or against itself. For softmax
attention ``M = P`` is positive, so the sign never changes. For ceq ``M = sum_{h=1..K} A^h`` (the
path_sum form, off the diagonal; the hybrid adds ``P`` and alpha powers) is signed, and its sign can
depend on a *third* token c.

Protocol (one trial): draw q, k ~ N(0, sigma^2 I_d) for s tokens (``qk_std`` = sigma; logits
``q.k / sqrt(d)`` then have standard deviation sigma^2); query i = s - 1; j uniform in [0, i); c
uniform in [0, i) without j; redraw token c's (q_c, k_c) once; a flip is ``sign M_ij`` before != after
(a zero on either side is not a flip). The rate is flips / trials with a Wilson 95% interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sv_attention.errors import ConfigError, InvalidHyperparameterError
from sv_attention.ops.ceq import DEFAULTS, ceq_matrix
from sv_attention.ops.masking import causal_mask

OPERATORS = ("sgate", "signed", "softmax")


def wilson_interval(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score 95% interval for a binomial proportion ``k / n``."""
    if n <= 0:
        raise InvalidHyperparameterError("wilson_interval needs n >= 1")
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


@dataclass
class SignFlipResult:
    """Flip count of one (operator, s) cell.

    Attributes
    ----------
    operator, s, trials, flips, rate, ci_low, ci_high
        The cell and its Wilson 95% interval.
    median_abs_grad, p10_abs_grad : float
        Median / 10th percentile of ``|M_ij|`` over the base draws (is the gradient flooring at 0?).
    """

    operator: str
    s: int
    trials: int
    flips: int
    rate: float
    ci_low: float
    ci_high: float
    median_abs_grad: float
    p10_abs_grad: float


def coefficient(q: torch.Tensor, k: torch.Tensor, operator: str, form: str = "path_sum",
                alpha: float = 1.0) -> torch.Tensor:
    """``M = d out / d v`` per (query, key) pair: ``[b, h, s, s]`` from q, k ``[b, h, s, d]``.

    softmax: causal softmax P. sgate / signed: ``sum_{h=1..K} A^h`` (path_sum, off-diagonal part) or
    ``P + sum_h (alpha A)^h`` (hybrid), K = the operator's default hops.
    """
    s = q.shape[-2]
    w = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    vis = causal_mask(s, s, device=q.device)
    p = torch.softmax(w.masked_fill(~vis, float("-inf")), dim=-1)
    if operator == "softmax":
        return p
    if operator not in DEFAULTS:
        raise ConfigError(f"unknown operator {operator!r}; choose one of {OPERATORS}")
    a = ceq_matrix(q, k, operator=operator)
    hops = int(DEFAULTS[operator]["hops"])
    scale = 1.0 if form == "path_sum" else alpha
    acc = torch.zeros_like(a)
    term = torch.eye(s, dtype=a.dtype).expand_as(a)
    for _ in range(hops):
        term = (scale * a) @ term
        acc = acc + term
    return acc if form == "path_sum" else p + acc


def sign_flip_rate(operator: str, s: int, trials: int, *, dim: int = 16, seed: int = 0, form: str = "path_sum",
                   alpha: float = 1.0, qk_std: float = 1.0, batch: int = 256) -> SignFlipResult:
    """Run ``trials`` trials of the protocol above for one operator and length (fp64).

    Parameters
    ----------
    operator : {"sgate", "signed", "softmax"}
    s : int
        Sequence length (>= 3).
    trials : int
    dim : int
        Head dimension d.
    seed : int
    form : {"path_sum", "hybrid"}
        Which ceq form's coefficient to test (softmax ignores it).
    alpha : float
        Hybrid hop weight.
    qk_std : float
        Standard deviation of the q / k entries (the logit scale; the flip rate depends on it strongly).
    batch : int
        Trials evaluated at once.
    """
    if s < 3:
        raise InvalidHyperparameterError(f"the sign-flip protocol needs s >= 3 (i, j and a third token), got {s}")
    if not qk_std > 0:
        raise InvalidHyperparameterError(f"qk_std must be > 0, got {qk_std}")
    if trials < 1:
        raise InvalidHyperparameterError(f"trials must be >= 1, got {trials}")
    if form not in ("path_sum", "hybrid"):
        raise ConfigError(f"form must be 'path_sum' or 'hybrid', got {form!r}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + s)
    flips = 0
    mags: list[torch.Tensor] = []
    i = s - 1
    done = 0
    while done < trials:
        n = min(batch, trials - done)
        q = torch.randn(n, 1, s, dim, dtype=torch.float64, generator=g) * qk_std
        k = torch.randn(n, 1, s, dim, dtype=torch.float64, generator=g) * qk_std
        j = torch.randint(0, i, (n,), generator=g)
        c = torch.randint(0, i - 1, (n,), generator=g)
        c = c + (c >= j).long()  # uniform over [0, i) without j
        rows = torch.arange(n)
        q2, k2 = q.clone(), k.clone()
        q2[rows, 0, c] = torch.randn(n, dim, dtype=torch.float64, generator=g) * qk_std
        k2[rows, 0, c] = torch.randn(n, dim, dtype=torch.float64, generator=g) * qk_std
        m1 = coefficient(q, k, operator, form, alpha)[rows, 0, i, j]
        m2 = coefficient(q2, k2, operator, form, alpha)[rows, 0, i, j]
        flips += int(((torch.sign(m1) * torch.sign(m2)) < 0).sum())
        mags.append(m1.abs())
        done += n
    lo, hi = wilson_interval(flips, trials)
    mag = torch.cat(mags)
    return SignFlipResult(operator, s, trials, flips, flips / trials, lo, hi, float(mag.median()),
                          float(torch.quantile(mag, 0.1)))


def fit_power_decay(ss: list[int], rates: list[float], trials: list[int]) -> dict:
    """Weighted least-squares fit ``log rate = log a - b log s`` over cells with a positive rate.

    Weights are the binomial delta-method inverse variances of ``log rate`` (``n p / (1 - p)``). Returns
    ``{"a", "b", "b_se", "b_ci95", "n_points"}``; ``b`` is None with fewer than 3 positive cells.
    """
    pts = [(s, r, n) for s, r, n in zip(ss, rates, trials, strict=True) if 0 < r < 1]
    if len(pts) < 3:
        return {"a": None, "b": None, "b_se": None, "b_ci95": None, "n_points": len(pts)}
    x = torch.tensor([math.log(s) for s, _, _ in pts], dtype=torch.float64)
    y = torch.tensor([math.log(r) for _, r, _ in pts], dtype=torch.float64)
    w = torch.tensor([n * r / (1 - r) for _, r, n in pts], dtype=torch.float64)
    xm = (w * x).sum() / w.sum()
    ym = (w * y).sum() / w.sum()
    sxx = (w * (x - xm) ** 2).sum()
    slope = float((w * (x - xm) * (y - ym)).sum() / sxx)
    se = float(math.sqrt(1.0 / float(sxx)))
    b = -slope
    return {"a": math.exp(float(ym) - slope * float(xm)), "b": b, "b_se": se,
            "b_ci95": [b - 1.96 * se, b + 1.96 * se], "n_points": len(pts)}


__all__ = ["OPERATORS", "SignFlipResult", "coefficient", "fit_power_decay", "sign_flip_rate", "wilson_interval"]
