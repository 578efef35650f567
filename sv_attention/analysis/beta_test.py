"""The beta test for the smprime arm: is each layer's normaliser exponent beta still at 1?

:func:`beta_lrt` evaluates a held-out batch at the trained betas and with beta reset to 1 (one layer at a
time, then all together) and reports the likelihood-ratio statistic ``Lambda = 2 (LL(beta_final) -
LL(beta = 1))`` with two constants side by side:

* ``3.841`` — the chi-square(1) 0.95 quantile: ``Lambda <= 3.841`` is **PINNED** (beta = 1 not rejected);
* ``ln n`` (n = scored tokens) — the BIC / description-length price of one free parameter:
  ``Lambda > ln n`` is **MOVED**; in between is "rejected at 0.95, below description length".

The observed information ``I = -d^2 LL / d beta^2`` comes from the exact second derivative (double
backward) at the trained betas over the whole batch; the Wald statistic ``(beta - 1)^2 I`` cross-checks
the LRT verdict at 0.95, and the resolution ``|beta - 1|_min = sqrt(3.841 / I)`` is the smallest deviation
the batch could detect. A non-positive I is reported as undefined (Wald and resolution None), never
clamped. The model's parameters and every module's train/eval flag are restored exactly.

:class:`BetaGradientCensus` is the training-side companion: a running integral of ``|dL/dbeta|`` per
layer, updated after each backward.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TextIO

import torch
from torch import nn

from sv_attention.errors import ConfigError, InvalidInputError
from sv_attention.ops.smprime import SMPrime

CHI2_95_1DOF = 3.841
PINNED = "PINNED"
MOVED = "MOVED"
BETWEEN = "rejected at 0.95, below description length"


def find_smprime(model: nn.Module) -> list[tuple[str, SMPrime]]:
    """``(name, module)`` of every :class:`SMPrime` in ``model.named_modules()`` order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, SMPrime)]


def verdict(lam: float, n_tokens: int) -> str:
    """PINNED (``lam <= 3.841``), MOVED (``lam > ln n``), otherwise the in-between verdict."""
    if lam <= CHI2_95_1DOF:
        return PINNED
    if lam > math.log(n_tokens):
        return MOVED
    return BETWEEN


@dataclass
class BetaLayerTest:
    """One line of the beta test (a layer, or ``name == "joint"`` for all layers at once).

    Attributes
    ----------
    name : str
        Module path of the SMPrime, or ``"joint"``.
    beta : list of float
        Trained beta(s) tested.
    ll_final, ll_null : float
        Held-out log-likelihood (nats, summed over scored tokens) at the trained betas / with beta = 1.
    lam : float
        ``2 (ll_final - ll_null)``.
    verdict : str
        PINNED / MOVED / rejected at 0.95, below description length.
    info : float
        Observed information ``-d^2 LL / d beta^2`` over the batch (joint: ``1^T I 1``, the information
        along the all-layers-together direction).
    info_defined : bool
        ``info > 0``; otherwise wald / wald_agrees / resolution are None.
    wald : float or None
        ``(beta - 1)^2 I`` (joint: ``(beta - 1)^T I (beta - 1)`` with the full matrix).
    wald_agrees : bool or None
        Whether Wald and LRT agree on rejection at 0.95.
    resolution : float or None
        ``sqrt(3.841 / info)``.
    """

    name: str
    beta: list[float]
    ll_final: float
    ll_null: float
    lam: float
    verdict: str
    info: float
    info_defined: bool
    wald: float | None
    wald_agrees: bool | None
    resolution: float | None


@dataclass
class BetaLRTResult:
    """The beta test: per-layer lines, the joint line, and the constants used."""

    layers: list[BetaLayerTest]
    joint: BetaLayerTest
    n_tokens: int
    chi2_crit: float = CHI2_95_1DOF
    info_matrix: list[list[float]] = field(default_factory=list)

    @property
    def ln_n(self) -> float:
        return math.log(self.n_tokens)

    def as_dict(self) -> dict:
        """JSON-ready dictionary."""
        from dataclasses import asdict

        return {"n_tokens": self.n_tokens, "chi2_crit": self.chi2_crit, "ln_n": self.ln_n,
                "layers": [asdict(x) for x in self.layers], "joint": asdict(self.joint),
                "info_matrix": self.info_matrix}


def _n_scored(batch: Mapping[str, torch.Tensor]) -> int:
    labels = batch.get("labels", batch["input_ids"])
    return int((labels[:, 1:] != -100).sum())


def _modes(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    return [(m, m.training) for m in model.modules()]


def _line(name: str, betas: list[float], ll_f: float, ll_0: float, info: float, wald_raw: float | None,
          n: int) -> BetaLayerTest:
    lam = 2.0 * (ll_f - ll_0)
    defined = info > 0 and math.isfinite(info)
    wald = wald_raw if defined else None
    agrees = None if wald is None else ((wald > CHI2_95_1DOF) == (lam > CHI2_95_1DOF))
    res = math.sqrt(CHI2_95_1DOF / info) if defined else None
    return BetaLayerTest(name, betas, ll_f, ll_0, lam, verdict(lam, n), info, defined, wald, agrees, res)


def beta_lrt(model: nn.Module, batch: Mapping[str, torch.Tensor], *, n_tokens: int | None = None) -> BetaLRTResult:
    """Per-layer and joint likelihood-ratio test of ``beta = 1`` for every SMPrime in ``model``.

    Parameters
    ----------
    model : nn.Module
        Its ``forward(**batch)`` returns an object with ``.loss`` = mean token cross entropy (a
        transformers causal LM with ``labels``). Evaluated in eval mode; flags restored afterwards.
    batch : mapping
        ``input_ids`` ``[b, s]`` and optionally ``labels`` (default: ``input_ids``) and
        ``attention_mask``; a held-out batch.
    n_tokens : int, optional
        Number of scored tokens behind the mean loss; default: labels after the causal shift that are
        not -100 (transformers' convention). ``LL = -loss * n_tokens``.

    Returns
    -------
    BetaLRTResult

    Raises
    ------
    ConfigError
        The model has no SMPrime module.
    InvalidInputError
        ``input_ids`` missing, no scored token, or a non-finite loss.
    """
    mods = find_smprime(model)
    if not mods:
        raise ConfigError("beta_lrt needs a model with SMPrime modules (operator 'smprime'); found none")
    if "input_ids" not in batch:
        raise InvalidInputError("batch must contain 'input_ids' (and optionally 'labels', 'attention_mask')")
    inputs = dict(batch)
    inputs.setdefault("labels", inputs["input_ids"])
    n = int(n_tokens) if n_tokens is not None else _n_scored(inputs)
    if n < 1:
        raise InvalidInputError("the batch has no scored token (all labels are -100)")
    betas = [m.beta for _, m in mods]
    saved = [b.detach().clone() for b in betas]
    req = [b.requires_grad for b in betas]
    modes = _modes(model)

    def ll() -> float:
        with torch.no_grad():
            loss = model(**inputs).loss
        val = -float(loss) * n
        if not math.isfinite(val):
            raise InvalidInputError(f"the model's loss is not finite ({float(loss)}) on this batch")
        return val

    try:
        model.eval()
        ll_final = ll()
        ll_layer = []
        for i, b in enumerate(betas):
            with torch.no_grad():
                b.fill_(1.0)
            ll_layer.append(ll())
            with torch.no_grad():
                b.copy_(saved[i])
        with torch.no_grad():
            for b in betas:
                b.fill_(1.0)
        ll_joint = ll()
        with torch.no_grad():
            for b, s in zip(betas, saved, strict=True):
                b.copy_(s)
        # exact observed information: Hessian of LL in the betas by double backward
        for b in betas:
            b.requires_grad_(True)
        with torch.enable_grad():
            loss = model(**inputs).loss
            llt = -loss * n
            grads = torch.autograd.grad(llt, betas, create_graph=True, allow_unused=True)
            L = len(betas)
            hess = torch.zeros(L, L, dtype=torch.float64)
            for i, gi in enumerate(grads):
                if gi is None or not gi.requires_grad:
                    continue
                row = torch.autograd.grad(gi, betas, retain_graph=True, allow_unused=True)
                for j, r in enumerate(row):
                    if r is not None:
                        hess[i, j] = float(r.detach())
        info = -hess
    finally:
        with torch.no_grad():
            for b, s in zip(betas, saved, strict=True):
                b.copy_(s)
        for b, r in zip(betas, req, strict=True):
            b.requires_grad_(r)
        for m, flag in modes:
            m.training = flag
    dev = torch.tensor([float(s) - 1.0 for s in saved], dtype=torch.float64)
    lines = [
        _line(name, [float(saved[i])], ll_final, ll_layer[i], float(info[i, i]),
              float(dev[i] ** 2 * info[i, i]), n)
        for i, (name, _) in enumerate(mods)
    ]
    ones = torch.ones(len(betas), dtype=torch.float64)
    joint = _line("joint", [float(s) for s in saved], ll_final, ll_joint, float(ones @ info @ ones),
                  float(dev @ info @ dev), n)
    return BetaLRTResult(lines, joint, n, info_matrix=info.tolist())


def _fmt(x: float | None, spec: str = ".4g") -> str:
    return "undefined" if x is None else format(x, spec)


def lrt_report(result: BetaLRTResult, stream: TextIO | None = sys.stdout) -> str:
    """Print (to ``stream``; None: do not print) and return the report.

    One header line, then one line per layer and a joint line; every line states both constants
    (3.841 and ln n) and the resolution.
    """
    ln_n = result.ln_n
    out = [f"beta test on {result.n_tokens} held-out tokens: PINNED if Lambda <= {result.chi2_crit}, "
           f"MOVED if Lambda > ln n = {ln_n:.3f}; resolution |beta-1|_min = sqrt({result.chi2_crit} / I)"]
    for x in [*result.layers, result.joint]:
        beta = ", ".join(f"{b:.4f}" for b in x.beta) if len(x.beta) <= 4 else f"{len(x.beta)} betas"
        wald = (f"Wald {x.wald:.3f} ({'agrees' if x.wald_agrees else 'DISAGREES'})" if x.info_defined
                else f"Wald undefined (I = {x.info:.4g} <= 0)")
        out.append(
            f"{x.name}: beta=[{beta}] Lambda={x.lam:.3f} (3.841 | ln n={ln_n:.3f}) -> {x.verdict}; "
            f"I={x.info:.4g}; {wald}; resolution |beta-1|_min={_fmt(x.resolution)}")
    text = "\n".join(out)
    if stream is not None:
        print(text, file=stream)
    return text


class BetaGradientCensus:
    """Running integral of ``|dL/dbeta|`` per SMPrime layer (call :meth:`update` after each backward).

    Attributes
    ----------
    names : list of str
        Module paths, fixed at the first update.
    integral : list of float
        ``sum over steps of |beta.grad|`` per layer.
    steps : int
        Updates counted.
    missing : list of int
        Per layer, updates where ``beta.grad`` was None (e.g. beta frozen).
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        self.integral: list[float] = []
        self.missing: list[int] = []
        self.steps = 0

    def update(self, model: nn.Module) -> None:
        """Add this step's ``|dL/dbeta|`` of every SMPrime in ``model``."""
        mods = find_smprime(model)
        names = [n for n, _ in mods]
        if not self.names:
            self.names = names
            self.integral = [0.0] * len(names)
            self.missing = [0] * len(names)
        elif names != self.names:
            raise ConfigError(f"census started on layers {self.names}, the model now has {names}")
        for i, (_, m) in enumerate(mods):
            g = m.beta.grad
            if g is None:
                self.missing[i] += 1
            else:
                self.integral[i] += abs(float(g))
        self.steps += 1

    __call__ = update

    def as_dict(self) -> dict:
        """JSON-ready summary (integral and mean |dL/dbeta| per layer)."""
        return {"steps": self.steps, "layers": [
            {"name": n, "integral_abs_grad": s, "mean_abs_grad": s / max(self.steps - miss, 1), "missing": miss}
            for n, s, miss in zip(self.names, self.integral, self.missing, strict=True)]}

    def report(self) -> str:
        """One line per layer."""
        lines = [f"beta gradient census over {self.steps} steps"]
        for d in self.as_dict()["layers"]:
            lines.append(f"{d['name']}: integral |dL/dbeta| = {d['integral_abs_grad']:.4g} "
                         f"(mean {d['mean_abs_grad']:.4g}, missing {d['missing']})")
        return "\n".join(lines)


__all__ = ["BETWEEN", "CHI2_95_1DOF", "MOVED", "PINNED", "BetaGradientCensus", "BetaLRTResult", "BetaLayerTest",
           "beta_lrt", "find_smprime", "lrt_report", "verdict"]
